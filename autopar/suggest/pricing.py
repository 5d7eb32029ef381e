"""A strategy's price from what compile planned, before any rank program exists (stage:
strategy search).

A search prices hundreds of candidates; building their rank programs (what
``DistributedProgram.cost`` reads) would cost more than the compiles. Everything needed is in
the compile state: each op's placement gives its local shapes on a rank, the cost model's
roofline prices them on the profile's device (:func:`autopar.cost_model.op_cost`), every
planned reshard and fused bucket carries its predicted time, and the memory model takes the
placements of parameters, gradients, optimizer states and the activations kept for backward.

The step, on the busiest rank of each pipeline rank (ranks that differ only in their dp / mp
coordinates hold pieces of one size, so the first rank of each stage mesh stands for it):
- **compute**: forward + backward of every micro-batch, then the update (each op's roofline
  time at the rates the device achieves, or its kernel's measured rate, plus its fixed cost,
  ``device.op_seconds``: many small ops, as recompute and more micro-batches make, cost time;
  so do the ops compile adds around its collectives, :func:`added_ops`), and the fixed cost of each program
  run (``device.segment_seconds``: one a step, or one per pipeline phase); on a CPU whose
  processes outnumber its cores, all of it slower by their ratio (``device.shared_by``);
- **communication**: every collective the rank takes part in, none assumed overlapped
  (a per-micro-batch reshard ``m`` times, a gradient sync once; on a host backend each also
  ends a program segment, which the cost model's collective times include);
- **bubble**: pipeline ranks idle while the pipeline fills and drains — ``(p - 1)`` times the
  slowest stage's forward + backward of one micro-batch for FThenB and 1F1B, half of the
  backward less for ZB-H1 (its weight gradients fill the drain), divided by the virtual stages
  for the interleaved schedule.
Memory: parameters, gradients (ZeRO-2/3: their shards), optimizer states, and the kept
activations times the micro-batches in flight (1F1B and ZB-H1: ``p - s`` on stage ``s``; FThenB:
all ``m``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autopar.collective_kinds import point_to_point
from autopar.cost_model import op_cost_or_traffic, tensor_bytes
from autopar.cost_model.planner import group_at
from autopar.graph import Role
from autopar.inspect.cost_report import FREE_OPS, saved_activations
from autopar.passes.base import CompileState
from autopar.passes.pipeline_split import find_stages
from autopar.propagation import SiteKind


@dataclass(frozen=True, slots=True)
class Price:
    """Predicted seconds of one training step and bytes per rank (see the module docstring)."""

    compute: float
    communication: float
    bubble: float
    memory: int  # peak bytes on the fullest rank
    parameter_memory: int  # of which parameters, gradients and optimizer states
    sent: int  # bytes the busiest rank moves per step

    @property
    def step(self) -> float:
        return self.compute + self.communication + self.bubble


@dataclass(frozen=True, slots=True)
class _StageTimes:
    forward: float = 0.0
    backward: float = 0.0
    update: float = 0.0
    per_micro_comm: float = 0.0
    once_comm: float = 0.0
    per_micro_sent: int = 0
    once_sent: int = 0


def price(state: CompileState) -> Price:
    """The :class:`Price` of a planned compile state (no rank program is built)."""
    pipeline = state.strategy.pipeline
    meshes = _stage_meshes(state)
    micro = pipeline.micro_batches if pipeline is not None else 1
    times = []
    device = state.cluster.device
    shared = device.shared_by(min(len(state.mesh.ranks), state.cluster.devices_per_node))
    launch = device.op_seconds * shared if device.segment_seconds else 0.0  # (see added_ops)
    firsts = [mesh.ranks[0] for mesh in meshes]
    computed = _compute(state, firsts)
    added = _added_ops(state, firsts) if launch else {}
    communicated = _communication(state, list(dict.fromkeys(r for mesh in meshes for r in (mesh.ranks[0], mesh.ranks[-1]))))
    for mesh in meshes:  # compute on the stage's first rank, communication on the busier of its first and last
        forward, backward, update = (shared * seconds for seconds in computed[mesh.ranks[0]])
        if launch:
            per_micro_ops, once_ops = added[mesh.ranks[0]]
            forward, update = forward + per_micro_ops * launch, update + once_ops * launch
        ends = dict.fromkeys((mesh.ranks[0], mesh.ranks[-1]))
        comm = max((communicated[rank] for rank in ends), key=lambda c: micro * c[0] + c[1])
        times.append(_StageTimes(forward, backward, update, *comm))
    slowest = max(times, key=lambda t: t.forward + t.backward + t.per_micro_comm)
    per_micro = max(t.forward + t.backward for t in times)
    runs = 1 if pipeline is None else (3 if pipeline.schedule == "ZBH1" else 2) * micro + 1  # program runs per step
    compute = micro * (slowest.forward + slowest.backward) + max(t.update for t in times)
    compute += runs * device.segment_seconds * shared
    communication = max(micro * t.per_micro_comm + t.once_comm for t in times)
    bubble = 0.0
    if pipeline is not None and len(meshes) > 1:
        fill = per_micro if pipeline.schedule != "ZBH1" else max(t.forward + t.backward / 2 for t in times)
        virtual = max(len(state.pipeline.stages) // len(state.pipeline.meshes), 1) if state.pipeline is not None else 1
        bubble = (len(meshes) - 1) * fill / virtual
    memory, held = _memory(state, firsts, micro)
    sent = max(micro * t.per_micro_sent + t.once_sent for t in times)
    return Price(compute, communication, bubble, memory, held, sent)


def _stage_meshes(state: CompileState) -> list[Any]:
    """Each pipeline rank's mesh (the whole mesh without a pipeline)."""
    return [state.mesh] if state.strategy.pipeline is None else find_stages(state)[0]


def _compute(state: CompileState, ranks: list[int]) -> dict[int, tuple[float, float, float]]:
    """Forward, backward (of one micro-batch) and update seconds of the ops of each of ``ranks``
    (each op visited once: it is priced on those of ``ranks`` its mesh holds)."""
    graph, propagation, cluster = state.graph, state.propagation, state.cluster
    times = {rank: [0.0, 0.0, 0.0] for rank in ranks}
    column = {Role.FORWARD: 0, Role.OPTIMIZER: 2}
    for op in graph.ops:
        if op.name in FREE_OPS or op.index not in propagation.op_results:
            continue
        for rank in _held_by(propagation.op_meshes.get(op.index, state.mesh), ranks):
            times[rank][column.get(op.role, 1)] += _op_seconds(state, op, rank, cluster)
    return {rank: (f, b, u) for rank, (f, b, u) in times.items()}


def _held_by(mesh: Any, ranks: list[int]) -> tuple[int, ...]:
    """Those of ``ranks`` in ``mesh`` (cached: a pipeline's ops and values sit on a few meshes)."""
    return _ranks_in(mesh, tuple(ranks))


@lru_cache(maxsize=1 << 12)
def _ranks_in(mesh: Any, ranks: tuple[int, ...]) -> tuple[int, ...]:
    members = set(mesh.ranks)
    return tuple(rank for rank in ranks if rank in members)


def _communication(state: CompileState, ranks: list[int]) -> dict[int, tuple[float, float, int, int]]:
    """Per each of ``ranks``: seconds of the collectives it takes part in per micro-batch and once
    a step (a gradient sync, a fused bucket), and the bytes it sends in each (each planned
    reshard visited once)."""
    out = {rank: [0.0, 0.0, 0, 0] for rank in ranks}  # per micro-batch, once; sent per micro-batch, once
    fused = _fused(state)
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused:
            continue
        once = state.graph.ops[planned.need.op].role is Role.OPTIMIZER
        for step in planned.plan.steps:
            if step.kind.is_local:  # (a local slice is a copy the compute side does not see: a few bytes)
                continue
            for rank, _ in _taking_part(step, ranks):
                out[rank][1 if once else 0] += step.time
                out[rank][3 if once else 2] += step.bytes
    by_index = {planned.index: planned for planned in state.reshards}
    for bucket in (*state.buckets, *state.zero_buckets):
        for rank in _held_by_ranks(_bucket_ranks(bucket, by_index), ranks):
            out[rank][1] += bucket.time
            out[rank][3] += bucket.bytes
    for bucket in state.site_buckets:  # the gathers one op reads, in one (per micro-batch: passes/site_fusion.py)
        for rank in _held_by_ranks(_bucket_ranks(bucket, by_index), ranks):
            out[rank][0] += bucket.time
            out[rank][2] += bucket.bytes
    return {rank: (a, b, int(c), int(d)) for rank, (a, b, c, d) in out.items()}


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
    from autopar.collective_kinds import KINDS, Local
    from autopar.passes import allreduce_fusion, site_fusion, zero_fusion

    by_index = {planned.index: planned for planned in state.reshards}
    fused = _fused(state)
    ops = {rank: [0, 0] for rank in ranks}  # per micro-batch, once
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused:
            continue
        once = int(state.graph.ops[planned.need.op].role is Role.OPTIMIZER)
        involved = set()
        for step in planned.plan.steps:
            kind = KINDS[step.kind]
            for rank, group in _taking_part(step, ranks):
                ops[rank][once] += kind.ops_added(step, rank, group) if isinstance(kind, Local) else 1
                involved.add(rank)
        if planned.need.site.kind is SiteKind.WRITE_BACK:
            for rank in involved:
                ops[rank][once] += 1
    for bucket in state.buckets:
        for rank in _held_by(bucket.src.mesh, ranks):
            ops[rank][1] += allreduce_fusion.emitted_ops(state, bucket, [by_index[i] for i in bucket.members], rank)
    for bucket in state.zero_buckets:
        for rank in ranks:
            ops[rank][1] += zero_fusion.emitted_ops(bucket, [by_index[i] for i in bucket.members], rank)
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


def _op_seconds(state: CompileState, op: Any, rank: int, cluster: Any) -> float:
    """Roofline seconds of ``op``'s local piece on ``rank`` (the shapes its rule reads and makes)."""
    inferred = state.propagation.op_results[op.index]
    values = state.graph.values
    ins = tuple(_local(values[key].shape, dist, rank) for key, dist in zip(op.inputs, inferred.inputs) if key is not None)
    outs = tuple(_local(values[key].shape, dist, rank) for key, dist in zip(op.outputs, inferred.outputs) if key is not None)
    dtype = values[op.outputs[0]].dtype if op.outputs and op.outputs[0] is not None else "float32"
    transposes = (bool(op.attrs.get("transpose_x")), bool(op.attrs.get("transpose_y")))
    return _seconds(op.name, ins, outs, transposes, dtype, cluster)


@lru_cache(maxsize=1 << 16)
def _seconds(name: str, ins: tuple, outs: tuple, transposes: tuple[bool, bool], dtype: str, cluster: Any) -> float:
    """(Cached across candidates: a search prices the same layer's ops on the same pieces often.)"""
    attrs = {"transpose_x": transposes[0], "transpose_y": transposes[1]}
    return op_cost_or_traffic(name, list(ins), list(outs), attrs, dtype)[0].time(cluster, dtype) + cluster.device.op_seconds


@lru_cache(maxsize=1 << 16)
def _local(shape: tuple[int, ...], dist: Any, rank: int) -> tuple[int, ...]:
    if dist is None or not any(dist.mapping) or rank not in dist.mesh.ranks:
        return tuple(shape)
    return tuple(dist.local_shape(shape, rank))


def _memory(state: CompileState, ranks: list[int], micro: int) -> tuple[int, int]:
    """Peak bytes on the fullest of ``ranks`` and, of it, parameters + gradients + states."""
    graph, propagation = state.graph, state.propagation
    grads = {z.param: z.sharded for z in state.zero if z.sharded is not None} if state.strategy.zero_stage >= 2 else {}
    pipeline = state.strategy.pipeline
    held = dict.fromkeys(ranks, 0)
    activations = dict.fromkeys(ranks, 0)
    for key, value in graph.values.items():
        if value.kind not in ("parameter", "state"):
            continue
        dist = propagation.dist(key)
        for rank in _held_by(dist.mesh, ranks):
            held[rank] += tensor_bytes(value.shape, value.dtype, dist, rank)
            if value.kind == "parameter":
                held[rank] += tensor_bytes(value.shape, value.dtype, grads.get(key, dist), rank)
    for key in saved_activations(graph):
        dist, value = propagation.dist(key), graph.values[key]
        for rank in _held_by(dist.mesh, ranks):
            activations[rank] += tensor_bytes(value.shape, value.dtype, dist, rank)
    peak, held_at_peak = 0, 0
    for position, rank in enumerate(ranks):
        in_flight = 1
        if pipeline is not None:
            in_flight = micro if pipeline.schedule == "FThenB" else min(micro, len(ranks) - position)
        total = held[rank] + activations[rank] * in_flight
        if total > peak:
            peak, held_at_peak = total, held[rank]
    return peak, held_at_peak
