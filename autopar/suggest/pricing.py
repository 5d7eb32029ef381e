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

from autopar.cost_model import op_cost_or_traffic, tensor_bytes
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
    for mesh in meshes:  # compute on the stage's first rank, communication on the busier of its first and last
        forward, backward, update = (shared * seconds for seconds in _compute(state, mesh.ranks[0]))
        if launch:
            per_micro_ops, once_ops = added_ops(state, mesh.ranks[0])
            forward, update = forward + per_micro_ops * launch, update + once_ops * launch
        ends = dict.fromkeys((mesh.ranks[0], mesh.ranks[-1]))
        comm = max((_communication(state, rank) for rank in ends), key=lambda c: micro * c[0] + c[1])
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
    memory, held = _memory(state, [mesh.ranks[0] for mesh in meshes], micro)
    sent = max(micro * t.per_micro_sent + t.once_sent for t in times)
    return Price(compute, communication, bubble, memory, held, sent)


def _stage_meshes(state: CompileState) -> list[Any]:
    """Each pipeline rank's mesh (the whole mesh without a pipeline)."""
    return [state.mesh] if state.strategy.pipeline is None else find_stages(state)[0]


def _compute(state: CompileState, rank: int) -> tuple[float, float, float]:
    """Forward, backward (of one micro-batch) and update seconds of ``rank``'s ops."""
    graph, propagation, cluster = state.graph, state.propagation, state.cluster
    forward = backward = update = 0.0
    for op in graph.ops:
        if op.name in FREE_OPS or op.index not in propagation.op_results:
            continue
        if rank not in propagation.op_meshes.get(op.index, state.mesh).ranks:
            continue
        seconds = _op_seconds(state, op, rank, cluster)
        if op.role is Role.FORWARD:
            forward += seconds
        elif op.role is Role.OPTIMIZER:
            update += seconds
        else:
            backward += seconds
    return forward, backward, update


def _communication(state: CompileState, rank: int) -> tuple[float, float, int, int]:
    """Seconds of the collectives ``rank`` takes part in per micro-batch and once a step (a
    gradient sync, a fused bucket), and the bytes it sends in each."""
    per_micro = once = 0.0
    sent = {True: 0, False: 0}
    fused = {member for bucket in state.buckets for member in bucket.members}
    fused |= {member for bucket in state.zero_buckets for member in bucket.members}
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused:
            continue
        mine = [step for step in planned.plan.steps if not step.kind.is_local and step.group_of(rank) is not None]
        if not mine:  # (a local slice is a copy the compute side does not see: a few bytes)
            continue
        seconds = sum(step.time for step in mine)
        once_a_step = state.graph.ops[planned.need.op].role is Role.OPTIMIZER
        sent[once_a_step] += sum(step.bytes for step in mine)
        if once_a_step:
            once += seconds
        else:
            per_micro += seconds
    by_index = {planned.index: planned for planned in state.reshards}
    for bucket in (*state.buckets, *state.zero_buckets):
        if rank in _bucket_ranks(bucket, by_index):
            once += bucket.time
            sent[True] += bucket.bytes
    return per_micro, once, sent[False], sent[True]


def added_ops(state: CompileState, rank: int) -> tuple[int, int]:
    """The ops compile adds to ``rank``'s program per micro-batch and once a step: each planned
    reshard step it takes part in (a collective; a local slice or zeroing with its constants;
    the assignment of a write-back) and each fused bucket's packing (the fusion passes count
    their own). Where the host runs the programs op by op (a device with a program-run cost,
    ``segment_seconds``: the CPU profiles) each costs its launch (``device.op_seconds``): ZeRO's
    buckets add ~10 ops per parameter. On an accelerator they are reshape views, constants and
    a copy of each bucket, which :func:`price` leaves out."""
    from autopar.collective_kinds import KINDS, Local
    from autopar.passes import allreduce_fusion, zero_fusion

    by_index = {planned.index: planned for planned in state.reshards}
    fused = {member for bucket in (*state.buckets, *state.zero_buckets) for member in bucket.members}
    ops = {True: 0, False: 0}
    for planned in state.reshards:
        if planned.shared_with is not None or planned.index in fused:
            continue
        once = state.graph.ops[planned.need.op].role is Role.OPTIMIZER
        for step in planned.plan.steps:
            group = step.group_of(rank)
            if group is None:
                continue
            kind = KINDS[step.kind]
            ops[once] += kind.ops_added(step, rank, group) if isinstance(kind, Local) else 1
        if planned.need.site.kind is SiteKind.WRITE_BACK and any(s.group_of(rank) for s in planned.plan.steps):
            ops[once] += 1
    for bucket in state.buckets:
        if rank in bucket.src.mesh.ranks:
            ops[True] += allreduce_fusion.emitted_ops(state, bucket, [by_index[i] for i in bucket.members], rank)
    for bucket in state.zero_buckets:
        ops[True] += zero_fusion.emitted_ops(bucket, [by_index[i] for i in bucket.members], rank)
    return ops[False], ops[True]


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
    kept = saved_activations(graph)
    pipeline = state.strategy.pipeline
    peak, held_at_peak = 0, 0
    for position, rank in enumerate(ranks):
        held = 0
        for key, value in graph.values.items():
            if value.kind not in ("parameter", "state"):
                continue
            dist = propagation.dist(key)
            if rank not in dist.mesh.ranks:
                continue
            held += tensor_bytes(value.shape, value.dtype, dist, rank)
            if value.kind == "parameter":
                held += tensor_bytes(value.shape, value.dtype, grads.get(key, dist), rank)
        activations = sum(
            tensor_bytes(graph.values[k].shape, graph.values[k].dtype, propagation.dist(k), rank)
            for k in kept if rank in propagation.dist(k).mesh.ranks
        )  # fmt: skip
        in_flight = 1
        if pipeline is not None:
            in_flight = micro if pipeline.schedule == "FThenB" else min(micro, len(ranks) - position)
        total = held + activations * in_flight
        if total > peak:
            peak, held_at_peak = total, held
    return peak, held_at_peak
