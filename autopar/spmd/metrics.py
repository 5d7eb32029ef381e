"""topk (and its grad) and accuracy (stage: propagate).

    topk       a1 -> a1,a1          (axis whole; values and indices lie like x)
    topk_grad  a1,a1,a1 -> a1       (x, indices, out_grad -> x_grad)
    accuracy   n1,n1,n1 -> ,,       (values, indices, label -> accuracy, correct, total)

topk is not linear: its input is required complete. accuracy's outputs are scalars. A batch
split is kept only when it is even (the batch size divisible by the number of parts): then
each rank's ``correct`` and ``total`` are pieces of a sum (P(sum)) and its ``accuracy``
(= local correct / local total, all local totals equal) a piece of an average (P(avg)).
An uneven batch split would need accuracy weighted by n_local / n (one scale for all three
outputs cannot do it: correct and total must not be scaled), so it is required whole.
The top-k dim stays whole (a row is correct when any of its k indices hits the label).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import RuleResult, SpmdRule, TensorSpec, merge_letters
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.operands import axis_whole_letters
from autopar.spmd.registry import register, register_rule


def _topk(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x, k) -> (out, indices)``: ``a1 -> a1,a1``."""
    names = axis_whole_letters(inputs[0].ndim, attrs)
    return f"{names}->{names},{names}"


def _topk_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, indices, out_grad, k) -> x_grad``: ``a1,a1,a1 -> a1``; out_grad partials pass."""
    return [axis_whole_letters(inputs[0].ndim, attrs)] * 3


register_rule(EinsumRule(_topk, tensors=1), "topk")
register_rule(EquationGradRule(_topk_grad_letters, grad=2, tensors=3, shape_only=()), "topk_grad")


@register("accuracy")
class AccuracyRule(SpmdRule):
    """``(x, indices, label) -> (accuracy, correct, total)``: ``n1,n1,n1 -> ,,`` (even batch splits).
    Not data: an uneven batch split is dropped, and accuracy is P(avg) beside P(sum) counts."""

    def infer_forward(self, inputs, attrs, ctx):
        mesh = ctx.mesh
        specs = list(inputs[:3])
        merged, conflicts = merge_letters(["n" + "1" * (s.ndim - 1) for s in specs], specs, ctx)
        dims = merged.get("n", ())
        if dims and specs[0].shape[0] % math.prod(mesh.shape[d] for d in dims):
            dims = ()  # uneven: the accuracy average would be mis-weighted
        required = tuple(DistAttr.of(mesh, (dims,) + ((),) * (s.ndim - 1)) for s in specs)
        outputs = (
            DistAttr.of(mesh, (), {d: "avg" for d in dims}),
            DistAttr.of(mesh, (), {d: "sum" for d in dims}),
            DistAttr.of(mesh, (), {d: "sum" for d in dims}),
        )
        return RuleResult(required, outputs, tuple(conflicts))

    def infer_backward(self, inputs, outputs, attrs, ctx):
        """Scalar outputs say nothing about the batch: the inputs decide."""
        return self.infer_forward(inputs, attrs, ctx)
