"""Fetch replication: values the user fetches are made whole on every rank inside the program
(stage: comm-fused -> fetches-placed; per rank, for the fetch list the Executor asks for).

A fetched value lies as its producer makes it: a loss is a pending sum under data
parallelism, an activation a batch shard. Gathering the pieces after the step through an
object exchange costs a round trip through the job's store per step (measured: 50x the step
of a small model) and the store keeps every step's bytes. Instead, the cheapest reshard to
Replicate (:func:`autopar.cost_model.plan_reshard`: an all_reduce of a scalar for a loss) is
emitted in the rank program, so the step's own collectives bring back every fetch whole.

A fetch whose reshard is one all_reduce over the group, reduction and dtype of a gradient
bucket (:mod:`.allreduce_fusion`) made after it rides in that bucket: its elements are
appended to the bucket's flat buffer and split off after the all_reduce — no collective of
its own (on a latency-bound data-parallel model a separate scalar all_reduce cost 1.2-1.4x
the step). Any other fetch gets its own collectives at the end of the program. Every rank
must ask for the same fetch list in the same order (they run the same script), which keys
the collectives alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.collective import Collective, CollectiveKey
from autopar.cost_model import plan_reshard
from autopar.cost_model.cluster import dtype_bytes
from autopar.cost_model.planner import ReshardPlan
from autopar.dist_attr import DistAttr
from autopar.passes.base import CompileState, Pass, RankProgram, ValueKey
from autopar.passes.reshard_emission import emit_step


@dataclass(frozen=True)
class FetchReplication(Pass):
    name: ClassVar[str] = "fetch_replication"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted",)
    emit_ensures: ClassVar[str] = "fetches-placed"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        if state.pipeline is not None:
            return  # a pipeline's fetches are added up over micro-batches by its runner
        plans = {key: whole_plan(state, key) for key in rp.fetches}
        with paddle.static.program_guard(rp.program):
            _ride_in_buckets(state, rp, plans)
            paddle.pir.reset_insertion_point_to_end()
            for index, key in enumerate(rp.fetches):
                if key not in rp.fetched:
                    rp.fetched[key] = _replicate(state, rp, index, key, plans[key])
            paddle.pir.reset_insertion_point_to_end()


def whole_plan(state: CompileState, key: ValueKey) -> ReshardPlan:
    value = state.graph.values[key]
    produced = state.propagation.made(key)
    whole = DistAttr.replicated(produced.mesh, len(value.shape))
    return plan_reshard(produced, whole, value.shape, value.dtype, state.cluster)


def _replicate(state: CompileState, rp: RankProgram, index: int, key: ValueKey, plan: ReshardPlan) -> object:
    value = state.graph.values[key]
    current = rp.produced(key)
    reason = f"fetched {value.label} is {plan.src}: made whole on every rank at the end of the step"
    for number, step in enumerate(plan.steps):
        current = emit_step(state, rp, step, current, value, reason, CollectiveKey("fetch", index, number))
    return current


def _ride_in_buckets(state: CompileState, rp: RankProgram, plans: dict[ValueKey, ReshardPlan]) -> None:
    """Append each fetch that can ride in an emitted gradient bucket to the bucket's buffer
    (the first bucket that fits it); ``rp.fetched`` takes the split-off whole value."""
    buckets = [n for n, (collective, _) in enumerate(rp.collectives) if collective.key.source == "bucket"]
    if not buckets or not plans:
        return
    ops = list(rp.program.global_block().ops)
    positions = {op.id(): i for i, op in enumerate(ops)}
    riders: dict[int, list[ValueKey]] = {}  # index in rp.collectives -> fetches riding
    for key, plan in plans.items():
        if key in rp.fetched:
            continue  # (rode in ZeRO's buckets: passes/zero_fusion.py)
        for number in buckets:
            collective, op_id = rp.collectives[number]
            if _fits(plan, collective, rp, key, positions[op_id], positions):
                riders.setdefault(number, []).append(key)
                break
    for number, keys in riders.items():
        collective, op_id = rp.collectives[number]
        rp.collectives[number] = (_widen(state, rp, collective, ops[positions[op_id]], keys), op_id)

def _fits(plan: ReshardPlan, bucket: Collective, rp: RankProgram, key: ValueKey, at: int, positions: dict[int, int]) -> bool:
    """Whether the fetch's reshard is the bucket's all_reduce (same group, reduction, dtype) and
    the fetched value is made before the bucket runs."""
    if len(plan.steps) != 1 or plan.steps[0].kind is not bucket.kind:
        return False
    step = plan.steps[0]
    if step.group_of(rp.rank) != bucket.group or (step.reduce or "sum") != bucket.reduce or plan.dtype != bucket.dtype:
        return False
    producer = rp.produced(key).get_defining_op()
    return producer is None or positions.get(producer.id(), at) < at


def _widen(state: CompileState, rp: RankProgram, bucket: Collective, op: Any, keys: list[ValueKey]) -> Collective:
    """The bucket's all_reduce ``op`` reads its flat buffer with the fetches appended; its
    gradients' pieces come out as before, each fetch its own piece (reshaped back). The
    bucket's own concat and split are rebuilt one longer (a second concat and split cost a
    dozen interpreter ops a step: 1.2x the step of a latency-bound model)."""
    import paddle

    flat = op.operand_source(0)
    (numel,) = flat.shape
    shapes = [tuple(state.graph.values[key].shape) for key in keys]  # whole: an all_reduce keeps the shape
    sizes = [math.prod(shape) for shape in shapes]
    paddle.pir.set_insertion_point(op)
    riders = [paddle._C_ops.reshape(rp.produced(key), [-1]) for key in keys]
    concat = flat.get_defining_op()
    if concat.name() == "pd_op.concat" and concat.operand_source(0).get_defining_op().name() == "builtin.combine":
        combine = concat.operand_source(0).get_defining_op()
        parts = [combine.operand_source(i) for i in range(combine.num_operands())]
        wide = paddle._C_ops.concat(parts + riders, 0)
        dead = [concat]
    else:
        dead = []
        wide = paddle._C_ops.concat([flat, *riders], 0)
    op.operand(0).set_source(wide)
    out = op.result(0)
    out.set_type(paddle.pir.create_shaped_type(out.type(), [numel + sum(sizes)]))
    paddle.pir.set_insertion_point_after(op)
    readers = list(out.all_used_ops())
    sections = _split_sections(readers)
    if sections is not None:  # the bucket's split, one section longer: its pieces replace the old ones
        (old,) = readers
        pieces = paddle._C_ops.split(out, [*sections, *sizes], 0)
        (unpack,) = old.result(0).all_used_ops()  # builtin.split
        for i in range(unpack.num_results()):
            unpack.result(i).replace_all_uses_with(pieces[i])
        dead += [unpack, old]
        pieces = pieces[len(sections) :]
    else:
        pieces = paddle._C_ops.split(out, [numel, *sizes], 0)
        for reader in readers:
            for i in range(reader.num_operands()):
                if reader.operand_source(i).is_same(out):
                    reader.operand(i).set_source(pieces[0])
        pieces = pieces[1:]
    labels = []
    for key, piece, shape in zip(keys, pieces, shapes):
        rp.fetched[key] = paddle._C_ops.reshape(piece, list(shape))
        labels.append(state.graph.values[key].label)
    for replaced in dead:  # last: the insertion point must not sit at an erased op
        _erase_unused(replaced)
    extra = sum(size * dtype_bytes(bucket.dtype) for size in sizes)
    total = numel + sum(sizes)
    return dataclasses.replace(
        bucket, shape=(total,), output_shape=(total,), bytes=bucket.bytes + extra,
        reason=f"{bucket.reason}; fetched {', '.join(labels)} rides along (no collective of its own)",
    )  # fmt: skip


def _split_sections(readers: list[Any]) -> list[int] | None:
    """The sections of the bucket's split when it is the buffer's only reader (else None)."""
    if len(readers) != 1 or readers[0].name() != "pd_op.split":
        return None
    sections = readers[0].operand_source(1).get_defining_op()
    if sections.name() != "pd_op.full_int_array" or len(readers[0].result(0).all_used_ops()) != 1:
        return None
    return [int(n) for n in sections.attrs()["value"]]


def _erase_unused(op: Any) -> None:
    """Erase ``op`` once nothing reads its results, then the ops that only fed it."""
    if not all(op.result(i).use_empty() for i in range(op.num_results())):
        return
    feeders = [op.operand_source(i).get_defining_op() for i in range(op.num_operands())]
    op.erase()
    for feeder in feeders:
        if feeder is not None and feeder.name() in ("builtin.combine", "pd_op.full", "pd_op.full_int_array", "builtin.split"):
            _erase_unused(feeder)
