"""Reshard emission: the planned reshards become ops of one rank's program
(stage: partitioned -> comm-inserted).

Every :class:`~autopar.passes.base.PlannedReshard` (planned once for the job by
:mod:`.reshard_planning`) is emitted at its site: collectives as Paddle collective ops
(``pd_op.all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) with their output
typed to the exact local shape, local steps as ``slice`` / ``scale`` ops. Each collective is
recorded as a :class:`~autopar.collective.Collective` value (why, group, bytes, predicted
time) with the op that carries it; the host runtime performs it from that value, and
backend lowering adapts the op for the native backend. A reshard that shares its result with
an earlier one reads that result; gradient all-reduces planned into a bucket are left to
:mod:`.allreduce_fusion`. A write-back (ZeRO: an in-place update of a resharded copy) reshards
the updated copy right after the op and assigns it to the updated variable (``assign_out_``).
A collective of a dtype Paddle's build registers no kernel for (bfloat16 on the CPU build) is
carried in the host form all the same (:func:`collective_op`); a gradient reduced in another
dtype (``Strategy.reduce_dtype``, planned so) is cast to it before its steps and back after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import KINDS, point_to_point
from autopar.dropless import dropless_collective
from autopar.errors import AutoparError, NativeUnsupported
from autopar.graph import Role
from autopar.passes.base import CompileState, Pass, PlannedReshard, RankProgram
from autopar.propagation import SiteKind


@dataclass(frozen=True)
class ReshardEmission(Pass):
    name: ClassVar[str] = "reshard_emission"
    emit_requires: ClassVar[tuple[str, ...]] = ("partitioned", "reshard-planned")
    emit_ensures: ClassVar[str] = "comm-inserted"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        fused = {m for bucket in (*state.buckets, *state.zero_buckets, *state.site_buckets) for m in bucket.members}
        with paddle.static.program_guard(rp.program):
            for planned in state.reshards:
                if planned.index not in fused:
                    _emit(state, rp, planned)
            paddle.pir.reset_insertion_point_to_end()


def read_site(state: CompileState, rp: RankProgram, planned: PlannedReshard) -> tuple[Any, int]:
    """The op (of ``rp``) and operand slot where a before-read reshard's result is read:
    the reader itself, or the builtin.combine feeding it (a vector member)."""
    site_op, site_pos = state.graph.ops[planned.need.op].sites[planned.need.site.slot]
    return rp.ops[site_op], site_pos


def _emit(state: CompileState, rp: RankProgram, planned: PlannedReshard) -> None:
    import paddle

    need = planned.need
    if not _involved(state, rp.rank, planned):
        return  # another pipeline stage's reshard
    if planned.shared_with is not None and planned.shared_with not in rp.resharded:
        return
    if need.site.kind is SiteKind.REFRESH:  # after every update and write-back of the step
        paddle.pir.reset_insertion_point_to_end()
    elif need.site.kind is not SiteKind.BEFORE_READ:
        paddle.pir.set_insertion_point_after(rp.ops[need.op])
    else:
        consumer, slot = read_site(state, rp, planned)
        if planned.shared_with is not None:
            consumer.operand(slot).set_source(rp.resharded[planned.shared_with])
            return
        paddle.pir.set_insertion_point(consumer)
    value = state.graph.values[need.value]
    after = need.site.kind not in (SiteKind.BEFORE_READ, SiteKind.REFRESH)
    source = rp.produced(need.value) if after else rp.current(need.value)
    current, inserted = source, set()
    moved = planned.plan.dtype  # (a gradient reduced in another dtype: Strategy.reduce_dtype)
    if moved != value.dtype:
        current = cast_to(current, moved)
        inserted.add(current.get_defining_op().id())
    for number, step in enumerate(planned.plan.steps):
        key = CollectiveKey("reshard", planned.index, number)
        current = emit_step(state, rp, step, current, value, planned.reason, key)
        if current is not source:
            inserted.add(current.get_defining_op().id())
    if moved != value.dtype:
        current = cast_to(current, value.dtype)
        inserted.add(current.get_defining_op().id())
    if need.site.kind is SiteKind.AFTER_PRODUCER:
        replace_uses(source, current, inserted)
        rp.final[need.value] = current
    elif need.site.kind is SiteKind.WRITE_BACK:
        # the op updated a resharded copy: its variable (a parameter) takes the result
        target = rp.value(state.graph.ops[need.op].inputs[need.site.slot])
        inserted.add(paddle._C_ops.assign_out_(current, target).get_defining_op().id())
    elif need.site.kind is SiteKind.REFRESH:
        if rp.rank in need.need.mesh.ranks:  # the copy's holder: its variable takes the update
            inserted.add(paddle._C_ops.assign_out_(current, source).get_defining_op().id())
    else:
        consumer.operand(slot).set_source(current)
    rp.resharded[planned.index] = current
    if state.graph.ops[need.op].role is Role.OPTIMIZER:  # both ends run it with the update, once per step
        rp.update_side.update(inserted)


def _involved(state: CompileState, rank: int, planned: PlannedReshard) -> bool:
    """Whether ``rank`` runs the op the reshard is placed at or takes part in one of its steps."""
    if rank in state.propagation.op_meshes.get(planned.need.op, state.mesh).ranks:
        return True
    return any(step.group_of(rank) is not None for step in planned.plan.steps)


def emit_step(state: CompileState, rp: RankProgram, step: Any, x: Any, value: Any, reason: str, key: CollectiveKey) -> Any:
    """Emit one plan step on ``rp.rank``; returns the value holding the new placement (an
    all_to_all of a dropless MoE buffer says its padding, or is sent uneven where planning chose
    so: :func:`autopar.dropless.dropless_collective`)."""
    import paddle

    rank = rp.rank
    group = step.group_of(rank)
    if group is None:
        return x
    entry = KINDS[step.kind]
    if point_to_point(step.kind):
        return _point_to_point(state, rp, step, x, value, reason, key, group)
    local = step.dst.local_shape(value.shape, rank)
    if step.kind.is_local:
        out = entry.local_op(step, x, tuple(value.shape), rank, group)
        if out is x:
            return x
    else:
        axis, split_axis = entry.axes(step.tensor_dims)
        collective = Collective(
            kind=step.kind, group=group, key=key, value=value.label, src=step.src, dst=step.dst,
            shape=tuple(value.shape), output_shape=tuple(local), bytes=step.bytes, time=step.time, reason=reason,
            reduce=step.reduce or "sum", axis=axis, split_axis=split_axis,
            root=0, dtype=dtype_name(x), shift=step.shift,
        )  # fmt: skip
        collective = dropless_collective(state.graph, collective)
        return emit_collective(state, rp, collective, x, step.mesh_dims)
    out.set_type(paddle.pir.create_shaped_type(x.type(), list(local)))
    return out


def _point_to_point(
    state: CompileState, rp: RankProgram, step: Any, x: Any, value: Any, reason: str, key: CollectiveKey, pair: tuple[int, ...]
) -> Any:
    """One rank's half of a move between meshes (pipeline stages): a ``send`` of what it holds,
    or a ``recv`` of the piece it will hold. The receiver's op does not read the sender's value
    (that value is made on another stage): it stands for the message, typed to the local shape."""
    import paddle

    sender, receiver = pair
    sending = rp.rank == sender
    shape = tuple(value.shape)
    local = step.src.local_shape(shape, sender) if sending else step.dst.local_shape(shape, receiver)
    collective = Collective(
        kind=CollectiveKind.SEND if sending else CollectiveKind.RECV, group=pair, key=key, value=value.label,
        src=step.src, dst=step.dst, shape=shape, output_shape=tuple(local), bytes=step.bytes, time=step.time,
        reason=reason, dtype=value.dtype,
    )  # fmt: skip
    rp.rings.setdefault(pair, state.ring_of((), pair))
    if sending:
        out = paddle._C_ops.assign(x)
    else:
        out = paddle._C_ops.assign(paddle._C_ops.full(list(local), 0.0, x.dtype, paddle.CPUPlace()))
        out.set_type(paddle.pir.create_shaped_type(x.type(), list(local)))
    rp.collectives.append((collective, out.get_defining_op().id()))
    return out


def emit_collective(state: CompileState, rp: RankProgram, collective: Collective, x: Any, mesh_dims: Any) -> Any:
    """The op carrying ``collective`` on ``rp`` (its ring made over ``mesh_dims``), reading ``x``
    and typed to ``collective.output_shape``, recorded in ``rp.collectives``: every emission
    site's one way to put a collective into a rank program (:func:`collective_op`)."""
    import paddle

    ring = rp.rings.setdefault(collective.group, state.ring_of(mesh_dims, collective.group))
    out = collective_op(collective, x, ring, native=rp.backend == "native")
    out.set_type(paddle.pir.create_shaped_type(x.type(), list(collective.output_shape)))
    rp.collectives.append((collective, out.get_defining_op().id()))
    return out


def collective_op(collective: Collective, x: Any, ring: int, native: bool = False) -> Any:
    """The Paddle op carrying ``collective``. Paddle checks an op's input dtype against the kernels
    its build registers when the op is built: the CPU build has no bfloat16 collective kernel.
    In the host form the op is only a placeholder the runtime performs from the Collective
    value, so a dtype the build cannot carry is carried anyway (:func:`_carrier`); the native
    form runs the op itself, so there it is refused by name (``NativeUnsupported``: the host
    backend runs it, and ``backend="auto"`` picks that)."""
    entry = KINDS[collective.kind]
    try:
        return entry.host_op(collective, x, ring)
    except TypeError as err:
        if "Check data type error" not in str(err):
            raise
    if native:
        raise NativeUnsupported(
            f"native backend: {collective.kind} of {collective.value} ({collective.dtype}, "
            f"{collective.reason.split(':')[0]}) cannot be built: this Paddle build has no {collective.dtype} "
            "kernel for it; the host backend carries it (backend='host' or 'auto')"
        )
    return _carrier(entry, collective, x, ring)


def _carrier(entry: Any, collective: Collective, x: Any, ring: int) -> Any:
    """``entry``'s host op for ``x`` of a dtype the build has no kernel for: built on a float32
    proxy of ``x`` (a cast), then made to read ``x`` itself, its result retyped to ``x``'s dtype
    and the proxy erased. Paddle never runs the op (the host runtime performs the Collective),
    so the program text says what moves: a bfloat16 all_reduce of the bfloat16 value."""
    import paddle

    proxy = paddle._C_ops.cast(x, paddle.float32)
    out = entry.host_op(collective, proxy, ring)
    op = out.get_defining_op()
    if op.num_operands() < 1 or not op.operand_source(0).is_same(proxy) or not proxy.has_one_use():
        raise AutoparError(f"{collective.kind} of {collective.value}: its host op does not read its input as operand 0")
    op.operand(0).set_source(x)
    proxy.get_defining_op().erase()
    out.set_type(paddle.pir.create_shaped_type(x.type(), list(out.shape)))
    return out


def dtype_name(x: Any) -> str:
    """The dtype of a Paddle value by its name (``"bfloat16"``), as Collectives and plans spell it."""
    return str(x.dtype).removeprefix("paddle.")


def cast_to(x: Any, dtype: str) -> Any:
    """``x`` cast to ``dtype`` (a name), or ``x`` itself when it has that dtype."""
    import paddle

    return x if dtype_name(x) == dtype else paddle._C_ops.cast(x, getattr(paddle, dtype))


def replace_uses(source: Any, new: Any, inserted: set[int] = frozenset()) -> None:
    """Every reader of ``source`` except the ``inserted`` ops reads ``new`` instead (also the
    per-rank rewrites' way to hand an erased op's readers its replacement)."""
    for user in list(source.all_used_ops()):
        if user.id() in inserted:
            continue
        for i in range(user.num_operands()):
            if user.operand_source(i).is_same(source):
                user.operand(i).set_source(new)
