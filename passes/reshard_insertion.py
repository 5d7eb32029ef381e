"""Reshard insertion: the planner's steps become ops in every rank program
(stage: partitioned -> comm-inserted).

Wherever propagation recorded a :class:`ReshardNeed` (a consumer needs another placement than
its input has, or a user annotation differs from what the producer makes), the cheapest plan
from :func:`autopar.cost_model.plan_reshard` is emitted: collectives as Paddle collective ops
(``pd_op.all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) with their output
typed to the exact local shape, local steps as ``slice`` / ``scale`` ops. Every collective
is recorded as a :class:`CommOp` (why, group, bytes, predicted time) keyed by the op that
carries it; the host runtime performs it from that record, and a lowering pass adapts the op
for the native backend. One reshard of one value to one placement is emitted once per rank
and reused by every later consumer that needs the same.
"""

from __future__ import annotations

from typing import Any, ClassVar

from autopar.cost_model import plan_reshard
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.passes.base import CommOp, CompileState, Pass, RankProgram
from autopar.propagation import ReshardNeed

REDUCE_CODES = {"sum": 0, "max": 1, "min": 2, "prod": 3, "avg": 4}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class ReshardInsertionPass(Pass):
    name: ClassVar[str] = "reshard_insertion"
    requires_stage: ClassVar[str] = "partitioned"
    ensures_stage: ClassVar[str] = "comm-inserted"

    def run(self, state: CompileState) -> None:
        import paddle

        rings = state.rings
        for rp in state.ranks.values():
            done: dict[tuple[ValueKey, Any], Any] = {}
            with paddle.static.program_guard(rp.program):
                for index, need in enumerate(state.propagation.reshards):
                    self._emit_need(state, rp, index, need, done, rings)
                paddle.pir.reset_insertion_point_to_end()

    def _emit_need(self, state: CompileState, rp: RankProgram, index: int, need: ReshardNeed, done: dict, rings: dict) -> None:
        import paddle

        graph = state.graph
        value = graph.values[need.value]
        plan = plan_reshard(need.have, need.need, value.shape, value.dtype, state.cluster)
        if not plan.steps:
            return
        reader = graph.ops[need.op]
        if need.position >= 0 and reader.short_name.endswith("_") and value.kind in ("parameter", "state"):
            raise AutoparError(
                f"{reader} updates {value.label} in place but needs it as {need.need} while it is {need.have}: "
                "a resharded copy would take the update and lose it"
            )
        after_producer = need.position < 0
        consumer = rp.ops[need.op]
        if not after_producer:
            # the operand may sit in a builtin.combine feeding the reader (a vector member)
            site_op, site_pos = reader.sites[need.position]
            if site_pos < 0:
                raise AutoparError(
                    f"{reader} reads {value.label} inside a vector not built by builtin.combine; "
                    f"it would need a reshard {need.have} -> {need.need} that cannot be placed there"
                )
            consumer = rp.ops[site_op]
        if after_producer:
            reason = f"{value.label} is annotated {need.need}; its producer {graph.ops[need.op]} makes {need.have}"
            paddle.pir.set_insertion_point_after(consumer)
        else:
            cached = done.get((need.value, need.need))
            if cached is not None:
                consumer.operand(site_pos).set_source(cached)
                return
            reason = f"{graph.ops[need.op]} reads {value.label} as {need.need}; it is {need.have}"
            paddle.pir.set_insertion_point(consumer)
        source = rp.current(need.value)
        current, inserted = source, set()
        for number, step in enumerate(plan.steps):
            current = _emit_step(state, rp, step, current, value, reason, rings, (index, number))
            if current is not source:
                inserted.add(current.get_defining_op().id())
        if after_producer:
            _replace_uses_after(source, current, inserted)
        else:
            consumer.operand(site_pos).set_source(current)
            done[(need.value, need.need)] = current


def _emit_step(
    state: CompileState, rp: RankProgram, step: Any, x: Any, value: Any, reason: str, rings: dict, key: tuple[int, int]
) -> Any:
    """Emit one plan step on ``rp.rank``; returns the value holding the new placement."""
    import paddle

    rank = rp.rank
    group = next((g for g in step.groups if rank in g), None)
    if step.kind in ("send_recv", "broadcast"):
        raise AutoparError(f"reshard of {value.label} across meshes ({step}) lands with the pipeline issue")
    if group is None:
        return x
    local = step.dst.local_shape(value.shape, rank)
    if step.kind == "slice":
        out = _slice(x, step, value.shape, rank)
    elif step.kind == "make_partial":
        if step.reduce in ("max", "min") or rank == group[0]:
            return x
        out = paddle._C_ops.scale(x, 0.0, 0.0, True)
    else:
        out = _collective(step, x, group, rings)
        rp.comm_ops.append(
            CommOp(
                kind=step.kind, group=tuple(group), value=value.label, src=step.src, dst=step.dst,
                reason=reason, bytes=step.bytes, time=step.time, reduce=step.reduce or "sum",
                axis=step.tensor_dims[0] if step.tensor_dims else 0,
                split_axis=step.tensor_dims[-1] if step.kind == "all_to_all" else 0,
                op_id=out.get_defining_op().id(), output_shape=tuple(local), shape=tuple(value.shape), step_key=key,
            )
        )  # fmt: skip
    out.set_type(paddle.pir.create_shaped_type(x.type(), list(local)))
    return out


def _collective(step: Any, x: Any, group: tuple[int, ...], rings: dict) -> Any:
    import paddle

    ring = rings.setdefault(tuple(group), len(rings))
    if step.kind == "all_reduce":
        return paddle._C_ops.all_reduce(x, ring, REDUCE_CODES[step.reduce or "sum"])
    if step.kind == "all_gather":
        return paddle._C_ops.all_gather(x, ring, len(group))
    if step.kind == "all_to_all":
        return paddle._C_ops.all_to_all(x, ring)
    try:
        return paddle._C_ops.reduce_scatter(x, ring, len(group))
    except ValueError:
        # uneven or non-leading scatter: Paddle's op cannot even be built; the CommOp record
        # carries the semantics and the host backend performs it (native lowering: later).
        return paddle._C_ops.assign(x)


def _slice(x: Any, step: Any, shape: tuple[int, ...], rank: int) -> Any:
    """This rank's new piece out of the piece it holds (bounds from the global split)."""
    import paddle

    old = step.src.local_slices(shape, rank)
    new = step.dst.local_slices(shape, rank)
    axes = [t for t in range(len(shape)) if old[t] != new[t]]
    starts = [new[t].start - old[t].start for t in axes]
    ends = [new[t].stop - old[t].start for t in axes]
    return paddle._C_ops.slice(x, axes, starts, ends, [1] * len(axes), [])


def _replace_uses_after(source: Any, new: Any, inserted: set[int]) -> None:
    """Every reader of ``source`` except the inserted reshard ops reads ``new`` instead."""
    for user in list(source.all_used_ops()):
        if user.id() in inserted:
            continue
        for i in range(user.num_operands()):
            if user.operand_source(i).is_same(source):
                user.operand(i).set_source(new)
