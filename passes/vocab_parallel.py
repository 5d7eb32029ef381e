"""Vocabulary-parallel rewrite: ops whose local kernel is wrong on a split row are replaced,
in each rank's program, by what that rank must compute (stage: comm-inserted -> rows-rewritten;
the emitter of the lowering :data:`~autopar.spmd.vocab_parallel.VOCAB_ROWS` that the rules of
embedding, softmax and cross-entropy declare, run by :mod:`autopar.passes.op_lowering`).

The SPMD rules keep a table's vocabulary split (embedding) and a split normalized axis
(softmax, log_softmax, cross-entropy over class-split logits: Megatron's LM head), see
:mod:`autopar.spmd.vocab_parallel`. Paddle's kernels would treat the local piece as the whole
row, so each such op (:func:`~autopar.spmd.vocab_parallel.split_row`, from the placements
propagation required) becomes its decomposition, run here with Paddle ops
(:class:`ProgramKernels`): masked lookups of the rank's rows, and for rows split over ranks
an ``all_reduce`` of one value per row (max, sum of exponentials), or for the head's
cross-entropy one ``all_gather`` of three (each rank's max, sum of exponentials, target
logit). Each collective is planned as the reshard ``P(max|sum) -> R`` (or ``S -> R``) of that
per-row tensor and emitted by :func:`~autopar.passes.reshard_emission.emit_step`: a
:class:`~autopar.collective.Collective` value (kind, group, bytes, reason) in
``rp.collectives``, a real collective op in the program, so ``dist.comm_ops(rank)`` lists it, the host runtime (simulator, processes) performs
it and the native backend runs the op itself.

Runs after reshard emission: the op's operands are then final (resharded where its rule
required), and the readers of its results (reshards included) are rewired to the new values.
The serial op is erased; ``rp.ops`` maps it to the rewrite's local ``embedding`` /
``embedding_grad`` op, or else to the op making its last result (its program position and
pipeline phase: the ops inserted before it run in its phase); ``rp.replaced`` holds its results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.causes import in_layer, layer_of, value_layer
from autopar.collective import CollectiveKey
from autopar.cost_model import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.graph import OpNode
from autopar.passes.base import CompileState, RankProgram
from autopar.passes.lowered_ops import lowered_ops
from autopar.passes.reshard_emission import emit_step, replace_uses
from autopar.spmd.vocab_parallel import VOCAB_ROWS, SplitRow, decompose, local_padding


@dataclass(frozen=True, slots=True)
class RowValue:
    """The per-row tensor an all_reduce moves (what emit_step reads of a serial value)."""

    label: str
    shape: tuple[int, ...]
    dtype: str


def split_rows(state: CompileState) -> list[tuple[OpNode, SplitRow]]:
    """Every op of the program whose local kernel is wrong on its placements, in program order."""
    return [(op, split) for _, op, split in lowered_ops(state, VOCAB_ROWS)]


def rewrite(state: CompileState, rp: RankProgram, op: OpNode, split: SplitRow) -> None:
    """Replace ``op`` in ``rp`` by its decomposition (the emitter of :data:`VOCAB_ROWS`)."""
    import paddle

    serial = rp.ops[op.index]
    operands = [serial.operand_source(i) for i in range(serial.num_operands())]
    paddle.pir.set_insertion_point(serial)
    kernels = ProgramKernels(state, rp, op, split)
    results = decompose(split, kernels, operands, op.attrs)
    if kernels.lookup_op is None and results[-1].get_defining_op().num_operands() > serial.num_operands():
        # the op standing for the serial one (rp.ops) reads no more operands than it did: the
        # rank view pairs their operands one by one (log_softmax ends in a binary subtract)
        results = (*results[:-1], paddle.assign(results[-1]))
    for j, new in enumerate(results):
        old = serial.result(j)
        if not old.initialized():
            continue
        new.set_type(old.type())  # the local shape partition gave the op's result
        replace_uses(old, new)
        rp.replaced[(op.index, j)] = new
    rp.ops[op.index] = kernels.lookup_op or results[-1].get_defining_op()
    serial.erase()


class ProgramKernels:
    """The kernels of :mod:`autopar.spmd.vocab_parallel` as Paddle ops of one rank's program,
    inserted at the current insertion point; all_reduces as planned collectives."""

    def __init__(self, state: CompileState, rp: RankProgram, op: OpNode, split: SplitRow) -> None:
        required = state.propagation.op_results[op.index].inputs
        dist: DistAttr = required[split.operand]
        value = state.graph.values[op.inputs[split.operand]]
        bounds = dist.local_slices(value.shape, rp.rank)[split.axis]
        self.state, self.rp, self.op, self.split = state, rp, op, split
        self.start, self.stop = bounds.start, bounds.stop
        self.ndim, self.axis, self.label, self.dtype_name = len(value.shape), split.axis, value.label, value.dtype
        others = {d: k for attr in required if attr is not None for d, k in attr.partial if d not in split.mesh_dims}
        mapping = tuple(() if t == split.axis else dims for t, dims in enumerate(dist.mapping))
        self.row_mapping, self.others, self.mesh = mapping, others, dist.mesh
        self.row_shape = tuple(1 if t == split.axis else n for t, n in enumerate(value.shape))
        self.count = 0
        self.lookup_op: Any = None  # the local embedding / embedding_grad op, if the rewrite has one

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(self, x: Any, reduce: str, what: str) -> Any:
        src = DistAttr.of(self.mesh, self.row_mapping, {**self.others, **{d: reduce for d in self.split.mesh_dims}})
        dst = DistAttr.of(self.mesh, self.row_mapping, self.others)
        how = f"all_reduce[{reduce}] of the {what}, one value per row"
        return self._move(x, src, dst, self.row_shape, what, how)

    def all_gather_rows(self, xs: list[Any], what: str) -> list[Any]:
        """The ``xs`` (row tensors) of every rank of the group, in one all_gather along the split
        axis: one tensor per x with the group's values along that axis, in group order."""
        import paddle

        count, ranks = len(xs), math.prod(self.mesh.shape[d] for d in self.split.mesh_dims)
        split = tuple(tuple(self.split.mesh_dims) if t == self.axis else dims for t, dims in enumerate(self.row_mapping))
        src = DistAttr.of(self.mesh, split, self.others)
        dst = DistAttr.of(self.mesh, self.row_mapping, self.others)
        shape = tuple(count * ranks if t == self.axis else n for t, n in enumerate(self.row_shape))
        how = f"all_gather of each rank's {what} ({count} values per row)"
        gathered = self._move(paddle.concat(xs, axis=self.axis), src, dst, shape, what, how)
        return [paddle.strided_slice(gathered, [self.axis], [j], [count * ranks], [count]) for j in range(count)]

    def _move(self, x: Any, src: DistAttr, dst: DistAttr, shape: tuple[int, ...], what: str, how: str) -> Any:
        """``x`` (a per-row tensor of global ``shape``) moved ``src -> dst`` by its planned reshard."""
        plan = plan_reshard(src, dst, shape, self.dtype_name, self.state.cluster)
        names = "/".join(self.mesh.dim_names[d] for d in self.split.mesh_dims)
        row = RowValue(f"{self.label}.{what.replace(' ', '_').replace(',', '')}", shape, self.dtype_name)
        head = self.split.op.startswith("cross_entropy")
        dim = "class axis" if head else "normalized axis"
        feature = "vocabulary-parallel cross-entropy" if head else f"{self.split.op} over a split axis"
        graph = self.state.graph
        layer = layer_of(graph, self.op.index) or value_layer(graph, self.op.inputs[self.split.operand])
        reason = (
            f"{in_layer(feature, layer)}: {self.op} reads {self.label} with its {dim} split over {names}: "
            f"{how} instead of gathering the row"
        )
        for step in plan.steps:
            x = emit_step(self.state, self.rp, step, x, row, reason, CollectiveKey("vocab", self.op.index, self.count))
            self.count += 1
        return x

    def finite_or_zero(self, x: Any) -> Any:
        import paddle

        return paddle.where(paddle.isfinite(x), x, paddle.zeros_like(x))

    # ---- rows ----------------------------------------------------------------------------
    def row_max(self, x: Any) -> Any:
        import paddle

        return paddle.max(x, axis=self.axis, keepdim=True)

    def row_sum(self, x: Any) -> Any:
        import paddle

        return paddle.sum(x, axis=self.axis, keepdim=True)

    def _label(self, label: Any) -> Any:
        """A hard label with the class axis (size 1) where it lacks it."""
        import paddle

        return label if len(label.shape) == self.ndim else paddle.unsqueeze(label, [self.axis])

    def hits(self, label: Any) -> Any:
        """1.0 where the global class of a local column is the row's label."""
        import paddle

        shape = [1] * self.ndim
        shape[self.axis] = self.stop - self.start
        classes = paddle.reshape(paddle.arange(self.start, self.stop, 1, dtype=label.dtype), shape)
        return paddle.cast(paddle.equal(self._label(label), classes), self.dtype)

    def picked(self, x: Any, label: Any) -> Any:
        """The row's ``x`` at the label's class (0 where this rank holds no such class; not a
        product with the hits: a masked -inf logit times 0 is NaN)."""
        import paddle

        hit = paddle.greater_than(self.hits(label), paddle.zeros([], self.dtype))
        return self.row_sum(paddle.where(hit, x, paddle.zeros_like(x)))

    def kept(self, label: Any, ignore_index: int) -> Any:
        import paddle

        label = self._label(label)
        return paddle.cast(paddle.not_equal(label, paddle.full([], ignore_index, label.dtype)), self.dtype)

    @property
    def dtype(self) -> Any:
        import paddle

        return getattr(paddle, self.dtype_name)

    # ---- table rows ------------------------------------------------------------------------
    def rows(self, ids: Any) -> tuple[Any, Any]:
        import paddle

        start, stop = paddle.full([], self.start, ids.dtype), paddle.full([], self.stop, ids.dtype)
        inside = paddle.logical_and(paddle.greater_equal(ids, start), paddle.less_than(ids, stop))
        local = paddle.where(inside, paddle.subtract(ids, start), paddle.zeros_like(ids))
        return local, paddle.unsqueeze(paddle.cast(inside, self.dtype), [-1])

    def lookup(self, ids: Any, weight: Any, padding_idx: int) -> Any:
        import paddle

        out = paddle._C_ops.embedding(ids, weight, local_padding(int(padding_idx), self.start, self.stop), False)
        self.lookup_op = out.get_defining_op()
        return out

    def lookup_grad(self, ids: Any, weight: Any, out_grad: Any, padding_idx: int) -> Any:
        import paddle

        grad = paddle._C_ops.embedding_grad(
            ids, weight, out_grad, local_padding(int(padding_idx), self.start, self.stop), False
        )
        self.lookup_op = grad.get_defining_op()
        return grad

    # ---- elementwise -----------------------------------------------------------------------
    def exp(self, x: Any) -> Any:
        import paddle

        return paddle.exp(x)

    def log(self, x: Any) -> Any:
        import paddle

        return paddle.log(x)

    def subtract(self, x: Any, y: Any) -> Any:
        import paddle

        return paddle.subtract(x, y)

    def multiply(self, x: Any, y: Any) -> Any:
        import paddle

        return paddle.multiply(x, y)

    def divide(self, x: Any, y: Any) -> Any:
        import paddle

        return paddle.divide(x, y)
