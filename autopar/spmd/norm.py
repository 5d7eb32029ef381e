"""layer_norm and layer_norm_grad (stage: propagate).

    layer_norm       ab11,1,1 -> ab11,ab,ab      (x, scale, bias -> out, mean, variance)
    layer_norm_grad  ab11,1,1,ab,ab,ab11 -> ab11,1,1

Dims from ``begin_norm_axis`` on are normalized together: they stay whole, as do scale and
bias (one flat vector over them). The leading dims keep their split, so batch and sequence
parallelism need no communication in the forward pass; scale_grad and bias_grad are sums over
the leading dims and come out partial over their mesh dims (the data-parallel gradient sum).
layer_norm is not linear (x must be complete); its grad is linear in out_grad. Absent scale /
bias (``weight_attr=False``) are ``None`` operands and give ``None`` gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import letters
from autopar.spmd.registry import declare, register_rule


def _x_letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of x (normalized dims whole) and of mean / variance (the leading dims)."""
    begin = int(attrs.get("begin_norm_axis", ndim - 1)) % max(ndim, 1)
    return letters(ndim, whole=range(begin, ndim)), letters(begin)


def _layer_norm(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(x, scale, bias) -> (out, mean, variance)``: ``ab1,1,1 -> ab1,ab,ab`` (absent scale /
    bias left out)."""
    x, lead = _x_letters(inputs[0].ndim, attrs)
    present = [names for names, spec in zip((x, "1", "1"), inputs) if spec is not None]
    return equation(present, [x, lead, lead])


def _layer_norm_grad_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, scale, bias, mean, variance, out_grad) -> (x_grad, scale_grad, bias_grad)``."""
    x, lead = _x_letters(inputs[0].ndim, attrs)
    return [x, "1", "1", lead, lead, x]


register_rule(EinsumRule(_layer_norm), "layer_norm")
register_rule(EquationGradRule(_layer_norm_grad_letters, grad=5, results=(0, 1, 2), shape_only=()), "layer_norm_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("layer_norm", normalizing=True, sequence_local=True)
