"""Dropout slicing: a training dropout on a split input applies exactly its slice of the serial
mask, with no communication (stage: comm-inserted -> dropout-sliced; the emitter of the lowering
:data:`~autopar.spmd.dropout.DROPOUT_SLICES` dropout's rule declares, run by
:mod:`autopar.passes.op_lowering`).

Paddle's dropout draws its mask from the op's fixed seed over the *local* shape, so a rank
holding rows 4..7 would draw the serial mask's rows 0..3. The rule
(:mod:`autopar.spmd.dropout`) keeps the input's split; here each rank draws the mask over the
serial (global) shape with the same seed — dropout of a tensor of ones, which is the mask
already scaled — and multiplies its piece of the input by its box of that tensor:

    scaled = dropout(ones(global shape), seed, p)      # every rank: the serial mask / (1 - p)
    out    = x * scaled[box]        mask = dropout's mask[box]

Micro-batches are the same split along time: micro-batch ``k`` of ``m`` holds block ``k`` of
the dim micro-batching splits (:mod:`autopar.rewrites.micro_batching`), and every micro-batch
runs the same program. So under micro-batching the mask is drawn over the whole step's shape
(one micro-batch's times ``m`` along that dim), block ``k`` is cut out with ``k`` read from the
feed :data:`~autopar.feed_names.MICRO_BATCH_FEED` (the pipeline runner feeds each
micro-batch its number), and then the rank's box of the micro-batch (pp x dp: its dp shard)::

    scaled = dropout(ones(step shape), seed, p)[block k][box]

Under ``ContextParallel(balance="zigzag")`` a dropout whose input carries the sequence in
zig-zag order (:mod:`autopar.zigzag_values`: attention probabilities on both sequence dims,
activations on dim 1) is lowered here even unsplit: the serial mask drawn, then reordered along
those dims (``index_select`` with the zig-zag index) before the box is cut — exactly the serial
mask's elements, each where the value it multiplies is.

A recomputed dropout reads the forward's kept mask (:mod:`autopar.rewrites.recompute`), which
is this sliced one: the same elements dropped. Drawing the whole mask costs each rank (and
each micro-batch) the elementwise work of the whole tensor; it moves no bytes.
"""

from __future__ import annotations

from typing import Any

from autopar.errors import AutoparError
from autopar.feed_names import MICRO_BATCH_FEED
from autopar.graph import OpNode
from autopar.passes.base import CompileState, RankProgram
from autopar.passes.reshard_emission import replace_uses
from autopar.spmd.dropout import SlicedDropout


def rewrite(state: CompileState, rp: RankProgram, op: OpNode, sliced: SlicedDropout) -> None:
    """Replace the dropout ``op`` in ``rp`` by its box of the serial mask (the emitter of
    :data:`~autopar.spmd.dropout.DROPOUT_SLICES`)."""
    import paddle

    serial = rp.ops[op.index]
    x, seed_tensor, p = (serial.operand_source(i) for i in range(3))
    value = state.graph.values[op.inputs[0]]
    shape = list(value.shape)  # one micro-batch's (the whole step's without micro-batching)
    attrs = op.attrs
    paddle.pir.set_insertion_point(serial)
    dim = sliced.micro_dim
    drawn = list(value.program_shape) if dim is not None else shape
    ones = paddle._C_ops.full(drawn, 1.0, x.dtype, paddle.CPUPlace())
    seed = seed_tensor if seed_tensor.initialized() else None
    whole = paddle._C_ops.dropout(ones, seed, p, False, attrs["mode"], attrs["seed"], attrs["fix_seed"])
    scaled, mask = whole, whole.get_defining_op().result(1)
    if sliced.order is not None:  # the input carries the sequence in zig-zag order: the serial mask reordered alike
        scaled, mask = (in_zigzag_order(t, sliced.order, drawn, str(op)) for t in (scaled, mask))
    if dim is not None:  # this micro-batch's block of the step's mask: rows [k * n, (k + 1) * n) of dim ``dim``
        if drawn[dim] != shape[dim] * state.micro.count:
            raise AutoparError(
                f"{op} (training dropout): dim {dim} of its input {value.label} {drawn} is not {state.micro.count} "
                f"micro-batches of {shape[dim]} rows, so a micro-batch's rows of the serial mask are no block of it"
            )
        micro_batch = _micro_batch_feed(rp)
        rows = float(shape[dim])
        start = paddle._C_ops.scale(micro_batch, rows, 0.0, True)
        stop = paddle._C_ops.scale(micro_batch, rows, rows, True)
        scaled, mask = (_shaped(paddle._C_ops.slice(t, [dim], start, stop, [-1], []), shape) for t in (scaled, mask))
    box = state.propagation.op_results[op.index].inputs[0].local_slices(shape, rp.rank)
    axes = [t for t, s in enumerate(box) if (s.start, s.stop) != (0, shape[t])]
    if axes:
        starts, ends = [box[t].start for t in axes], [box[t].stop for t in axes]
        scaled, mask = (paddle._C_ops.slice(t, axes, starts, ends, [1] * len(axes), []) for t in (scaled, mask))
    out = paddle._C_ops.multiply(x, scaled)
    for old, new in ((serial.result(0), out), (serial.result(1), mask)):
        replace_uses(old, new)
    rp.replaced[op.outputs[0]] = out
    if op.outputs[1] is not None:
        rp.replaced[op.outputs[1]] = mask
    rp.ops[op.index] = whole.get_defining_op()
    serial.erase()


def in_zigzag_order(value: Any, order: Any, shape: list[int], what: str) -> Any:
    """``value`` (drawn over ``shape`` in serial order) reordered along the dims where ``order``
    (a :class:`~autopar.rank_plan.SequenceOrder`) says the sequence is in zig-zag order: the
    same elements, where the reordered program's values they multiply are."""
    import numpy as np
    import paddle

    for dim, extent, inner in order.dims:
        if inner != 1 or shape[dim] != extent:
            raise AutoparError(
                f"{what} (training dropout) under ContextParallel(balance='zigzag'): dim {dim} of its input {shape} holds "
                "the sequence flattened with another dim; its serial mask is not reordered there; use balance=None"
            )
        index = paddle.assign(np.array([*order.order, *range(len(order.order), extent)], dtype="int64"))
        if value.dtype == paddle.uint8:  # (the mask: index_select takes no uint8)
            value = paddle._C_ops.cast(paddle._C_ops.index_select(paddle._C_ops.cast(value, paddle.int32), index, dim), paddle.uint8)
        else:
            value = paddle._C_ops.index_select(value, index, dim)
    return value


def _shaped(value: Any, shape: list[int]) -> Any:
    """``value`` typed with ``shape`` (a slice at fed offsets leaves the dim unknown)."""
    import paddle

    value.set_type(paddle.pir.create_shaped_type(value.type(), shape))
    return value


def _micro_batch_feed(rp: RankProgram) -> Any:
    """The rank program's micro-batch number feed, made at its first use."""
    import paddle

    for op in rp.program.global_block().ops:
        if op.name() == "pd_op.data" and op.attrs().get("name") == MICRO_BATCH_FEED:
            return op.result(0)
    return paddle._pir_ops.data(MICRO_BATCH_FEED, [1], paddle.int64, paddle.CPUPlace())
