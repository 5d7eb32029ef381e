"""Norms and the ops of global-norm gradient clipping: squared_l2_norm, p_norm, stack,
unstack and their grads (stage: propagate).

    squared_l2_norm       ab -> 1              (x -> out [1]): a split dim makes out P(sum)
    squared_l2_norm_grad  ab,1 -> ab           (x, out_grad -> x_grad = 2·x·out_grad)
    p_norm                abc -> ac            (axis 1; ``asvector``: every dim; keepdim: a1c)
    p_norm_grad           abc,ac,ac -> abc     (x, out, out_grad -> x_grad)
    stack, unstack_grad   ab,ab,... -> a1b     (axis 1: the new dim is never split)
    unstack, stack_grad   a1b -> ab,ab,...     (stack_grad also reads x[0..n-1] for their shapes)

``paddle.nn.ClipGradByGlobalNorm`` adds, per gradient ``g``: ``squared_l2_norm(g)``; then
``stack`` of those scalars, ``sum``, ``sqrt``, ``maximum`` / ``divide`` with the clip norm,
and ``multiply(g, scale)`` before the optimizer. The squared norm of a tensor split over mesh
dim ``d`` is the sum of the pieces' squared norms: a pending sum over ``d`` (a scalar), reduced
once where ``sqrt`` needs it whole. A *partial* gradient (data parallelism) is not: the squared
norm of a sum is not the sum of squared norms, so ``x`` is required complete (the planner
all-reduces the gradient in front of the norm).

p_norm over a split dim: ``porder`` 0 (count of non-zeros) and 1 (sum of ``|x|``) are sums of
the pieces' results, ``inf`` / ``-inf`` their max / min (pending max / min); any other order
is ``(sum |x|^p)^(1/p)``, which no reduction of the pieces' results gives: the reduced dims
are required whole there. Paddle's rule makes every order a pending sum (correct only with a
kernel that reduces ``sum |x|^p`` before the root). Both grads are elementwise in ``x`` given
the whole norm broadcast over the reduced dims (p_norm_grad's kernel counts no ties), so ``x``
keeps any split; they are linear in ``out_grad``, whose pending sums pass through.

stack only moves data, so pending sums pass through. Where some operands are pending sums
over a mesh dim and the others are whole (tensor-parallel gradients' norms beside replicated
ones'), the whole operands are made partial (a local step: one rank of the group keeps its
copy, the others zero) and the stacked result stays one pending sum, reduced once later,
instead of one reduction per partial operand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import letters
from autopar.spmd.registry import declare, register_rule

# ---- squared_l2_norm ----------------------------------------------------------------------


def _squared_l2_norm(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``x -> out [1]``: ``ab -> 1``; split dims make out a pending sum, x required complete."""
    return f"{letters(inputs[0].ndim)}->1"


def _squared_l2_norm_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, out_grad) -> x_grad``: ``ab,1 -> ab``, linear in out_grad."""
    return [letters(inputs[0].ndim), "1" * inputs[1].ndim]


register_rule(EinsumRule(_squared_l2_norm, tensors=1), "squared_l2_norm")
register_rule(EquationGradRule(_squared_l2_norm_grad_letters, grad=1, tensors=2, shape_only=()), "squared_l2_norm_grad")


# ---- p_norm -------------------------------------------------------------------------------

# porder -> the reduction that combines the pieces' results (absent: not combinable)
P_NORM_KINDS = {0.0: "sum", 1.0: "sum", math.inf: "max", -math.inf: "min"}


def p_norm_axes(ndim: int, attrs: Mapping[str, Any]) -> list[int]:
    """The reduced dims: every dim for ``asvector``, else ``axis`` (normalized)."""
    if not ndim:
        return []
    if attrs.get("asvector", False):
        return list(range(ndim))
    return [int(attrs.get("axis", -1)) % ndim]


def p_norm_letters(ndim: int, attrs: Mapping[str, Any], whole_reduced: bool) -> tuple[str, str]:
    """Letters of x (reduced dims ``1`` when they must stay whole) and of out."""
    axes = set(p_norm_axes(ndim, attrs))
    x = letters(ndim, whole=axes if whole_reduced else ())
    keep = bool(attrs.get("keepdim", False))
    return x, "".join("1" if i in axes else c for i, c in enumerate(x) if keep or i not in axes)


def _p_norm_kind(attrs: Mapping[str, Any]) -> str | None:
    return P_NORM_KINDS.get(float(attrs.get("porder", 2.0)))


def _p_norm(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``x -> out``: ``abc -> ac`` (porder 0, 1: P(sum), inf: P(max), -inf: P(min) over a
    split reduced dim); ``a1c -> ac`` for any other porder."""
    x, out = p_norm_letters(inputs[0].ndim, attrs, whole_reduced=_p_norm_kind(attrs) is None)
    return f"{x}->{out}"


def _p_norm_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, out, out_grad) -> x_grad``: ``abc,ac,ac -> abc``; out whole, linear in out_grad."""
    x, out = p_norm_letters(inputs[0].ndim, attrs, whole_reduced=False)
    return [x, out, out]


register_rule(EinsumRule(_p_norm, reduce_kind=lambda inputs, attrs: _p_norm_kind(attrs), tensors=1), "p_norm")
register_rule(EquationGradRule(_p_norm_grad_letters, grad=2, tensors=3, shape_only=()), "p_norm_grad")


# ---- stack / unstack ----------------------------------------------------------------------


def _stacked_letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of one stacked tensor and of the stack (the new dim ``1``, at ``axis``)."""
    names = letters(ndim)
    axis = int(attrs.get("axis", 0)) % (ndim + 1)
    return names, names[:axis] + "1" + names[axis:]


def _stack_equation(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    names, stacked = _stacked_letters(inputs[0].ndim, attrs)
    return equation([names] * len(inputs), [stacked])


# stack ``(x[0], ..., x[n-1]) -> out``: ``ab,ab -> a1b``, pending sums stay pending, whole
# operands made pending alike; unstack_grad reads ``(out_grad[0..n-1])`` and is the same op
register_rule(EinsumRule(_stack_equation, linearity="alike"), "stack", "unstack_grad")


def _unstack_count(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], axis: int) -> int:
    return int(attrs.get("num") or inputs[0].shape[axis])


def _unstack(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``x -> out[0..n-1]``: ``a1b -> ab,ab,...`` (the unstacked axis whole)."""
    ndim = inputs[0].ndim
    axis = int(attrs.get("axis", 0)) % ndim
    names = letters(ndim, whole=[axis])
    return equation([names], [names[:axis] + names[axis + 1 :]] * _unstack_count(inputs, attrs, axis))


def _stack_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x[0..n-1], out_grad) -> x_grad[0..n-1]``: ``ab,...,ab,a1b -> ab,...``; x read for
    its shape only (its pending sums stay pending), linear in out_grad."""
    names, stacked = _stacked_letters(inputs[0].ndim, attrs)
    return [names] * (len(inputs) - 1) + [stacked]


register_rule(EinsumRule(_unstack, linearity="multi", tensors=1), "unstack")
register_rule(EquationGradRule(_stack_grad_letters, grad=-1, results=None), "stack_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("p_norm", "squared_l2_norm", global_norm=True, normalizing=True)
declare("stack", keeps_split=True, norm_plumbing=True)
