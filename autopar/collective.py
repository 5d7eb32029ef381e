"""One collective, one value: what is moved, over which ranks, why, and what it costs
(stage: plan reshards -> runtime).

The planner's steps (:class:`autopar.cost_model.ReshardStep`, every group of a mesh at once)
and the per-rank records the compiler emits and the runtime executes (:class:`Collective`,
this rank's group) share one kind vocabulary, :class:`CollectiveKind`, spelled with NCCL's
names. A ``Collective`` is frozen: the pass that plans it, the rank program that carries it,
``dist.comm_ops(rank)``, the cost report and every runtime backend read the same value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from autopar.dist_attr import DistAttr


class CollectiveKind(str, enum.Enum):
    """Kinds of step a reshard is made of; compares equal to its name (``CollectiveKind.ALL_REDUCE == "all_reduce"``).

    ``PERMUTE`` is a ring shift over a group (context parallelism's ring attention passes its
    key / value blocks on with it); ``ALL_TO_ALL_V`` an all_to_all whose pieces have sizes per
    (sender, receiver) pair (MoE's token dispatch), MPI's ``Alltoallv``.
    ``SEND_RECV`` is the planner's point-to-point move between meshes; each rank program
    carries it as a ``SEND`` (sender) or a ``RECV`` (receiver). ``SLICE`` and ``MAKE_PARTIAL``
    are local: no data leaves the rank, declared with the member (``is_local``: a Collective
    validates its kind by it here; the table, autopar.collective_kinds, operates on Collectives,
    so it sits above this module; a test checks its ``Local`` entries are these).
    """

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    PERMUTE = "permute"
    ALL_TO_ALL_V = "all_to_all_v"
    SEND = "send"
    RECV = "recv"
    SEND_RECV = "send_recv"
    SLICE = "slice", True
    MAKE_PARTIAL = "make_partial", True

    def __new__(cls, value: str, local: bool = False) -> CollectiveKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member._local = local
        return member

    @property
    def is_local(self) -> bool:
        """No data leaves the rank."""
        return self._local

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, order=True)
class CollectiveKey:
    """Names one collective identically on every rank: the same key on every member of its group.

    ``source`` is ``"reshard"`` (``index`` = the planned reshard, ``step`` = its plan step) or
    ``"bucket"`` (``index`` = the fused gradient bucket); ``micro_batch`` is 0 until the
    pipeline runs several.
    """

    source: str
    index: int
    step: int = 0
    micro_batch: int = 0

    def __str__(self) -> str:
        return f"{self.source}{self.index}.{self.step}.mb{self.micro_batch}"


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective on one rank: ``group`` in piece order (rank ``group[i]`` holds piece ``i``).

    all_reduce: ``reduce`` over the group. all_gather: concatenation along ``axis`` (uneven
    pieces allowed). reduce_scatter: piece ``i`` (``numpy.array_split`` bounds along ``axis``)
    of the reduction. broadcast: ``group[root]``'s input. all_to_all: input split along
    ``split_axis``, piece ``j`` to ``group[j]``, received pieces concatenated along ``axis``.
    send / recv: ``group = (sender, receiver)``. permute: member ``i`` sends its input to member
    ``(i + shift) % p`` and receives member ``(i - shift) % p``'s. all_to_all_v: as all_to_all,
    but member ``i`` sends ``splits[i][j]`` elements along ``split_axis`` to member ``j`` (its
    pieces in order); ``splits`` empty: even pieces, as all_to_all. ``trim_axis`` (all_to_all_v
    with even pieces only): the uneven all_to_all of a dropless dispatch buffer, its counts found
    at run time: each expert's rows of a piece go out only up to the last non-zero one along
    ``trim_axis`` (the capacity), after the counts, and the receiver fills the rest with zeros —
    the same result as all_to_all for any data (autopar/collective_kinds.py, ``AllToAllV``).
    ``bytes``: the planner's nccl-tests size on this collective, in ``dtype`` (what it moves: a
    gradient reduced in another dtype, ``Strategy.reduce_dtype``, moves that one); ``time``:
    predicted seconds.
    """

    kind: CollectiveKind
    group: tuple[int, ...]
    key: CollectiveKey
    value: str  # label of the serial value (or bucket) being moved
    src: DistAttr
    dst: DistAttr
    shape: tuple[int, ...]  # global shape of the value
    output_shape: tuple[int, ...]  # this rank's result
    bytes: int
    time: float
    reason: str
    reduce: str = "sum"
    axis: int = 0
    split_axis: int = 0
    root: int = 0
    dtype: str = "float32"
    shift: int = 0  # permute: member i sends to member (i + shift) % p
    splits: tuple[tuple[int, ...], ...] = ()  # all_to_all_v: splits[i][j] = what member i sends member j
    trim_axis: int | None = None  # all_to_all_v: pieces sent up to their last non-zero row along it (counts at run time)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, CollectiveKind):
            object.__setattr__(self, "kind", CollectiveKind(self.kind))
        if self.kind.is_local:
            raise ValueError(f"{self.kind} is a local step, not a collective")
        p = len(self.group)
        if self.splits and (len(self.splits) != p or any(len(row) != p or min(row) < 0 for row in self.splits)):
            raise ValueError(f"{self.kind} of {self.value}: splits must be {p} x {p} counts >= 0, got {self.splits}")
        if self.trim_axis is not None and self.splits:
            raise ValueError(f"{self.kind} of {self.value}: trim_axis={self.trim_axis} needs even pieces (no splits), got {self.splits}")

    def __str__(self) -> str:
        extra = f", shift={self.shift}" if self.shift else ""
        extra += f", splits={[list(row) for row in self.splits]}" if self.splits else ""
        extra += f", trimmed along dim {self.trim_axis}" if self.trim_axis is not None else ""
        return (
            f"{self.kind}(group={list(self.group)}{extra}, {self.dtype}, {self.bytes} B, {self.time * 1e6:.1f}us) "
            f"{self.value}: {self.src} -> {self.dst} — {self.reason}"
        )
