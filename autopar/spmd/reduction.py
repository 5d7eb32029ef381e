"""Reductions with axis / keepdim: sum, mean, max, min and their grads (stage: propagate).

    sum   abc -> ac      (axis [1]; keepdim writes the reduced dim ``1``: abc -> a1c)

A split of a reduced dim leaves the output partial over its mesh dims: a pending sum for sum
and mean, a pending max / min for max / min. sum and mean are linear, so a partial input stays
partial (its pending sum commutes with the reduction) instead of being reduced first.

mean over a split dim is the one kernel whose local result is not the right piece: each rank
divides by its own element count. :meth:`MeanRule.local_scale` gives the factor
``n_local / n_global`` the partition pass multiplies in, which also makes uneven splits exact.
mean_grad divides by the local count in the same way and gets the same factor.

Grads (``x, out_grad -> x_grad``, max/min also read ``out``) broadcast the output gradient
back over the reduced dims; they are linear in ``out_grad``, so its partials pass through.
sum_grad / mean_grad read ``x`` for its shape only: the rule takes x's own split and leaves
its pending sums pending. max_grad / min_grad share a row's gradient equally among tied
maxima, a count no shard can make alone: x's reduced dims are required whole there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import (
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    einsum_backward,
    einsum_forward,
    einsum_grad,
)
from autopar.spmd.operands import keep_pending, letters, spread
from autopar.spmd.registry import register_rule


def reduced_axes(ndim: int, attrs: Mapping[str, Any]) -> list[int]:
    """The reduced axes, normalized; an empty axis list (or ``reduce_all``) reduces every dim."""
    value = attrs.get("axis", [])
    axes = list(value) if isinstance(value, (list, tuple)) else [value]
    if attrs.get("reduce_all") or not axes:
        return list(range(ndim))
    return sorted({int(a) % ndim for a in axes}) if ndim else []


def reduction_letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of x and of the reduced output (``1`` for a kept reduced dim)."""
    x = letters(ndim)
    axes = set(reduced_axes(ndim, attrs))
    keep = bool(attrs.get("keepdim", False))
    out = "".join("1" if i in axes else c for i, c in enumerate(x) if keep or i not in axes)
    return x, out


def mean_scale(x: TensorSpec | None, attrs: Mapping[str, Any], rank: int) -> float:
    """``n_local / n_global`` over the reduced dims of ``x`` on ``rank`` (1.0 when none is split)."""
    if x is None or x.dist is None or not x.dist.sharded_mesh_dims():
        return 1.0
    axes = reduced_axes(x.ndim, attrs)
    total = math.prod(x.shape[a] for a in axes)
    if total == 0:
        return 1.0
    local = x.dist.local_shape(x.shape, rank)
    return math.prod(local[a] for a in axes) / total


class ReductionRule(SpmdRule):
    """``(x, axis) -> out``: ``abc -> ac``; split reduced dims make ``out`` partial (``kind``)."""

    def __init__(self, kind: str, linear: bool) -> None:
        self.kind = kind
        self.linearity = "multi" if linear else None

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, out = reduction_letters(inputs[0].ndim, attrs)
        result = einsum_forward(f"{x}->{out}", inputs[:1], ctx, linearity=self.linearity, reduce_kind=self.kind)
        return spread(result, [0], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        x, out = reduction_letters(inputs[0].ndim, attrs)
        return spread(einsum_backward(f"{x}->{out}", inputs[:1], outputs[:1], ctx), [0], inputs, ctx)


class MeanRule(ReductionRule):
    """sum's rule plus the ``n_local / n_global`` correction of the local mean."""

    def local_scale(self, inputs, attrs, rank):
        return mean_scale(inputs[0], attrs, rank)


class ReductionGradRule(SpmdRule):
    """``(x, [out,] out_grad, axis) -> x_grad``: ``abc,ac -> abc`` (``tensors`` operands are tensors)."""

    def __init__(self, tensors: int) -> None:
        self.tensors = tensors
        self.x_shape_only = tensors == 2  # sum / mean grads read x for its shape only

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, out = reduction_letters(inputs[0].ndim, attrs)
        if not self.x_shape_only:
            # max_grad shares a row's gradient among its tied maxima: it must see the whole row
            axes = reduced_axes(inputs[0].ndim, attrs)
            x = "".join("1" if i in axes else c for i, c in enumerate(x))
        operands = [x] + [out] * (self.tensors - 1)
        result = einsum_grad(",".join(operands) + f"->{x}", inputs[: self.tensors], ctx, grad_operands=[self.tensors - 1])
        if self.x_shape_only:
            result = keep_pending(result, inputs, [0])
        return spread(result, list(range(self.tensors)), inputs, ctx)


class MeanGradRule(ReductionGradRule):
    def local_scale(self, inputs, attrs, rank):
        return mean_scale(inputs[0], attrs, rank)


register_rule(ReductionRule("sum", linear=True), "sum")
register_rule(MeanRule("sum", linear=True), "mean")
register_rule(ReductionRule("max", linear=False), "max")
register_rule(ReductionRule("min", linear=False), "min")
register_rule(ReductionGradRule(tensors=2), "sum_grad")
register_rule(MeanGradRule(tensors=2), "mean_grad")
register_rule(ReductionGradRule(tensors=3), "max_grad", "min_grad")
