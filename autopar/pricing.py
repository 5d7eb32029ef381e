"""A strategy's price from what compile planned, before any rank program exists (stage:
strategy search and cost report: the one pricing both ``autopar.suggest`` / ``price_plan`` and
``DistributedProgram.cost`` use). It sits below both: the query API (``dist.decisions.priced()``)
and the search (``autopar.suggest``, which compiles) import it; it reads the compile state, so it is
no inspection module (those ask the query API only).

A search prices hundreds of candidates; building their rank programs would cost more than the
compiles. Everything needed is in the compile state: each op's placement gives its local shapes
on a rank, the cost model's roofline prices them on the profile's device
(:func:`autopar.cost_model.op_cost`), every planned reshard and fused bucket carries its
predicted time, and the memory model takes the placements of parameters, gradients, optimizer
states and the activations kept for backward. :func:`rank_times` gives each rank's share of a
step, :func:`step_price` the step from them; ``dist.cost`` asks them for every rank, the search
for the first and last rank of each pipeline rank's mesh (ranks that differ only in their dp /
mp coordinates hold pieces of one size, so a stage's first rank computes for all of them).

The step, on the busiest rank of each pipeline rank:
- **compute**: forward + backward of every micro-batch, then the update (each op's roofline
  time at the rates the device achieves, or its kernel's measured rate, plus its fixed cost,
  ``device.op_seconds``: many small ops, as recompute and more micro-batches make, cost time;
  so do the ops compile adds around its collectives, :func:`added_ops`), and the fixed cost of each program
  run (``device.segment_seconds``: one a step, or one per pipeline phase); on a CPU whose
  processes outnumber its cores, all of it slower by their ratio (``device.shared_by``);
- **communication**: every collective the rank takes part in (a per-micro-batch reshard ``m``
  times, a gradient sync once; on a host backend each also ends a program segment, which the
  cost model's collective times include; where the job's processes outnumber the node's cores,
  each one's fixed costs stretch by their ratio, :func:`~autopar.cost_model.comm.shared_cores_time`;
  the vocabulary-parallel rewrite's collectives of a few values per row included; ring attention's
  shifts in place of the K / V gathers they replace, each behind one block's attention:
  :mod:`autopar.ring_pricing`). Exposed, but for the data-parallel gradient buckets
  where collectives run inside the program beside the compute (no host segment: NCCL on its own
  stream): a bucket's all_reduce starts once the backward has made its last gradient and the
  bucket before it is done, so it runs behind the rest of the last micro-batch's backward;
  what ends after the backward is exposed (a gradient too big for a bucket, synced by its own
  all_reduce, likewise; the bucket holding the first layers' gradients, made last, never hides);
- **bubble**: pipeline ranks idle while the pipeline fills and drains — the verified schedule
  replayed with each stage's forward and backward of one micro-batch (:func:`pipeline_bubble`),
  less the busiest rank's own work: with equal stages ``(p - 1)`` times forward + backward for
  FThenB and 1F1B, divided by the virtual stages for the interleaved schedule, and for ZB-H1
  (forward, input and weight gradient equally long) ``(p - 1)`` forwards (its weight gradients
  fill the drain).
Memory: parameters, gradients (ZeRO-2/3: their shards), optimizer states — each on the ranks
holding it only: an expert placed on a sub-mesh, or its slice of stacked experts split over
``ep``, counts on its holders, ``1 / ep`` of the replicated experts per rank
(``tests/unit/cost_model/test_moe_pricing.py``) — and the kept
activations times the micro-batches in flight (1F1B and ZB-H1: ``p - s`` on stage ``s``; FThenB:
all ``m``); with recompute, the largest layer's recomputed activations beside them (they live
again while its backward runs: :func:`_recomputed`); a ring attention keeps its log-sum-exp, not
its scores (:mod:`autopar.ring_pricing`).

Precision (:class:`~autopar.cost_model.precision.Precision`): as built, every op computes in its
operands' dtype (a bfloat16 matmul at the device's bfloat16 rate), moves and holds each value in
its own dtype, and every collective its plan's dtype (an AMP O2 program: bfloat16 activations,
parameters and gradients, float32 masters and states). ``Precision("bfloat16")`` prices a float32
program as the mixed-precision program it stands for (the Megatron comparison's synthetic
programs): its float32 activations, parameters and gradients in bfloat16 — compute, memory and
the collectives moving them (each planned collective rescaled by its alpha-beta formula) — plus
a float32 master per parameter, placed like its optimizer states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autopar import ring_pricing
from autopar.collective import CollectiveKind
from autopar.collective_kinds import kind_of, point_to_point
from autopar.cost_model import op_cost_or_traffic, tensor_bytes
from autopar.cost_model.comm import shared_cores_time
from autopar.cost_model.compute import compute_dtype
from autopar.cost_model.planner import group_at, plan_reshard
from autopar.cost_model.precision import AS_BUILT, Precision, rescaled_time
from autopar.graph import Role
from autopar.inspect.cost_report import FREE_OPS, saved_activations
from autopar.passes.base import CompileState, GradientBucket, PlannedReshard
from autopar.passes.pipeline_split import find_stages
from autopar.passes.results import ZeroPlan
from autopar.propagation import SiteKind
from autopar.schedule import Action, ActionKind, replay, verified_schedule


@dataclass(frozen=True, slots=True)
class Price:
    """Predicted seconds of one training step and bytes per rank (see the module docstring)."""

    compute: float
    communication: float  # exposed: not run behind compute
    bubble: float
    memory: int  # peak bytes on the fullest rank
    parameter_memory: int  # of which parameters, gradients and optimizer states
    sent: int  # bytes the busiest rank moves per step
    hidden: float = 0.0  # communication seconds run behind the backward (not in ``step``)

    @property
    def step(self) -> float:
        return self.compute + self.communication + self.bubble


@dataclass(frozen=True, slots=True)
class RankTimes:
    """One rank's share of a step (seconds; its processes' share of the cores and the ops
    compile adds included): compute of one micro-batch and of the update, the program runs of a
    step, the collectives it takes part in per micro-batch and once a step, and how much of the
    latter runs behind its backward (see the module docstring)."""

    rank: int
    stage: int  # its pipeline rank's position (0 without a pipeline)
    micro_batches: int
    forward: float  # one micro-batch
    backward: float
    update: float
    runs: float  # the fixed cost of the step's program runs
    per_micro_comm: float
    once_comm: float
    per_micro_sent: int
    once_sent: int
    per_micro_collectives: int
    once_collectives: int
    hidden: float = 0.0  # of its collectives' seconds, run behind compute (gradient syncs; ring attention's shifts)

    @property
    def compute(self) -> float:
        return self.micro_batches * (self.forward + self.backward) + self.update + self.runs

    @property
    def communication(self) -> float:
        """All its collectives' seconds in a step (exposed or not)."""
        return self.micro_batches * self.per_micro_comm + self.once_comm

    @property
    def exposed(self) -> float:
        return self.communication - self.hidden

    @property
    def sent(self) -> int:
        return self.micro_batches * self.per_micro_sent + self.once_sent

    @property
    def collectives(self) -> int:
        return self.micro_batches * self.per_micro_collectives + self.once_collectives

    @property
    def step(self) -> float:
        """This rank alone, without a pipeline's bubble."""
        return self.compute + self.exposed


def price(state: CompileState, precision: Precision = AS_BUILT) -> Price:
    """The :class:`Price` of a planned compile state (no rank program is built): the first and
    last rank of each pipeline rank's mesh stand for it (the first computes for both);
    ``precision``: as built, or the mixed precision a float32 program stands for."""
    meshes = _stage_meshes(state)
    ends = list(dict.fromkeys(r for mesh in meshes for r in (mesh.ranks[0], mesh.ranks[-1])))
    computing = [mesh.ranks[0] for mesh in meshes]
    return step_price(state, rank_times(state, ends, computing=computing, meshes=meshes, precision=precision), precision)


def step_price(state: CompileState, times: dict[int, RankTimes], precision: Precision = AS_BUILT) -> Price:
    """The step from the :func:`rank_times` of some of each stage's ranks: the slowest stage's
    micro-batches and the largest update; the busiest rank's exposed communication; the bubble
    (memory from each stage's first rank, in ``precision``)."""
    pipeline = state.strategy.pipeline
    micro = pipeline.micro_batches if pipeline is not None else 1
    stages: dict[int, list[RankTimes]] = {}
    for t in times.values():
        stages.setdefault(t.stage, []).append(t)
    slowest = max(times.values(), key=lambda t: t.forward + t.backward + t.per_micro_comm)
    compute = micro * (slowest.forward + slowest.backward) + max(t.update for t in times.values()) + slowest.runs
    busiest = max(times.values(), key=lambda t: t.exposed)
    bubble = 0.0
    if pipeline is not None and len(stages) > 1:
        virtual = max(len(state.pipeline.stages) // len(state.pipeline.meshes), 1) if state.pipeline is not None else 1
        per_rank = tuple(
            tuple(max(getattr(t, part) for t in stages[s]) for part in ("forward", "backward", "per_micro_comm")) for s in sorted(stages)
        )  # fmt: skip
        bubble = pipeline_bubble(pipeline.schedule, micro, virtual, per_rank)
    firsts = [min(ts, key=lambda t: t.rank).rank for _, ts in sorted(stages.items())]
    memory, held = _memory(state, firsts, micro, precision)
    sent = max(t.sent for t in times.values())
    return Price(compute, busiest.exposed, bubble, memory, held, sent, busiest.hidden)


@lru_cache(maxsize=256)
def pipeline_bubble(schedule: str, micro_batches: int, virtual_stages: int, per_rank: tuple[tuple[float, ...], ...]) -> float:
    """The time the pipeline's ranks idle in a step: the verified schedule replayed
    (:func:`autopar.schedule.replay`) with each pipeline rank's ``(forward, backward[,
    transfers])`` of one micro-batch (``per_rank``, in pipeline-rank order; a virtual stage takes
    its share, a zero-bubble half half the backward; a send half the transfers, so a recv waits
    for its message), less the busiest rank's own work. Equal stages without transfers give the
    closed forms: ``(p - 1)(F + B)`` for FThenB and 1F1B, ``(p - 1) F`` for ZB-H1 when
    ``F = B / 2``, and ``(p - 1)(F + B) / v`` interleaved."""
    num_ranks = len(per_rank)
    actions = verified_schedule(schedule, num_ranks, micro_batches, virtual_stages)
    timed: dict[tuple[ActionKind, int], float] = {}  # (kind, pipeline rank) -> one action's seconds
    for rank, times in enumerate(per_rank):
        forward, backward, transfers = (*times, 0.0)[:3]
        parts = {
            ActionKind.F: forward, ActionKind.B: backward, ActionKind.I: backward / 2, ActionKind.W: backward / 2,
            ActionKind.SEND_F: transfers / 2, ActionKind.SEND_B: transfers / 2,
        }  # fmt: skip
        timed |= {(kind, rank): seconds / virtual_stages for kind, seconds in parts.items()}

    def duration(action: Action) -> float:
        return timed.get((action.kind, action.stage % num_ranks), 0.0)

    ends = replay(actions, duration)
    makespan = max((spans[-1][1] for spans in ends.values() if spans), default=0.0)
    work = max(sum(duration(action) for action in mine) for mine in actions.values())
    return max(makespan - work, 0.0)


def rank_times(
    state: CompileState, ranks: Iterable[int], computing: Iterable[int] | None = None, meshes: list[Any] | None = None,
    precision: Precision = AS_BUILT,
) -> dict[int, RankTimes]:  # fmt: skip
    """:class:`RankTimes` of each of ``ranks``. ``computing``: the ranks whose ops are priced
    (default: all of ``ranks``); another rank takes the compute of the first of them on its
    stage (a search prices a stage's first rank only). ``meshes``: each pipeline rank's mesh,
    when the caller has them; ``precision``: see the module docstring."""
    ranks = list(dict.fromkeys(ranks))
    computing = ranks if computing is None else list(dict.fromkeys(computing))
    pipeline = state.strategy.pipeline
    micro = pipeline.micro_batches if pipeline is not None else 1
    device = state.cluster.device
    shared = device.shared_by(min(len(state.mesh.ranks), state.cluster.devices_per_node))
    launch = device.op_seconds * shared if device.segment_seconds else 0.0  # (see added_ops)
    program_runs = 1 if pipeline is None else (3 if pipeline.schedule == "ZBH1" else 2) * micro + 1
    runs = program_runs * device.segment_seconds * shared
    stage_of = _stage_of(meshes or _stage_meshes(state), ranks)
    # collectives inside the program (no host segment), beside the compute: gradient syncs overlap the backward
    syncs = _gradient_syncs(state) if not device.segment_seconds else []
    computed, ready = _compute(state, computing, {op for sync in syncs for op in sync.producers}, precision)
    added = _added_ops(state, ranks) if launch else {}
    communicated = _communication(state, ranks, precision)
    ring = ring_pricing.ring_costs(state, ranks, lambda op, rank: shared * _priced_seconds(state, op, rank, precision), precision)
    by_stage = {}
    for rank in computing:
        by_stage.setdefault(stage_of.get(rank, 0), rank)
    out = {}
    for rank in ranks:
        source = rank if rank in computed else by_stage[stage_of[rank]]
        forward, backward, update = (shared * seconds for seconds in computed[source])
        if launch:
            per_micro_ops, once_ops = added[rank]
            forward, update = forward + per_micro_ops * launch, update + once_ops * launch
        hidden = 0.0
        if syncs:
            made = {op: shared * seconds for op, seconds in ready[source].items()}
            hidden = _hidden(state, syncs, rank, made, backward, precision)
        per_micro, once, per_micro_sent, once_sent, per_micro_count, once_count = communicated[rank]
        shifts = ring[rank]  # (ring attention: its shifts per micro-batch, the part behind its blocks, its recomputed blocks)
        out[rank] = RankTimes(rank, stage_of[rank], micro, forward, backward + shared * shifts.recompute, update, runs,
                              per_micro + shifts.seconds, once, per_micro_sent + shifts.sent, once_sent,
                              per_micro_count + shifts.count, once_count, hidden + micro * shifts.hidden)  # fmt: skip
    return out


def _stage_meshes(state: CompileState) -> list[Any]:
    """Each pipeline rank's mesh (the whole mesh without a pipeline)."""
    return [state.mesh] if state.strategy.pipeline is None else find_stages(state)[0]


def _stage_of(meshes: list[Any], ranks: list[int]) -> dict[int, int]:
    """Each of ``ranks``' pipeline rank position (``meshes``: each pipeline rank's mesh)."""
    out = {}
    for position, mesh in enumerate(meshes):
        for rank in _held_by(mesh, ranks):
            out.setdefault(rank, position)
    return out


def _compute(
    state: CompileState, ranks: list[int], producers: set[int] = frozenset(), precision: Precision = AS_BUILT
) -> tuple[dict[int, tuple[float, float, float]], dict[int, dict[int, float]]]:
    """Forward, backward (of one micro-batch) and update seconds of the ops of each of ``ranks``
    (each op visited once: it is priced on those of ``ranks`` its mesh holds); and, for each
    of ``producers`` (op indices), the backward seconds up to its end on each rank."""
    graph, propagation, cluster = state.graph, state.propagation, state.cluster
    times = {rank: [0.0, 0.0, 0.0] for rank in ranks}
    ready: dict[int, dict[int, float]] = {rank: {} for rank in ranks}
    column = {Role.FORWARD: 0, Role.OPTIMIZER: 2}
    for op in graph.ops:
        if op.name in FREE_OPS or op.index not in propagation.op_results:
            continue
        for rank in _held_by(propagation.op_meshes.get(op.index, state.mesh), ranks):
            times[rank][column.get(op.role, 1)] += _op_seconds(state, op, rank, cluster, precision)
            if op.index in producers:
                ready[rank][op.index] = times[rank][1]
    return {rank: (f, b, u) for rank, (f, b, u) in times.items()}, ready


@dataclass(frozen=True, slots=True)
class _Sync:
    """A data-parallel gradient sync run once a step: a fused bucket, or one gradient's own
    all_reduce (``planned``); ``producers``: the ops making its gradients."""

    producers: tuple[int, ...]
    bucket: GradientBucket | None = None
    planned: PlannedReshard | None = None

    def seconds(self, state: CompileState, rank: int, by_index: dict[int, Any], precision: Precision) -> float:
        """What it costs ``rank`` (0: not taking part), in ``precision``."""
        if self.bucket is not None:
            if rank not in _bucket_ranks(self.bucket, by_index):
                return 0.0
            return self.bucket.time if precision.as_built else _bucket_seconds(state, self.bucket, by_index, rank, precision)[0]
        ratio = _ratio(state, self.planned, precision)
        return sum(_step_seconds(step, group, ratio, state.cluster)[0] for step in self.planned.plan.steps if not step.kind.is_local
                   for _, group in _taking_part(step, [rank]))  # fmt: skip


def _gradient_syncs(state: CompileState) -> list[_Sync]:
    """The gradient buckets, and the gradients synced by all_reduces of their own (outside a
    bucket: bigger than it, or fusion off) before the optimizer reads them."""
    by_index = {planned.index: planned for planned in state.reshards}
    syncs = [_Sync(tuple(by_index[m].need.value[0] for m in b.members if m in by_index), bucket=b) for b in state.buckets]
    fused, graph = _fused(state), state.graph
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused:
            continue
        made_by = planned.need.value[0]
        if graph.ops[planned.need.op].role is not Role.OPTIMIZER or graph.ops[made_by].role is not Role.BACKWARD:
            continue
        steps = [step for step in planned.plan.steps if not step.kind.is_local]
        if steps and all(kind_of(step.kind).gradient_sync for step in steps):
            syncs.append(_Sync((made_by,), planned=planned))
    return syncs


def _hidden(
    state: CompileState, syncs: list[_Sync], rank: int, ready: dict[int, float], backward: float, precision: Precision = AS_BUILT
) -> float:  # fmt: skip
    """Seconds of ``rank``'s gradient syncs that run behind its backward (``ready``: backward
    seconds up to the end of each op making a gradient; ``backward``: the whole micro-batch's).
    Each sync starts when its last gradient is made and the one before it on the link is done
    (one collective at a time, in the order they become ready); its time up to the backward's
    end is hidden, the rest exposed: a sync of a gradient made at the end of the backward (the
    first layers', and so the bucket holding them) is never hidden, and syncs longer than the
    backward left after them show the rest."""
    by_index = {planned.index: planned for planned in state.reshards}
    starts = []
    for sync in syncs:
        seconds = sync.seconds(state, rank, by_index, precision)
        if seconds > 0:
            starts.append((max((ready.get(op, backward) for op in sync.producers), default=backward), seconds))
    free, hidden = 0.0, 0.0
    for start, seconds in sorted(starts):
        start = max(start, free)
        free = start + seconds
        hidden += max(0.0, min(free, backward) - start)
    return hidden


def _held_by(mesh: Any, ranks: list[int]) -> tuple[int, ...]:
    """Those of ``ranks`` in ``mesh`` (cached: a pipeline's ops and values sit on a few meshes)."""
    return _ranks_in(mesh, tuple(ranks))


@lru_cache(maxsize=1 << 12)
def _ranks_in(mesh: Any, ranks: tuple[int, ...]) -> tuple[int, ...]:
    members = set(mesh.ranks)
    return tuple(rank for rank in ranks if rank in members)


def _communication(
    state: CompileState, ranks: list[int], precision: Precision = AS_BUILT
) -> dict[int, tuple[float, float, int, int, int, int]]:  # fmt: skip
    """Per each of ``ranks``: seconds of the collectives it takes part in per micro-batch and once
    a step (a gradient sync, a fused bucket), the bytes it sends in each and their number (each
    planned reshard visited once; in ``precision``). Where the job's processes outnumber the
    node's cores, each collective's fixed costs stretch (:func:`~autopar.cost_model.comm.shared_cores_time`)."""
    out = {rank: [0.0, 0.0, 0, 0, 0, 0] for rank in ranks}  # per micro-batch, once: seconds, sent, collectives
    cluster, fused = state.cluster, _fused(state)
    processes = min(len(state.mesh.ranks), cluster.devices_per_node)
    shared = cluster.device.shared_by(processes) > 1.0
    ringed = ring_pricing.replaced(state)  # (K / V gathers a ring attention's shifts take the place of)
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused or planned.index in ringed:
            continue
        once = int(state.graph.ops[planned.need.op].role is Role.OPTIMIZER)
        ratio = _ratio(state, planned, precision)
        for step in planned.plan.steps:
            if step.kind.is_local:  # (a local slice is a copy the compute side does not see: a few bytes)
                continue
            for rank, group in _taking_part(step, ranks):
                seconds, moved = _step_seconds(step, group, ratio, cluster)
                out[rank][once] += seconds + (_stretch(step.kind, group, cluster, processes) if shared else 0.0)
                out[rank][2 + once] += moved
                out[rank][4 + once] += 1
    # (a vocabulary-parallel row's all_reduces, a split scan's carry: emitted by their lowerings)
    for op, plan in [*_row_reshards(state, precision), *_scan_carries(state)]:
        once = int(op.role is Role.OPTIMIZER)
        for step in plan.steps:
            for rank, group in [] if step.kind.is_local else _taking_part(step, ranks):
                out[rank][once] += step.time + (_stretch(step.kind, group, cluster, processes) if shared else 0.0)
                out[rank][2 + once] += step.bytes
                out[rank][4 + once] += 1
    by_index = {planned.index: planned for planned in state.reshards}
    # gradient and ZeRO buckets once a step; site buckets (the gathers one op reads, in one:
    # passes/site_fusion.py) per micro-batch
    timed = [(bucket, 1) for bucket in (*state.buckets, *state.zero_buckets)]
    for bucket, once in timed + [(bucket, 0) for bucket in state.site_buckets]:
        for rank in _held_by_ranks(_bucket_ranks(bucket, by_index), ranks):
            stretch = 0.0
            if shared and (found := _bucket_group(bucket, by_index, rank)) is not None:
                stretch = _stretch(*found, cluster, processes)
            seconds, moved = _bucket_seconds(state, bucket, by_index, rank, precision)
            out[rank][once] += seconds + stretch
            out[rank][2 + once] += moved
            out[rank][4 + once] += 1
    return {rank: (a, b, int(c), int(d), e, f) for rank, (a, b, c, d, e, f) in out.items()}


def _ratio(state: CompileState, planned: PlannedReshard, precision: Precision) -> float:
    """Bytes ``planned`` moves in ``precision`` per byte planned (1: as built, and for a gradient
    reduction planned in the user's ``Strategy.reduce_dtype``: it moves that dtype either way)."""
    if precision.as_built or _reduced_as_asked(state, planned):
        return 1.0
    return precision.ratio(planned.plan.dtype, state.graph.values[planned.need.value].kind)


def _reduced_as_asked(state: CompileState, planned: PlannedReshard) -> bool:
    """Whether ``planned`` is a gradient reduction (a partial value the backward makes) planned in
    ``Strategy.reduce_dtype`` (passes/reshard_planning.py)."""
    reduce = state.strategy.reduce_dtype
    return (reduce is not None and planned.plan.dtype == reduce and bool(planned.need.have.partial)
            and state.graph.ops[planned.need.value[0]].role is Role.BACKWARD)  # fmt: skip


def _step_seconds(step: Any, group: tuple[int, ...], ratio: float, cluster: Any) -> tuple[float, int]:
    """A planned step's seconds and bytes for one of its groups, moving ``ratio`` times its bytes."""
    if ratio == 1.0:
        return step.time, step.bytes
    kind = "send_recv" if point_to_point(step.kind) else step.kind.value
    return rescaled_time(kind, tuple(group), step.bytes, step.time, ratio, cluster), int(step.bytes * ratio)


def _bucket_seconds(state: CompileState, bucket: Any, by_index: dict[int, Any], rank: int, precision: Precision) -> tuple[float, int]:
    """A fused bucket's seconds and bytes on ``rank`` in ``precision`` (its members' dtype and kind)."""
    if precision.as_built:
        return bucket.time, bucket.bytes
    ratio = _ratio(state, by_index[bucket.members[0]], precision)  # (a bucket's members share a dtype)
    found = _bucket_group(bucket, by_index, rank)
    if found is None:
        return bucket.time * ratio, int(bucket.bytes * ratio)
    kind, group = found
    return rescaled_time(kind.value, group, bucket.bytes, bucket.time, ratio, state.cluster), int(bucket.bytes * ratio)


def _scan_carries(state: CompileState) -> list[tuple[Any, Any]]:
    """The all_gathers of the shards' totals a cumsum along a split dim adds
    (:mod:`autopar.passes.scan_carry`): (op, planned reshard) each, in the value's dtype (a few
    rows: the precision a program is priced in does not change their fixed costs)."""
    from autopar.passes.lowered_ops import lowered_ops
    from autopar.passes.scan_carry import carry_plan
    from autopar.spmd.scan import SCAN_CARRIES

    return [(op, carry_plan(state, op, carry)[0]) for _, op, carry in lowered_ops(state, SCAN_CARRIES)]


def _row_reshards(state: CompileState, precision: Precision = AS_BUILT) -> list[tuple[Any, Any]]:
    """The all_reduces of one value per row that the vocabulary-parallel rewrite emits for an op
    whose normalized axis (softmax, cross-entropy: Megatron's LM head) stays split
    (:mod:`autopar.passes.vocab_parallel`): (op, planned reshard) each, planned as the rewrite
    plans them, ``P(max|sum) -> R`` of the per-row tensor."""
    from autopar.dist_attr import DistAttr
    from autopar.passes.vocab_parallel import split_rows
    from autopar.spmd.vocab_parallel import decompose

    out = []
    for op, split in split_rows(state):
        required = state.propagation.op_results[op.index].inputs
        dist, value = required[split.operand], state.graph.values[op.inputs[split.operand]]
        dtype = precision.dtype(value.dtype, value.kind)
        others = {d: k for attr in required if attr is not None for d, k in attr.partial if d not in split.mesh_dims}
        mapping = tuple(() if t == split.axis else dims for t, dims in enumerate(dist.mapping))
        row = tuple(1 if t == split.axis else n for t, n in enumerate(value.shape))
        reduces: list[str] = []
        decompose(split, _RowKernels(reduces), [None] * len(op.inputs), op.attrs)
        for reduce in reduces:
            dst = DistAttr.of(dist.mesh, mapping, others)
            if reduce.startswith("gather"):  # all_gather_rows of n values per row: S -> R of [.., n x ranks, ..]
                count = int(reduce.split(":")[1]) * math.prod(dist.mesh.shape[d] for d in split.mesh_dims)
                gathered = tuple(tuple(split.mesh_dims) if t == split.axis else dims for t, dims in enumerate(mapping))
                src = DistAttr.of(dist.mesh, gathered, others)
                shape = tuple(count if t == split.axis else n for t, n in enumerate(row))
                out.append((op, plan_reshard(src, dst, shape, dtype, state.cluster)))
                continue
            src = DistAttr.of(dist.mesh, mapping, {**others, **{d: reduce for d in split.mesh_dims}})
            out.append((op, plan_reshard(src, dst, row, dtype, state.cluster)))
    return out


class _RowKernels:
    """The kernels a decomposition calls, computing nothing: the reductions its all_reduces take
    (``gather:n`` for an all_gather of n values per row)."""

    def __init__(self, reduces: list[str]) -> None:
        self.reduces = reduces

    def all_reduce(self, x: Any, reduce: str, what: str) -> Any:
        self.reduces.append(reduce)

    def all_gather_rows(self, xs: list[Any], what: str) -> list[Any]:
        self.reduces.append(f"gather:{len(xs)}")
        return [None] * len(xs)

    def rows(self, ids: Any) -> tuple[None, None]:
        return None, None

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


@lru_cache(maxsize=1 << 12)
def _stretch(kind: Any, group: tuple[int, ...], cluster: Any, processes: int) -> float:
    return shared_cores_time("send_recv" if point_to_point(kind) else kind.value, group, cluster, processes)


def _bucket_group(bucket: Any, by_index: dict[int, Any], rank: int) -> tuple[Any, tuple[int, ...]] | None:
    """A fused bucket's collective kind and ``rank``'s group in it (a gradient bucket: its
    all_reduce over its mesh dims; a ZeRO bucket: its members' step of its kind)."""
    src = getattr(bucket, "src", None)
    if src is not None:
        return CollectiveKind.ALL_REDUCE, tuple(group_at(src.mesh, rank, bucket.mesh_dims))
    for member in bucket.members:
        for step in by_index[member].plan.steps:
            if step.kind == bucket.kind:
                for _, group in _taking_part(step, [rank]):
                    return bucket.kind, tuple(group)
    return None


def added_ops(state: CompileState, rank: int) -> tuple[int, int]:
    """The ops compile adds to ``rank``'s program per micro-batch and once a step: each planned
    reshard step it takes part in (a collective; a local slice or zeroing with its constants;
    the assignment of a write-back) and each fused bucket's packing (the fusion passes count
    their own). Where the host runs the programs op by op (a device with a program-run cost,
    ``segment_seconds``: the CPU profiles) each costs its launch (``device.op_seconds``): ZeRO's
    buckets add ~10 ops per parameter. On an accelerator they are reshape views, constants and
    a copy of each bucket, which :func:`price` leaves out."""
    return _added_ops(state, [rank])[rank]


def _added_ops(state: CompileState, ranks: list[int]) -> dict[int, tuple[int, int]]:
    """:func:`added_ops` of each of ``ranks`` (each planned reshard visited once)."""
    from autopar.collective_kinds import KINDS, local
    from autopar.passes import allreduce_fusion, site_fusion, zero_fusion

    by_index = {planned.index: planned for planned in state.reshards}
    fused, ringed = _fused(state), ring_pricing.replaced(state)
    ops = {rank: [0, 0] for rank in ranks}  # per micro-batch, once
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused or planned.index in ringed:
            continue
        once = int(state.graph.ops[planned.need.op].role is Role.OPTIMIZER)
        involved = set()
        for step in planned.plan.steps:
            kind = KINDS[step.kind]
            for rank, group in _taking_part(step, ranks):
                ops[rank][once] += kind.ops_added(step, rank, group) if local(step.kind) else 1
                involved.add(rank)
        if planned.need.site.kind is SiteKind.WRITE_BACK:
            for rank in involved:
                ops[rank][once] += 1
        if planned.plan.dtype != state.graph.values[planned.need.value].dtype:  # cast there and back (reduce_dtype)
            for rank in involved:
                ops[rank][once] += 2
    for ring in ring_pricing.rings(state):  # its permutes, per micro-batch
        for rank in _held_by(state.propagation.op_meshes.get(ring.core.first, state.mesh), ranks):
            ops[rank][0] += 2 * (ring.parts - 1) + 1
    for bucket in state.buckets:
        for rank in _held_by(bucket.src.mesh, ranks):
            ops[rank][1] += allreduce_fusion.emitted_ops(state, bucket, [by_index[i] for i in bucket.members], rank)
    for bucket in state.zero_buckets:
        for rank in ranks:
            ops[rank][1] += zero_fusion.emitted_ops(state, bucket, [by_index[i] for i in bucket.members], rank)
    for bucket in state.site_buckets:
        for rank in ranks:
            ops[rank][0] += site_fusion.emitted_ops(bucket, [by_index[i] for i in bucket.members], rank)
    return {rank: (a, b) for rank, (a, b) in ops.items()}


def _fused(state: CompileState) -> set[int]:
    """The planned reshards a fused bucket carries (priced, and counted, as the bucket)."""
    return {member for bucket in (*state.buckets, *state.zero_buckets, *state.site_buckets) for member in bucket.members}


def _taking_part(step: Any, ranks: list[int]) -> list[tuple[int, tuple[int, ...]]]:
    """Those of ``ranks`` a planned step involves, each with its group (``step.group_of``,
    without asking every rank: a pipeline's step runs on one stage's ranks or between two)."""
    if point_to_point(step.kind):
        wanted, out = set(ranks), {}
        for group in step.groups:
            for rank in group:
                if rank in wanted and rank not in out:
                    out[rank] = group
        return list(out.items())
    if not step.groups:
        return []
    return [(rank, group_at(step.src.mesh, rank, step.mesh_dims)) for rank in _held_by(step.src.mesh, ranks)]


def _held_by_ranks(members: Iterable[int], ranks: list[int]) -> list[int]:
    members = set(members)
    return [rank for rank in ranks if rank in members]


def _bucket_ranks(bucket: Any, by_index: dict[int, Any]) -> Iterable[int]:
    """The ranks a fused bucket runs on: a gradient bucket's mesh; a ZeRO bucket's members'
    (``by_index``: the planned reshards by index; a pipeline stage's parameters: that stage's
    ranks only)."""
    src = getattr(bucket, "src", None)
    if src is not None:
        return src.mesh.ranks
    return {rank for member in bucket.members for rank in by_index[member].plan.src.mesh.ranks}


def _priced_seconds(state: CompileState, op: Any, rank: int, precision: Precision = AS_BUILT) -> float:
    """``op``'s seconds on ``rank`` as :func:`_compute` prices it (0: a free op, or one without a placement)."""
    if op.name in FREE_OPS or op.index not in state.propagation.op_results:
        return 0.0
    return _op_seconds(state, op, rank, state.cluster, precision)


def _op_seconds(state: CompileState, op: Any, rank: int, cluster: Any, precision: Precision = AS_BUILT) -> float:
    """Roofline seconds of ``op``'s local piece on ``rank`` (the shapes its rule reads and makes,
    each operand in its dtype, computed in its inputs' :func:`compute_dtype`; under a stood-for
    ``precision`` the optimizer's ops as built: they update the float32 master)."""
    inferred = state.propagation.op_results[op.index]
    values = state.graph.values
    ins = tuple(_local(values[key].shape, dist, rank) for key, dist in zip(op.inputs, inferred.inputs) if key is not None)
    outs = tuple(_local(values[key].shape, dist, rank) for key, dist in zip(op.outputs, inferred.outputs) if key is not None)
    typed = AS_BUILT if op.role is Role.OPTIMIZER else precision
    in_dtypes = tuple(typed.dtype(values[key].dtype, values[key].kind) for key in op.inputs if key is not None)
    out_dtypes = tuple(typed.dtype(values[key].dtype, values[key].kind) for key in op.outputs if key is not None)
    transposes = (bool(op.attrs.get("transpose_x")), bool(op.attrs.get("transpose_y")))
    return _seconds(op.name, ins, outs, transposes, in_dtypes + out_dtypes, cluster)


@lru_cache(maxsize=1 << 16)
def _seconds(name: str, ins: tuple, outs: tuple, transposes: tuple[bool, bool], dtypes: tuple[str, ...], cluster: Any) -> float:
    """(Cached across candidates: a search prices the same layer's ops on the same pieces often.)"""
    attrs = {"transpose_x": transposes[0], "transpose_y": transposes[1]}
    dtype = compute_dtype(dtypes[: len(ins)], dtypes[len(ins) :])
    cost = op_cost_or_traffic(name, list(ins), list(outs), attrs, dtype, dtypes)[0]
    return cost.time(cluster, dtype) + cluster.device.op_seconds


@lru_cache(maxsize=1 << 16)
def _local(shape: tuple[int, ...], dist: Any, rank: int) -> tuple[int, ...]:
    if dist is None or not any(dist.mapping) or rank not in dist.mesh.ranks:
        return tuple(shape)
    return tuple(dist.local_shape(shape, rank))


def _memory(state: CompileState, ranks: list[int], micro: int, precision: Precision = AS_BUILT) -> tuple[int, int]:
    """Peak bytes on the fullest of ``ranks`` and, of it, parameters + gradients + states (each
    value in its ``precision`` dtype; a stood-for precision's float32 masters placed like their
    parameter's optimizer states: ZeRO's shard)."""
    graph, propagation = state.graph, state.propagation
    zero = state.result(ZeroPlan)
    grads = {z.param: z.sharded for z in zero.shards if z.sharded is not None} if zero is not None and zero.stage >= 2 else {}
    states = {z.param: z.sharded for z in zero.shards if z.sharded is not None} if zero is not None else {}
    pipeline = state.strategy.pipeline
    held = dict.fromkeys(ranks, 0)
    activations = dict.fromkeys(ranks, 0)
    for key, value in graph.values.items():
        if value.kind not in ("parameter", "state"):
            continue
        dist, dtype = propagation.dist(key), precision.dtype(value.dtype, value.kind)
        master = precision.master_of(value.dtype) if value.kind == "parameter" else None
        for rank in _held_by(dist.mesh, ranks):
            held[rank] += tensor_bytes(value.shape, dtype, dist, rank)
            if value.kind == "parameter":
                held[rank] += tensor_bytes(value.shape, dtype, grads.get(key, dist), rank)
            if master is not None:
                held[rank] += tensor_bytes(value.shape, master, states.get(key, dist), rank)
    unkept = ring_pricing.unkept(state)  # (a ring attention keeps no scores or probabilities: its log-sum-exp instead)
    for rank in ranks:
        activations[rank] += ring_pricing.lse_bytes(state, rank, _local)
    for key in saved_activations(graph):
        if key in unkept:
            continue
        dist, value = propagation.dist(key), graph.values[key]
        for rank in _held_by(dist.mesh, ranks):
            activations[rank] += tensor_bytes(value.shape, precision.dtype(value.dtype, value.kind), dist, rank)
    recomputed = _recomputed(state, ranks, precision)
    peak, held_at_peak = 0, 0
    for position, rank in enumerate(ranks):
        in_flight = 1
        if pipeline is not None:
            in_flight = micro if pipeline.schedule == "FThenB" else min(micro, len(ranks) - position)
        total = held[rank] + activations[rank] * in_flight + recomputed[rank]
        if total > peak:
            peak, held_at_peak = total, held[rank]
    return peak, held_at_peak


def _recomputed(state: CompileState, ranks: list[int], precision: Precision = AS_BUILT) -> dict[int, int]:
    """Each of ``ranks``' largest layer of recomputed activations: recompute re-makes a layer's
    activations in the backward, where they live together while that layer's gradients are
    made (one layer at a time), so the peak holds the largest layer's beside what is kept — at a
    long sequence its attention scores, which recompute does not take away (0 without recompute)."""
    from autopar.layer_paths import path_of

    graph, propagation = state.graph, state.propagation
    layers: dict[tuple[int, Any], int] = {}
    for op in graph.ops:
        if op.recomputes is None:
            continue
        layer = path_of(graph.ops[op.recomputes])
        for key in op.outputs:
            if key is None or not _read_in_backward(graph, key):
                continue
            value, dist = graph.values[key], propagation.dist(key)
            for rank in _held_by(dist.mesh, ranks):
                nbytes = tensor_bytes(value.shape, precision.dtype(value.dtype, value.kind), dist, rank)
                layers[(rank, layer)] = layers.get((rank, layer), 0) + nbytes
    out = dict.fromkeys(ranks, 0)
    for (rank, _), nbytes in layers.items():
        out[rank] = max(out[rank], nbytes)
    return out


def _read_in_backward(graph: Any, key: Any) -> bool:
    """Whether a gradient op (not another recompute clone) reads ``key``'s data (not its shape only)."""
    for user in graph.values[key].users:
        op = graph.ops[user]
        if op.role is Role.BACKWARD and op.recomputes is None:
            if any(k == key and i not in op.shape_only for i, k in enumerate(op.inputs)):
                return True
    return False
