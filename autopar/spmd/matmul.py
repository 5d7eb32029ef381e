"""matmul and matmul_grad: ``...mk,...kn->...mn`` with transpose flags and batch broadcasting.

Splitting ``k`` (the contracted dim) leaves the output partial: row-parallel linear.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import EinsumRule, RuleContext, RuleResult, SpmdRule, TensorSpec, einsum_grad
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.registry import register, register_rule


def matmul_letters(x_shape: Sequence[int], y_shape: Sequence[int], attrs: Mapping[str, Any]) -> tuple[str, str, str]:
    """Letters of x, y and out; ``m``, ``k``, ``n`` name the matrix dims, the rest are batch."""
    x_batch, y_batch = list(x_shape[:-2]), list(y_shape[:-2])
    (xb, yb), batch = broadcast_letters([x_batch, y_batch], taken="mkn")
    x_mat = "k" if len(x_shape) == 1 else ("km" if attrs.get("transpose_x") else "mk")
    y_mat = "k" if len(y_shape) == 1 else ("nk" if attrs.get("transpose_y") else "kn")
    out = batch + ("m" if len(x_shape) > 1 else "") + ("n" if len(y_shape) > 1 else "")
    return xb + x_mat, yb + y_mat, out


def _matmul_equation(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    x, y, out = matmul_letters(specs[0].shape, specs[1].shape, attrs)
    return equation([x, y], [out])


register_rule(EinsumRule(_matmul_equation, linearity="multi"), "matmul")


@register("matmul_grad")
class MatmulGradRule(SpmdRule):
    """``(x, y, out_grad) -> (x_grad, y_grad)``: x_grad = out_grad·yᵀ, y_grad = xᵀ·out_grad."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, y, out = matmul_letters(inputs[0].shape, inputs[1].shape, attrs)
        return einsum_grad(equation([x, y, out], [x, y]), inputs, ctx, grad_operands=[2])
