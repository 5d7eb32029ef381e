"""Backend lowering for the native backend: collectives the backend lacks become ones it has
(stage: comm-inserted -> lowered).

The rank programs carry one op per planned collective, typed to the exact local result;
the host runtime performs them from their CommOp records. The native backend runs the
program itself, so each collective must be a real Paddle op with Paddle's semantics:

- ``all_gather`` concatenates on dim 0: along another dim it becomes all_gather + split +
  concat; uneven pieces are refused (NCCL / gloo gather equal sizes).
- ``reduce_scatter`` (no CPU kernel; gloo has none) becomes all_reduce + this rank's slice.
- ``all_to_all`` (no CPU kernel) becomes the gather along its source dim + this rank's slice
  along its target dim.
A new (lowered) clone of each rank program is returned; the host programs stay as they are.
"""

from __future__ import annotations

from typing import Any

from autopar.dist_attr import shard_bounds
from autopar.errors import AutoparError
from autopar.passes.base import CommOp, RankProgram
from autopar.passes.reshard_insertion import REDUCE_CODES


def lower_for_native(
    rp: RankProgram, rings: dict[tuple[int, ...], int], world: int, keep: list[tuple[int, int]] = ()
) -> tuple[Any, list[Any]]:
    """A clone of ``rp.program`` whose collectives all run as Paddle ops on a gloo/NCCL ring,
    and the clone's values at ``keep`` positions ((op position, result) in ``rp.program``)."""
    import paddle

    for comm in rp.comm_ops:
        if sorted(comm.group) != list(range(world)) and paddle.is_compiled_with_cuda() is False:
            raise AutoparError(
                f"native backend on CPU: {comm.kind} over ranks {list(comm.group)} does not span the world "
                "(gloo runs one communicator per process); use the host backend"
            )
    clone = rp.program.clone()
    ops = list(clone.global_block().ops)
    original = list(rp.program.global_block().ops)
    by_id = {op.id(): i for i, op in enumerate(original)}
    kept = [ops[i].result(j) for i, j in keep]
    with paddle.static.program_guard(clone):
        for comm in rp.comm_ops:
            op = ops[by_id[comm.op_id]]
            if comm.kind == "all_reduce" or (comm.kind == "all_gather" and comm.axis == 0 and _even(comm)):
                continue
            paddle.pir.set_insertion_point(op)
            new = _lowered(comm, op.operand_source(0), rings[tuple(comm.group)], rp.rank)
            new.set_type(paddle.pir.create_shaped_type(op.result(0).type(), list(comm.output_shape)))
            kept = [new if v.is_same(op.result(0)) else v for v in kept]
            op.result(0).replace_all_uses_with(new)
            op.erase()
        paddle.pir.reset_insertion_point_to_end()
    return clone, kept


def _even(comm: CommOp) -> bool:
    """Whether every member contributes a piece of the same size (what Paddle's gather needs)."""
    return len({comm.src.local_shape(comm.shape, r)[comm.axis] for r in comm.group}) == 1


def _lowered(comm: CommOp, x: Any, ring: int, rank: int) -> Any:
    import paddle

    parts = len(comm.group)
    index = comm.group.index(rank)
    if comm.kind == "reduce_scatter":
        full = paddle._C_ops.all_reduce(x, ring, REDUCE_CODES[comm.reduce])
        return _own_slice(full, comm.axis, parts, index)
    if comm.kind in ("all_gather", "all_to_all") and not _even(comm):
        raise AutoparError(
            f"native backend: {comm.kind} of {comm.value} gathers uneven pieces {comm.src} (shape {list(comm.shape)}); "
            "use the host backend"
        )
    if comm.kind == "all_gather":
        return _gather_along(x, comm.axis, ring, parts)
    if comm.kind == "all_to_all":
        gathered = _gather_along(x, comm.axis, ring, parts)
        return _own_slice(gathered, comm.split_axis, parts, index)
    raise AutoparError(f"the native backend cannot run {comm.kind} (from {comm.value}); use the host backend")


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
