"""matmul and matmul_grad: ``...mk,...kn->...mn`` with transpose flags and batch broadcasting
(stage: propagate).

Splitting ``k`` (the contracted dim) leaves the output partial: row-parallel linear.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.registry import declare, register_rule


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


def _matmul_grad_letters(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, y, out_grad) -> (x_grad, y_grad)``: x_grad = out_grad·yᵀ, y_grad = xᵀ·out_grad."""
    return list(matmul_letters(specs[0].shape, specs[1].shape, attrs))


register_rule(EquationGradRule(_matmul_grad_letters, grad=2, results=(0, 1), shape_only=()), "matmul_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("matmul", keeps_split=True, matmul_like=True)
declare("matmul", "matmul_grad", contracts=True)
declare("matmul", "matmul_grad", cpu_twinned=("transpose_x", "transpose_y"))  # bf16 matmul_grad crashes, fp16 matmul has no CPU kernel
