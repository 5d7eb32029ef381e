"""The jobs a host-form rank plan runs, in order (stage: runtime).

A :class:`Segment` is a piece of the rank program run by the Paddle executor on the rank's
scope; a :class:`CollectiveCall` is one of the plan's :class:`~autopar.collective.Collective`
values performed by the runtime between segments, reading and writing scope variables by
name (or, :class:`ScopeCall`, on the scope's tensors themselves). The pipeline schedule
interleaves segments of several micro-batches in the same form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.collective import Collective


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of a rank program; reads/writes the rank's shared scope by variable name."""

    name: str
    program: Any  # paddle PIR Program
    feeds: tuple[str, ...] = ()  # global-feed names this segment reads from the feed dict


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """``collective`` performed on the scope variable ``input`` (or, ``from_feed``, on this
    rank's piece of the feed named ``input``); the result goes to the scope variable ``output``."""

    collective: Collective
    input: str
    output: str
    from_feed: bool = False


Job = Segment | CollectiveCall


@dataclass(frozen=True, slots=True)
class ScopeCall:
    """A :class:`CollectiveCall` as a step performs it in place: ``source`` the input's and
    ``target`` the output's tensor in the rank's scope (``core.DenseTensor`` handles)."""

    collective: Collective
    source: Any
    target: Any


def collective_label(job: Collective) -> str:
    """How a wait on ``job`` is reported to the launcher: ``all_reduce over [0, 1] of %12.0``."""
    return f"{job.kind} over {list(job.group)} of {job.value}"
