"""Per-rank job lists: what every runtime backend walks (stage: runtime).

A rank's plan is a list of jobs, run in order: a :class:`Segment` (a PIR program run by the
Paddle executor on the rank's scope) or a :class:`CollectiveJob` (a collective performed by
the runtime between segments, reading and writing scope variables by name). The pipeline
schedule later interleaves segments of several micro-batches in the same form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of a rank program; reads/writes the rank's shared scope by variable name."""

    name: str
    program: Any  # paddle PIR Program
    feeds: tuple[str, ...] = ()  # global-feed names this segment reads from the feed dict
    fetches: tuple[str, ...] = ()  # scope names fetched after the segment (for user fetches)


@dataclass(frozen=True, slots=True)
class CollectiveJob:
    """One collective on scope variables.

    ``group``: the ranks taking part, in group order (rank ``group[i]`` holds piece ``i``).
    all_reduce: ``output = reduce(input over group)`` (``reduce`` = sum, avg, max, min).
    all_gather: ``output = concat(input over group, axis)`` (uneven pieces allowed).
    reduce_scatter: ``output = piece i (numpy.array_split bounds along axis) of reduce(input)``.
    broadcast: ``output = input of group[root]``.
    all_to_all: input split along ``split_axis`` into len(group) pieces, piece j sent to
    group[j]; received pieces concatenated along ``axis``.
    send / recv: point-to-point between ``group = (sender, receiver)``; ``input`` on the
    sender, ``output`` on the receiver (both ranks list the same job).
    """

    kind: str
    group: tuple[int, ...]
    input: str
    output: str
    reduce: str = "sum"
    axis: int = 0
    split_axis: int = 0
    root: int = 0
    reason: str = ""
    bytes: int = 0
    time: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}")


Job = Segment | CollectiveJob
