"""Dropout slicing: a training dropout on a split input applies exactly its slice of the serial
mask, with no communication (stage: comm-inserted -> dropout-sliced).

Paddle's dropout draws its mask from the op's fixed seed over the *local* shape, so a rank
holding rows 4..7 would draw the serial mask's rows 0..3. The rule
(:mod:`autopar.spmd.dropout`) keeps the input's split; here each rank draws the mask over the
serial (global) shape with the same seed — dropout of a tensor of ones, which is the mask
already scaled — and multiplies its piece of the input by its box of that tensor:

    scaled = dropout(ones(global shape), seed, p)      # every rank: the serial mask / (1 - p)
    out    = x * scaled[box]        mask = dropout's mask[box]

Drawing the whole mask costs each rank the elementwise work of the whole tensor; it moves no
bytes (gathering the input, as before, moved the whole activation). Micro-batching cannot do
this (its micro-batches would need different rows of one mask): :mod:`autopar.rewrites.micro_batching`
refuses a training dropout on a split batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.reshard_emission import replace_uses


def sliced_dropouts(state: CompileState) -> list[Any]:
    """Training dropouts whose input the propagation left split (program order)."""
    found = []
    for op in state.graph.ops:
        if op.name != "pd_op.dropout" or op.attrs.get("is_test", False) or op.index not in state.propagation.op_results:
            continue
        required = state.propagation.op_results[op.index].inputs[0]
        if required is not None and required.sharded_mesh_dims():
            found.append(op)
    return found


@dataclass(frozen=True)
class DropoutSlicing(Pass):
    name: ClassVar[str] = "dropout_slicing"
    emit_requires: ClassVar[tuple[str, ...]] = ("partitioned", "comm-inserted")
    emit_ensures: ClassVar[str] = "dropout-sliced"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        with paddle.static.program_guard(rp.program):
            for op in sliced_dropouts(state):
                if rp.ops[op.index] is not None and rp.rank in state.propagation.op_meshes[op.index].ranks:
                    _slice(state, rp, op)
            paddle.pir.reset_insertion_point_to_end()


def _slice(state: CompileState, rp: RankProgram, op: Any) -> None:
    import paddle

    serial = rp.ops[op.index]
    x, seed_tensor, p = (serial.operand_source(i) for i in range(3))
    shape = list(state.graph.values[op.inputs[0]].shape)
    attrs = op.attrs
    paddle.pir.set_insertion_point(serial)
    ones = paddle._C_ops.full(shape, 1.0, x.dtype, paddle.CPUPlace())
    seed = seed_tensor if seed_tensor.initialized() else None
    whole = paddle._C_ops.dropout(ones, seed, p, False, attrs["mode"], attrs["seed"], attrs["fix_seed"])
    mask = whole.get_defining_op().result(1)
    box = state.propagation.op_results[op.index].inputs[0].local_slices(shape, rp.rank)
    axes = [t for t, s in enumerate(box) if (s.start, s.stop) != (0, shape[t])]
    starts, ends = [box[t].start for t in axes], [box[t].stop for t in axes]
    scaled = paddle._C_ops.slice(whole, axes, starts, ends, [1] * len(axes), [])
    local_mask = paddle._C_ops.slice(mask, axes, starts, ends, [1] * len(axes), [])
    out = paddle._C_ops.multiply(x, scaled)
    for old, new in ((serial.result(0), out), (serial.result(1), local_mask)):
        replace_uses(old, new)
    rp.replaced[op.outputs[0]] = out
    if op.outputs[1] is not None:
        rp.replaced[op.outputs[1]] = local_mask
    rp.ops[op.index] = whole.get_defining_op()
    serial.erase()
