"""Ops that work along one axis: flip, roll, index_select / gather, one_hot, and their grads
(stage: propagate). Each is one equation (:class:`~autopar.spmd.equations.EinsumRule`): the
axis they work along is whole (a piece of it cannot be reversed, rolled or indexed alone),
every other dim keeps its split. flip, roll and the selections are linear in their tensor, so
a pending sum passes through. (cumsum keeps even its scanned dim's split, with a carry between
the shards: :mod:`autopar.spmd.scan`.)

    flip / roll            a1c -> a1c          (no axis: every dim whole)
    index_select / gather  1b,1 -> 1b          (x, index: the axis and the index whole)
    one_hot                ab -> ab1           (the new class dim whole)
    *_grad                 the same letters, the incoming gradient's pending sum kept
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import axes_attr, letters
from autopar.spmd.registry import register_rule


def _along(ndim: int, attrs: Mapping[str, Any], everything: bool = False) -> str:
    """``ndim`` letters with the ``axis`` attribute's dims whole (all of them: ``everything``)."""
    axes = range(ndim) if everything or not _axes(attrs, ndim) else _axes(attrs, ndim)
    return letters(ndim, whole=axes)


def _axes(attrs: Mapping[str, Any], ndim: int) -> list[int]:
    return axes_attr(attrs, "axis", ndim) if attrs.get("axis") not in (None, []) else []


def _flip(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """flip: ``a1c -> a1c``."""
    names = _along(inputs[0].ndim, attrs)
    return f"{names}->{names}"


def _roll(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """roll with no axis rolls the flattened tensor: every dim whole."""
    names = _along(inputs[0].ndim, attrs, everything=not _axes(attrs, inputs[0].ndim))
    return f"{names}->{names}"


def _roll_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    names = _roll(inputs[:1], attrs).split("->")[0]
    return [names, names]


def _select(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """index_select / gather: ``(x, index) -> out``, the axis and the index whole."""
    names = letters(inputs[0].ndim, whole=_axes(attrs, inputs[0].ndim) or [0])
    return equation([names, "1" * inputs[1].ndim], [names])


def _select_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, index, out_grad) -> x_grad``."""
    names = letters(inputs[0].ndim, whole=_axes(attrs, inputs[0].ndim) or [0])
    return [names, "1" * inputs[1].ndim, names]


def _one_hot(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    names = letters(inputs[0].ndim)
    return f"{names}->{names}1"


register_rule(EinsumRule(_flip, linearity="multi", tensors=1), "flip")
register_rule(EinsumRule(_roll, linearity="multi", tensors=1), "roll")
register_rule(EquationGradRule(_roll_letters, grad=1, tensors=2), "roll_grad")
register_rule(EinsumRule(_select, linearity="multi", tensors=2), "index_select", "gather")
register_rule(EquationGradRule(_select_grad_letters, grad=2, tensors=3), "index_select_grad", "gather_grad")
register_rule(EinsumRule(_one_hot, tensors=1), "one_hot")
