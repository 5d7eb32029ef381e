"""Backend lowering for the native backend: collectives the backend lacks become ones it has
(stage: comm-fused -> lowered).

The host form of a rank program carries one op per planned collective, typed to the exact
local result; the host runtime performs them from their :class:`Collective` values. The
native backend runs the program itself, so each collective must be a real Paddle op with
Paddle's semantics:

- ``all_gather`` concatenates on dim 0: along another dim it becomes all_gather + split +
  concat; uneven pieces are refused (NCCL / gloo gather equal sizes).
- ``reduce_scatter`` (no CPU kernel; gloo has none) becomes all_reduce + this rank's slice.
- ``all_to_all`` (no CPU kernel) becomes the gather along its source dim + this rank's slice
  along its target dim.
- an average (``all_reduce`` / ``reduce_scatter`` of a Partial(avg), e.g. a fetched accuracy
  of data-parallel pieces) becomes a sum scaled by 1/n: gloo has no average ("Unsupported
  reduce type: 4" in the step), NCCL's needs NCCL >= 2.10; the scale costs one tiny op.
For the host backend the pass leaves the program as it is (the runtime runs the values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.collective import Collective
from autopar.dist_attr import shard_bounds
from autopar.errors import NativeUnsupported
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.reshard_emission import REDUCE_CODES


@dataclass(frozen=True)
class BackendLowering(Pass):
    name: ClassVar[str] = "backend_lowering"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted",)
    emit_ensures: ClassVar[str] = "lowered"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        if rp.backend == "native" and state.pipeline is not None:
            raise NativeUnsupported(
                "native backend: a pipeline's send / recv and its schedule run on the host backend "
                "(static gloo programs have no send / recv kernel); use backend='host' or 'auto'"
            )
        if rp.backend == "native":
            lower_for_native(rp, state.mesh.size)


def lower_for_native(rp: RankProgram, world: int) -> None:
    """Rewrite ``rp``'s collectives in place so all run as Paddle ops on a gloo/NCCL ring."""
    import paddle

    for collective, _ in rp.collectives:
        if sorted(collective.group) != list(range(world)) and paddle.is_compiled_with_cuda() is False:
            raise NativeUnsupported(
                f"native backend on CPU: {collective.kind} over ranks {list(collective.group)} does not span the world "
                "(gloo runs one communicator per process); use the host backend"
            )
    ops = {op.id(): op for op in rp.program.global_block().ops}
    lowered = []
    with paddle.static.program_guard(rp.program):
        for collective, op_id in rp.collectives:
            op = ops[op_id]
            if (collective.kind == "all_reduce" and collective.reduce != "avg") or (
                collective.kind == "all_gather" and collective.axis == 0 and _even(collective)
            ):
                lowered.append((collective, op_id))
                continue
            paddle.pir.set_insertion_point(op)
            new = _lowered(collective, op.operand_source(0), rp.rings[collective.group], rp.rank)
            new.set_type(paddle.pir.create_shaped_type(op.result(0).type(), list(collective.output_shape)))
            old = op.result(0)
            old.replace_all_uses_with(new)
            _repoint(rp, old, new)
            op.erase()
            lowered.append((collective, new.get_defining_op().id()))
        paddle.pir.reset_insertion_point_to_end()
    rp.collectives[:] = lowered


def _repoint(rp: RankProgram, old: Any, new: Any) -> None:
    """Records that name the replaced result (a fetch made whole, a reshard's result) name its
    replacement: the erased op's value would be a dangling reference."""
    for table in (rp.fetched, rp.final, rp.resharded, rp.replaced):
        for key, value in table.items():
            if value.is_same(old):
                table[key] = new


def _even(comm: Collective) -> bool:
    """Whether every member contributes a piece of the same size (what Paddle's gather needs)."""
    return len({comm.src.local_shape(comm.shape, r)[comm.axis] for r in comm.group}) == 1


def _lowered(comm: Collective, x: Any, ring: int, rank: int) -> Any:

    parts = len(comm.group)
    index = comm.group.index(rank)
    if comm.kind == "all_reduce":
        return _all_reduce(x, ring, comm.reduce, parts)
    if comm.kind == "reduce_scatter":
        return _own_slice(_all_reduce(x, ring, comm.reduce, parts), comm.axis, parts, index)
    if comm.kind in ("all_gather", "all_to_all") and not _even(comm):
        raise NativeUnsupported(
            f"native backend: {comm.kind} of {comm.value} gathers uneven pieces {comm.src} (shape {list(comm.shape)}; "
            f"{comm.reason}); use the host backend (backend='auto' does)"
        )
    if comm.kind == "all_gather":
        return _gather_along(x, comm.axis, ring, parts)
    if comm.kind == "all_to_all":
        gathered = _gather_along(x, comm.axis, ring, parts)
        return _own_slice(gathered, comm.split_axis, parts, index)
    raise NativeUnsupported(f"the native backend cannot run {comm.kind} (from {comm.value}); use the host backend")


def _all_reduce(x: Any, ring: int, reduce: str, parts: int) -> Any:
    import paddle

    if reduce == "avg":
        return paddle._C_ops.scale(paddle._C_ops.all_reduce(x, ring, REDUCE_CODES["sum"]), 1.0 / parts, 0.0, True)
    return paddle._C_ops.all_reduce(x, ring, REDUCE_CODES[reduce])


def _gather_along(x: Any, axis: int, ring: int, parts: int) -> Any:
    import paddle

    stacked = paddle._C_ops.all_gather(x, ring, parts)
    if axis == 0:
        return stacked
    pieces = paddle._C_ops.split_with_num(stacked, parts, 0)
    return paddle._C_ops.concat(pieces, axis)


def _own_slice(x: Any, axis: int, parts: int, index: int) -> Any:
    import paddle

    lo, hi = shard_bounds(x.shape[axis], parts, index)
    return paddle._C_ops.slice(x, [axis], [lo], [hi], [1], [])
