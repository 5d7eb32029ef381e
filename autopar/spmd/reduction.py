"""Reductions with axis / keepdim: sum, mean, max, min and their grads (stage: propagate).

    sum   abc -> ac      (axis [1]; keepdim writes the reduced dim ``1``: abc -> a1c)
    argmax / argmin  a1c -> ac   (keepdims: a1c; flatten: every dim whole) the reduced axis whole:
                     an index found in a piece of a row is no index of the row; the others keep
                     their split (a router's argmax over experts stays split by token)

A split of a reduced dim leaves the output partial over its mesh dims: a pending sum for sum
and mean, a pending max / min for max / min. sum and mean are linear, so a partial input stays
partial (its pending sum commutes with the reduction) instead of being reduced first.

mean over a split dim is the one kernel whose local result is not the right piece: each rank
divides by its own element count. :func:`mean_scale` gives the factor
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

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.operands import axes_attr, letters
from autopar.spmd.registry import declare, register_rule


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


def _reduction(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x, axis) -> out``: ``abc -> ac``; split reduced dims make ``out`` partial."""
    x, out = reduction_letters(inputs[0].ndim, attrs)
    return f"{x}->{out}"


def _arg_reduction(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """argmax / argmin ``(x, axis) -> out``: ``a1c -> ac``; the axis whole, the others keep their split."""
    ndim = inputs[0].ndim
    axes = set(range(ndim) if attrs.get("flatten") else axes_attr(attrs, "axis", ndim))
    x = letters(ndim, whole=axes)
    out = "".join(c for i, c in enumerate(x) if i not in axes or attrs.get("keepdims"))
    return f"{x}->{out}"


def _shape_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """sum / mean grads ``(x, out_grad, axis) -> x_grad``: ``abc,ac -> abc``."""
    return list(reduction_letters(inputs[0].ndim, attrs))


def _tie_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """max / min grads ``(x, out, out_grad, axis) -> x_grad``: ``a1c,ac,ac -> a1c``; a row's
    gradient is shared among its tied maxima, so the kernel must see the whole row."""
    x, out = reduction_letters(inputs[0].ndim, attrs)
    axes = reduced_axes(inputs[0].ndim, attrs)
    return ["".join("1" if i in axes else c for i, c in enumerate(x)), out, out]


def _mean_scale(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], rank: int) -> float:
    return mean_scale(inputs[0], attrs, rank)


register_rule(EinsumRule(_reduction, linearity="multi", tensors=1), "sum")
register_rule(EinsumRule(_reduction, linearity="multi", tensors=1, scale=_mean_scale), "mean")
register_rule(EinsumRule(_reduction, reduce_kind="max", tensors=1), "max")
register_rule(EinsumRule(_reduction, reduce_kind="min", tensors=1), "min")
register_rule(EinsumRule(_arg_reduction, tensors=1), "argmax", "argmin")
register_rule(EquationGradRule(_shape_grad_letters, grad=1, tensors=2, shape_only=(0,)), "sum_grad")
register_rule(EquationGradRule(_shape_grad_letters, grad=1, tensors=2, shape_only=(0,), scale=_mean_scale), "mean_grad")
register_rule(EquationGradRule(_tie_grad_letters, grad=2, tensors=3, shape_only=()), "max_grad", "min_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("max", "mean", "min", normalizing=True)
declare("sum", norm_plumbing=True, normalizing=True)
declare("sum", "mean", "max", "min", zigzag_passes="reduces")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
