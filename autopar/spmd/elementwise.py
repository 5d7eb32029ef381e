"""Elementwise ops: binary with broadcasting, unary, and their grads (``ab,b->ab``).

Sharded dims must line up across operands; a broadcast dim of size 1 is never split, and its
gradient is partial over the mesh dims the broadcast dim's partner was split over.
add / subtract may take all operands partial alike; multiply / divide-by-whole may take one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import RuleContext, RuleResult, TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.operands import keep_pending, letters
from autopar.spmd.registry import declare, register_rule


def broadcast_equation(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    operands, out = broadcast_letters([s.shape for s in specs])
    return equation(operands, [out])


def same_equation(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """Unary ``abc -> abc``: the output lies like the input (scalar operands after it whole)."""
    names = letters(specs[0].ndim)
    return f"{names}->{names}"


def _broadcast_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, y, out_grad) -> (x_grad, y_grad)`` for a broadcasting binary op; divide_grad's
    ``(x, y, out, out_grad)``: out shares out_grad's letters."""
    operands, out = broadcast_letters([inputs[0].shape, inputs[1].shape, inputs[-1].shape])
    if len(inputs) == 4:
        return [operands[0], operands[1], out, out]
    return [operands[0], operands[1]] + [operands[2]] * (len(inputs) - 2)


def _same_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """Unary grads ``(x and/or out, out_grad, scalars...) -> x_grad``: the tensor operands have
    x's shape, out_grad last among them."""
    return [letters(inputs[0].ndim)] * len(inputs)


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
class DivideGradRule(EquationGradRule):
    """``(x, y, out, out_grad) -> (x_grad, y_grad)``: ``x_grad = out_grad / y``, ``y_grad =
    -out_grad * out / y``; x gives x_grad its shape only, and ``out`` is read only for a live
    y_grad: their pending sums are left pending (a loss ``sum / count`` whose sum is pending
    over micro-batches, the count whole). A class only because which operands are read for
    their shape depends on which gradients are live."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        result = super().infer_forward(inputs, attrs, ctx)
        y_grad_live = ctx.live_outputs is None or len(ctx.live_outputs) < 2 or ctx.live_outputs[1]
        return keep_pending(result, inputs, [0] if y_grad_live else [0, 2])


class MultiplyGradRule(EquationGradRule):
    """``(x, y, out_grad) -> (x_grad, y_grad)``: ``x_grad = out_grad * y``, ``y_grad = out_grad
    * x``; an operand read only for a dead gradient gives the other its shape only: its pending
    sums are left pending (a loss scaled by dynamic loss scaling, ``multiply(loss, scale)``,
    whose scale takes no gradient: the loss of one micro-batch, or of one data-parallel rank, is
    not reduced for it)."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        result = super().infer_forward(inputs, attrs, ctx)
        live = ctx.live_outputs
        dead = [operand for operand, grad in ((0, 1), (1, 0)) if live is not None and len(live) > grad and not live[grad]]
        return keep_pending(result, inputs, dead)


register_rule(EquationGradRule(_broadcast_grad_letters, grad=-1, results=(0, 1), shape_only=(0, 1)), *(f"{n}_grad" for n in ADDITIVE))
register_rule(MultiplyGradRule(_broadcast_grad_letters, grad=-1, results=(0, 1), shape_only=()), *(f"{n}_grad" for n in MULTILINEAR))
register_rule(
    EquationGradRule(_broadcast_grad_letters, grad=-1, results=(0, 1), shape_only=()),
    *(f"{n}_grad" for n in ("maximum", "minimum", "elementwise_pow")),
)
register_rule(DivideGradRule(_broadcast_grad_letters, grad=-1, results=(0, 1), shape_only=()), "divide_grad")


FLOAT_PRECISION = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53, "complex64": 24, "complex128": 53}


def float_precision(dtype: Any) -> int | None:
    """Mantissa bits of a float / complex dtype given in any of Paddle's spellings; None otherwise."""
    name = str(dtype).lower().rsplit(".", 1)[-1]
    return FLOAT_PRECISION.get(name)


def _cast_linearity(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str | None:
    """Linear (pending sums pass through) only into a float dtype at least as precise as the
    input: a cast to an integer or bool rounds each rank's piece, and rounded pieces do not sum
    to the rounded whole (nor, to float16, within float32 tolerance)."""
    target, source = float_precision(attrs.get("dtype", "")), float_precision(inputs[0].dtype)
    return "multi" if target is not None and source is not None and target >= source else None


def _scale_linearity(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str | None:
    """``scale * x + bias``: linear in x when ``bias`` is 0 (``-x.mean()``, a loss scale: a
    pending sum stays pending), otherwise a pending sum is reduced first (the bias would be
    added once per piece)."""
    return "multi" if float(attrs.get("bias", 0.0)) == 0.0 else None


register_rule(EinsumRule(same_equation, linearity=_cast_linearity, tensors=1), "cast")
declare("cast", cpu_float16=True)  # casts both ways between float16 and float32 on CPU
LINEAR_UNARY = ("assign", "share_data", "neg")
NONLINEAR_UNARY = (
    "relu", "gelu", "tanh", "sigmoid", "exp", "sqrt", "rsqrt", "square", "log", "abs", "silu",
    "pow", "clip", "sin", "cos", "logical_not", "isfinite", "erf", "floor",
)  # fmt: skip
register_rule(EinsumRule(same_equation, linearity="multi", tensors=1), *LINEAR_UNARY)
register_rule(EinsumRule(same_equation, tensors=1), *NONLINEAR_UNARY)
register_rule(EinsumRule(same_equation, linearity=_scale_linearity, tensors=1), "scale")
register_rule(
    EquationGradRule(_same_grad_letters, grad=-1, tensors=2, shape_only=()),
    *(f"{n}_grad" for n in ("relu", "gelu", "tanh", "sigmoid", "exp", "sqrt", "rsqrt", "square", "log", "abs", "pow", "clip", "sin", "cos", "erf")),
)
register_rule(EquationGradRule(_same_grad_letters, grad=-1, tensors=3, shape_only=()), "silu_grad")


# add_n: ``ab,ab,... -> ab``; partial operands stay partial, and where two or more are partial the
# whole ones are made partial alike (a gradient summed from three column-parallel inputs and a
# residual: one all_reduce after, not three before). One partial operand is reduced before: the
# same count, and its sum does not carry a pending sum into ops that would move more bytes (a
# weight gradient larger than the activation)
register_rule(EinsumRule(broadcast_equation, linearity="alike", alike_from=2), "add_n")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
# measured: this CPU build's bf16 add_grad of a square [n, n] input with an [n] bias returns the
# row sums as the bias gradient (fp32 is right); the numerics twin runs it in fp32 on the rounded inputs
declare("add_grad", cpu_twinned=("axis",))
declare("abs", "elementwise_pow", "pow", keeps_split=True, to_loss=True)
declare("add", flops_per_element=1, keeps_split=True, norm_plumbing=True, sequence_local=True, to_loss=True)
declare("add_", "divide_", "multiply_", "scale_", "subtract_", sequence_local=True)
declare("add_n", norm_plumbing=True, sequence_local=True)
declare("assign", flops_per_element=0, keeps_split=True, passes_ids=True)
declare(
    "cast",
    flops_per_element=0, keeps_split=True, norm_plumbing=True, passes_ids=True, rescales=True, sequence_local=True, to_loss=True,
)
declare("cos", "equal", "greater_than", "less_than", "logical_not", "not_equal", "rsqrt", "sin", keeps_split=True)
declare(
    "divide",
    flops_per_element=1, keeps_split=True, norm_plumbing=True, rescales=True, sequence_local=True, to_loss=True,
)
declare("exp", "minimum", flops_per_element=1, keeps_split=True)
declare("gelu", flops_per_element=8, keeps_split=True, sequence_local=True)
declare("maximum", "sqrt", flops_per_element=1, keeps_split=True, norm_plumbing=True)
declare("multiply", flops_per_element=1, keeps_split=True, rescales=True, sequence_local=True, to_loss=True)
declare("relu", flops_per_element=1, keeps_split=True, sequence_local=True)
declare(
    "scale",
    flops_per_element=2, keeps_split=True, norm_plumbing=True, rescales=True, sequence_local=True, to_loss=True,
)
declare("sigmoid", flops_per_element=4, keeps_split=True, sequence_local=True, to_loss=True)
declare("silu", flops_per_element=5, keeps_split=True, sequence_local=True)
declare("square", flops_per_element=1, keeps_split=True, to_loss=True)
declare("subtract", flops_per_element=1, keeps_split=True, sequence_local=True, to_loss=True)
declare("tanh", flops_per_element=4, keeps_split=True, sequence_local=True)
declare("assign", zigzag_passes="in_place")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
