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
from dataclasses import replace
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
from autopar.spmd.operands import letters, spread
from autopar.spmd.registry import register


def _x_letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of x (normalized dims whole) and of mean / variance (the leading dims)."""
    begin = int(attrs.get("begin_norm_axis", ndim - 1)) % max(ndim, 1)
    return letters(ndim, whole=range(begin, ndim)), letters(begin)


def _present(specs: Sequence[TensorSpec | None], names: Sequence[str]) -> tuple[list[int], list[str]]:
    kept = [i for i, s in enumerate(specs) if s is not None]
    return kept, [names[i] for i in kept]


@register("layer_norm")
class LayerNormRule(SpmdRule):
    """``(x, scale, bias) -> (out, mean, variance)``: ``ab1,1,1 -> ab1,ab,ab``."""

    def _equation(self, inputs, attrs) -> tuple[list[int], str]:
        x, lead = _x_letters(inputs[0].ndim, attrs)
        kept, names = _present(inputs, [x, "1", "1"])
        return kept, ",".join(names) + f"->{x},{lead},{lead}"

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        kept, eq = self._equation(inputs, attrs)
        return spread(einsum_forward(eq, [inputs[i] for i in kept], ctx), kept, inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        kept, eq = self._equation(inputs, attrs)
        return spread(einsum_backward(eq, [inputs[i] for i in kept], outputs, ctx), kept, inputs, ctx)


@register("layer_norm_grad")
class LayerNormGradRule(SpmdRule):
    """``(x, scale, bias, mean, variance, out_grad) -> (x_grad, scale_grad, bias_grad)``."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, lead = _x_letters(inputs[0].ndim, attrs)
        kept, names = _present(inputs, [x, "1", "1", lead, lead, x])
        grads = [x] + [n for i, n in zip((1, 2), ("1", "1")) if inputs[i] is not None]
        eq = ",".join(names) + "->" + ",".join(grads)
        result = einsum_grad(eq, [inputs[i] for i in kept], ctx, grad_operands=[len(kept) - 1])
        produced = iter(result.outputs)
        outputs = [next(produced)] + [next(produced) if inputs[i] is not None else None for i in (1, 2)]
        return replace(spread(result, kept, inputs, ctx), outputs=tuple(outputs))
