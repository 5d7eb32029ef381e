"""Checking rules that may keep a split row (vocabulary-parallel embedding, class-split
cross-entropy, softmax over a split axis) numerically.

Paddle's kernels are not the right local computation on a split row, so ``check_rule`` (which
runs the op's kernel on each rank's pieces) cannot check such placements. :func:`check_split_rule`
runs instead the decomposition the rewrite pass emits (:mod:`autopar.spmd.vocab_parallel`)
with :class:`RanksKernels` — every rank's pieces at once in numpy, all_reduces over each rank's
group — rebuilds each output from the placement the rule infers and compares it with the op
on the full tensors. Cases without a split row are ``check_rule``'s.
"""

import numpy as np
import paddle
from hypothesis import event
from hypothesis.errors import InvalidArgument
from paddle import _C_ops

from autopar.cost_model.planner import group_at
from autopar.pieces import REDUCERS, reduce_partials, scatter
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.vocab_parallel import decompose, local_padding, split_row
from autopar.testing import RuleCheck, RuleCheckError, check_rule, dygraph


class RanksKernels:
    """The kernels of :mod:`autopar.spmd.vocab_parallel` on ``{rank: piece}`` dicts."""

    def __init__(self, mesh, split, dist, shape):
        self.mesh, self.split, self.axis, self.ndim = mesh, split, split.axis, len(shape)
        bounds = {r: dist.local_slices(shape, r)[split.axis] for r in mesh.ranks}
        self.start = {r: b.start for r, b in bounds.items()}
        self.stop = {r: b.stop for r, b in bounds.items()}

    def _map(self, fn, *xs):
        return {r: fn(*(x[r] for x in xs)) for r in self.mesh.ranks}

    def all_reduce(self, x, reduce, what):
        groups = {r: group_at(self.mesh, r, self.split.mesh_dims) for r in self.mesh.ranks}
        return {r: REDUCERS[reduce](np.stack([x[g] for g in groups[r]]), axis=0).astype(x[r].dtype) for r in x}

    def all_gather_rows(self, xs, what):
        groups = {r: group_at(self.mesh, r, self.split.mesh_dims) for r in self.mesh.ranks}
        return [{r: np.concatenate([x[g] for g in groups[r]], axis=self.axis) for r in x} for x in xs]

    def finite_or_zero(self, x):
        return self._map(lambda a: np.where(np.isfinite(a), a, 0).astype(a.dtype), x)

    def row_max(self, x):
        return self._map(lambda a: a.max(axis=self.axis, keepdims=True), x)

    def row_sum(self, x):
        return self._map(lambda a: a.sum(axis=self.axis, keepdims=True, dtype=a.dtype), x)

    def exp(self, x):
        return self._map(np.exp, x)

    def log(self, x):
        return self._map(np.log, x)

    def subtract(self, x, y):
        return self._map(np.subtract, x, y)

    def multiply(self, x, y):
        return self._map(np.multiply, x, y)

    def divide(self, x, y):
        return self._map(np.divide, x, y)

    def _label(self, label):
        return label if label.ndim == self.ndim else np.expand_dims(label, self.axis)

    def hits(self, label):
        def one(r, lab):
            shape = [1] * self.ndim
            shape[self.axis] = self.stop[r] - self.start[r]
            classes = np.arange(self.start[r], self.stop[r]).reshape(shape)
            return (self._label(lab) == classes).astype("float32")

        return {r: one(r, label[r]) for r in self.mesh.ranks}

    def picked(self, x, label):
        hits = self.hits(label)
        return self._map(lambda a, h: np.where(h > 0, a, 0).sum(axis=self.axis, keepdims=True, dtype=a.dtype), x, hits)

    def kept(self, label, ignore_index):
        return self._map(lambda lab: (self._label(lab) != ignore_index).astype("float32"), label)

    def rows(self, ids):
        inside = {r: (ids[r] >= self.start[r]) & (ids[r] < self.stop[r]) for r in self.mesh.ranks}
        local = {r: np.where(inside[r], ids[r] - self.start[r], 0) for r in self.mesh.ranks}
        return local, {r: inside[r].astype("float32")[..., None] for r in self.mesh.ranks}

    def lookup(self, ids, weight, padding_idx):
        with dygraph():
            return {
                r: _C_ops.embedding(
                    paddle.to_tensor(ids[r]), paddle.to_tensor(weight[r]), self._padding(r, padding_idx), False
                ).numpy()
                for r in self.mesh.ranks
            }

    def lookup_grad(self, ids, weight, out_grad, padding_idx):
        with dygraph():
            return {
                r: _C_ops.embedding_grad(
                    *map(paddle.to_tensor, (ids[r], weight[r], out_grad[r])), self._padding(r, padding_idx), False
                ).numpy()
                for r in self.mesh.ranks
            }

    def _padding(self, r, padding_idx):
        return local_padding(int(padding_idx), self.start[r], self.stop[r])


def check_split_rule(op_name, fn, inputs, dists, attrs=None, mesh=None, *, backward=None, rtol=1e-5, atol=1e-6, seed=0):
    """``check_rule`` for rules that may keep a split row: the decomposition stands in for the
    op's kernel on each rank (see the module docstring)."""
    attrs = dict(attrs or {})
    mesh = mesh or next(d.mesh for d in dists if d is not None)
    rule = get_rule(op_name)
    specs = [None if x is None else TensorSpec(tuple(x.shape), d, str(x.dtype)) for x, d in zip(inputs, dists)]
    ctx = RuleContext(mesh, op_name=op_name)
    expected = [np.asarray(o) for o in fn(list(inputs), attrs)]
    if backward is None:
        result = rule.infer_forward(specs, attrs, ctx)
    else:
        out_specs = [TensorSpec(tuple(e.shape), d, str(e.dtype)) for e, d in zip(expected, backward)]
        result = rule.infer_backward(specs, out_specs, attrs, ctx)
    split = split_row(op_name, attrs, result.inputs)
    _event("split row" if split is not None else "whole row (check_rule)")
    if split is None:
        return check_rule(op_name, fn, inputs, dists, attrs, mesh, backward=backward, seed=seed)
    rng = np.random.default_rng(seed)
    pieces = [scatter(x, d, rng) for x, d in zip(inputs, result.inputs)]
    kernels = RanksKernels(mesh, split, result.inputs[split.operand], inputs[split.operand].shape)
    outs = decompose(split, kernels, pieces, attrs)
    worst = 0.0
    for j, (want, dist) in enumerate(zip(expected, result.outputs)):
        for rank, got in reduce_partials(outs[j], dist).items():
            piece = want[dist.local_slices(want.shape, rank)]
            if got.shape != piece.shape:
                raise RuleCheckError(
                    f"{op_name}: output {j} on rank {rank} has shape {got.shape}, expected {piece.shape} for {dist}"
                )
            if piece.size and not np.allclose(got, piece, rtol=rtol, atol=atol):
                err = float(np.max(np.abs(got.astype("float64") - piece)))
                raise RuleCheckError(
                    f"{op_name}: output {j} on rank {rank} differs by {err:.3g} from the full op "
                    f"(inputs {[str(d) for d in result.inputs]} -> output {dist}, {split})"
                )
            worst = max(worst, float(np.max(np.abs(got.astype("float64") - piece), initial=0.0)))
    return RuleCheck(result, worst)


def _event(text):
    """A hypothesis statistics event (how many cases split a row); nothing outside a test."""
    try:
        event(text)
    except InvalidArgument:
        pass
