"""A scan along a split dim: each rank's local scan plus the carry of the shards before it
(stage: comm-inserted -> scans-carried; the emitter of the lowering
:data:`~autopar.spmd.scan.SCAN_CARRIES` cumsum's rules declare, run by
:mod:`autopar.passes.op_lowering`).

The rules of :mod:`autopar.spmd.scan` keep the scanned dim's split, so Paddle's kernel scans
each rank's piece from zero. Right after the op, each rank adds what its piece misses (``i``:
its shard's index along the dim, of ``parts``):

    total = sum(x_i, axis, keepdim)                       this shard's total, one row
    rows  = all_gather(total) over the dim's mesh dims    parts rows: every shard's total
    out   = scan_i + sum(rows[:i], axis, keepdim)         (a backward scan: rows[i + 1:])

The all_gather is the planned reshard ``S(axis) -> R`` of the totals (``parts`` rows), emitted
by :func:`~autopar.passes.reshard_emission.emit_step`: ``dist.comm_ops(rank)`` lists it, every
backend runs it, and a rank whose carry is empty (the first shard) still takes part. A pending
sum of x stays pending (the totals keep it). The op stays; its readers read ``out``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.causes import in_layer, layer_of
from autopar.collective import CollectiveKey
from autopar.cost_model import plan_reshard
from autopar.graph import OpNode
from autopar.passes.base import CompileState, RankProgram
from autopar.passes.reshard_emission import cast_to, dtype_name, emit_step, replace_uses
from autopar.spmd.scan import ScanCarry


@dataclass(frozen=True, slots=True)
class TotalsValue:
    """The shards' totals an all_gather moves (what emit_step reads of a serial value)."""

    label: str
    shape: tuple[int, ...]
    dtype: str


def rewrite(state: CompileState, rp: RankProgram, op: OpNode, carry: ScanCarry) -> None:
    """Add the carry of the earlier (or later) shards to ``op``'s local scan on ``rp`` (the emitter
    of :data:`~autopar.spmd.scan.SCAN_CARRIES`)."""
    import paddle

    serial = rp.ops[op.index]
    slot = 1 if op.short_name == "cumsum_grad" else 0  # (the grad scans out_grad)
    x, scanned = serial.operand_source(slot), serial.result(0)
    value = state.graph.values[op.inputs[slot]]
    index, parts = carry.dist.shard_index(carry.axis, rp.rank)
    paddle.pir.set_insertion_point_after(serial)
    total = cast_to(paddle._C_ops.sum(x, [carry.axis], None, True), dtype_name(x))
    rows = _all_gather(state, rp, op, carry, total, value, parts)
    before = range(index + 1, parts) if carry.backward else range(index)
    if not before:  # the first shard: its local scan is the scan (it still sent its total)
        return
    taken = paddle._C_ops.slice(rows, [carry.axis], [before.start], [before.stop], [1], [])
    out = paddle._C_ops.add(scanned, cast_to(paddle._C_ops.sum(taken, [carry.axis], None, True), dtype_name(x)))
    replace_uses(scanned, out, {out.get_defining_op().id()})
    rp.replaced[op.outputs[0]] = out


def carry_plan(state: CompileState, op: OpNode, carry: ScanCarry) -> tuple[Any, tuple[int, ...]]:
    """The planned reshard ``S(axis) -> R`` of the shards' totals (``parts`` rows along the
    scanned dim, pending sums kept) and their global shape: what :func:`rewrite` emits and
    :mod:`autopar.pricing` prices."""
    slot = 1 if op.short_name == "cumsum_grad" else 0
    value = state.graph.values[op.inputs[slot]]
    shape = list(value.shape)
    shape[carry.axis] = math.prod(carry.dist.mesh.shape[d] for d in carry.mesh_dims)  # (parts)
    src = carry.dist
    dst = src.with_mapping([() if d == carry.axis else dims for d, dims in enumerate(src.mapping)])
    return plan_reshard(src, dst, tuple(shape), value.dtype, state.cluster), tuple(shape)


def _all_gather(
    state: CompileState, rp: RankProgram, op: OpNode, carry: ScanCarry, total: Any, value: Any, parts: int
) -> Any:
    """Every shard's total on every rank of the scanned dim's mesh dims (:func:`carry_plan`)."""
    plan, shape = carry_plan(state, op, carry)
    names = "/".join(carry.dist.mesh.dim_names[d] for d in carry.mesh_dims)
    totals = TotalsValue(f"{value.label}.shard_totals", shape, value.dtype)
    reason = (
        f"{in_layer('scan carry', layer_of(state.graph, op.index))}: {op} scans {value.label} along dim "
        f"{carry.axis}, split over {names}: all_gather of each shard's total ({parts} rows) for the carry"
    )
    for i, step in enumerate(plan.steps):
        total = emit_step(state, rp, step, total, totals, reason, CollectiveKey("scan_carry", op.index, i))
    return total
