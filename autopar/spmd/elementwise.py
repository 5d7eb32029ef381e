"""Elementwise ops: binary with broadcasting, unary, and their grads (``ab,b->ab``).

Sharded dims must line up across operands; a broadcast dim of size 1 is never split, and its
gradient is partial over the mesh dims the broadcast dim's partner was split over.
add / subtract may take all operands partial alike; multiply / divide-by-whole may take one.
"""

from __future__ import annotations

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
from autopar.spmd.equations import EinsumRule
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.operands import keep_pending, letters, spread
from autopar.spmd.registry import register_rule


def broadcast_equation(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    operands, out = broadcast_letters([s.shape for s in specs])
    return equation(operands, [out])


class BroadcastGradRule(SpmdRule):
    """``(x, y, out_grad) -> (x_grad, y_grad)`` for a broadcasting binary op.

    add_grad / subtract_grad read x and y for their shapes only (``shape_only``): their
    pending sums are left pending.
    """

    def __init__(self, shape_only: bool = False) -> None:
        self.shape_only = shape_only

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        operands, out = broadcast_letters([inputs[0].shape, inputs[1].shape, inputs[-1].shape])
        letters = [operands[0], operands[1]] + [operands[2]] * (len(inputs) - 2)
        # extra grad-op operands (divide_grad reads out) share out's letters
        if len(inputs) == 4:
            letters = [operands[0], operands[1], out, out]
        result = einsum_grad(equation(letters, operands[:2]), inputs, ctx, grad_operands=[len(inputs) - 1])
        return keep_pending(result, inputs, [0, 1]) if self.shape_only else result


class SameShapeGradRule(SpmdRule):
    """Unary grads ``(x and/or out, out_grad, scalars...) -> x_grad``: the first ``tensors``
    operands have x's shape, out_grad last among them (silu_grad reads x and out: 3);
    scalar operands after them (clip_grad's min / max) stay whole."""

    def __init__(self, tensors: int = 2) -> None:
        self.tensors = tensors

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        tensors = list(range(self.tensors))
        names = letters(inputs[0].ndim)
        sub = [inputs[i] for i in tensors]
        result = einsum_grad(equation([names] * len(sub), [names]), sub, ctx, grad_operands=[len(sub) - 1])
        return spread(result, tensors, inputs, ctx)


class UnaryRule(SpmdRule):
    """``abc->abc``: output lies like the input; extra scalar operands stay whole."""

    def __init__(self, linearity: str | None = None) -> None:
        self.linearity = linearity

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        names = letters(inputs[0].ndim)
        result = einsum_forward(f"{names}->{names}", inputs[:1], ctx, linearity=self.linearity_for(attrs))
        return spread(result, [0], inputs, ctx)

    def linearity_for(self, attrs: Mapping[str, Any]) -> str | None:
        return self.linearity

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names = letters(inputs[0].ndim)
        result = einsum_backward(f"{names}->{names}", inputs[:1], outputs[:1], ctx)
        return spread(result, [0], inputs, ctx)


ADDITIVE = ("add", "subtract")
MULTILINEAR = ("multiply",)
NONLINEAR_BINARY = ("maximum", "minimum", "elementwise_pow", "greater_than", "less_than", "equal", "not_equal")
for _name in ADDITIVE:
    register_rule(EinsumRule(broadcast_equation, linearity="additive"), _name)
for _name in MULTILINEAR:
    register_rule(EinsumRule(broadcast_equation, linearity="multi"), _name)
for _name in NONLINEAR_BINARY:
    register_rule(EinsumRule(broadcast_equation), _name)
register_rule(EinsumRule(broadcast_equation, linearity="first"), "divide")  # a pending sum over a whole divisor stays pending
class DivideGradRule(BroadcastGradRule):
    """``(x, y, out, out_grad) -> (x_grad, y_grad)``: ``x_grad = out_grad / y``, ``y_grad =
    -out_grad * out / y``; x gives x_grad its shape only, and ``out`` is read only for a live
    y_grad: their pending sums are left pending (a loss ``sum / count`` whose sum is pending
    over micro-batches, the count whole)."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        result = super().infer_forward(inputs, attrs, ctx)
        y_grad_live = ctx.live_outputs is None or len(ctx.live_outputs) < 2 or ctx.live_outputs[1]
        return keep_pending(result, inputs, [0] if y_grad_live else [0, 2])


register_rule(BroadcastGradRule(shape_only=True), *(f"{n}_grad" for n in ADDITIVE))
register_rule(BroadcastGradRule(), *(f"{n}_grad" for n in MULTILINEAR + ("maximum", "minimum", "elementwise_pow")))
register_rule(DivideGradRule(), "divide_grad")


FLOAT_PRECISION = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53, "complex64": 24, "complex128": 53}


def float_precision(dtype: Any) -> int | None:
    """Mantissa bits of a float / complex dtype given in any of Paddle's spellings; None otherwise."""
    name = str(dtype).lower().rsplit(".", 1)[-1]
    return FLOAT_PRECISION.get(name)


class CastRule(SpmdRule):
    """``abc->abc``; linear (pending sums pass through) only into a float dtype at least as
    precise as the input: a cast to an integer or bool rounds each rank's piece, and rounded
    pieces do not sum to the rounded whole (nor, to float16, within float32 tolerance)."""

    def _unary(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> UnaryRule:
        target, source = float_precision(attrs.get("dtype", "")), float_precision(inputs[0].dtype)
        exact = target is not None and source is not None and target >= source
        return UnaryRule("multi" if exact else None)

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        return self._unary(inputs, attrs).infer_forward(inputs, attrs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        return self._unary(inputs, attrs).infer_backward(inputs, outputs, attrs, ctx)


register_rule(CastRule(), "cast")
LINEAR_UNARY = ("assign", "share_data", "neg")
NONLINEAR_UNARY = (
    "relu", "gelu", "tanh", "sigmoid", "exp", "sqrt", "rsqrt", "square", "log", "abs", "silu",
    "pow", "clip", "sin", "cos", "logical_not", "isfinite", "erf", "floor",
)  # fmt: skip
register_rule(UnaryRule(linearity="multi"), *LINEAR_UNARY)
register_rule(UnaryRule(), *NONLINEAR_UNARY)


class ScaleRule(UnaryRule):
    """``scale * x + bias``: linear in x when ``bias`` is 0 (``-x.mean()``, a loss scale: a
    pending sum stays pending), otherwise a pending sum is reduced first (the bias would be
    added once per piece)."""

    def linearity_for(self, attrs: Mapping[str, Any]) -> str | None:
        return "multi" if float(attrs.get("bias", 0.0)) == 0.0 else None


register_rule(ScaleRule(), "scale")
register_rule(
    SameShapeGradRule(),
    *(f"{n}_grad" for n in ("relu", "gelu", "tanh", "sigmoid", "exp", "sqrt", "rsqrt", "square", "log", "abs", "pow", "clip", "sin", "cos", "erf")),
)
register_rule(SameShapeGradRule(tensors=3), "silu_grad")


# add_n: ``ab,ab,... -> ab``; partial operands stay partial, and where two or more are partial the
# whole ones are made partial alike (a gradient summed from three column-parallel inputs and a
# residual: one all_reduce after, not three before). One partial operand is reduced before: the
# same count, and its sum does not carry a pending sum into ops that would move more bytes (a
# weight gradient larger than the activation)
register_rule(EinsumRule(broadcast_equation, linearity="alike", alike_from=2), "add_n")
