"""softmax, log_softmax, cross_entropy_with_softmax and their grads (stage: propagate).

    softmax                      ab1 -> ab1            (axis whole: a row's max and sum need all of it)
    cross_entropy_with_softmax   ab1,ab1 -> ab1,ab1    (logits, label -> softmax, loss)
    cross_entropy_with_softmax_grad  ab1,ab1,ab1 -> ab1  (label, softmax, loss_grad -> logits_grad)

The normalized (class) axis is required whole, so class-sharded logits are gathered first:
Paddle's fused kernel cannot finish a split row, and a vocab-parallel cross-entropy (local
max / sum-exp plus two all-reduces) is a decomposition the partition pass does not do yet.
Every other dim keeps its split. None of the forward ops is linear (inputs must be complete);
every grad is linear in the incoming gradient, so its partials pass through.
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
from autopar.spmd.operands import axis_attr, axis_whole_letters, letters
from autopar.spmd.registry import register, register_rule


class SoftmaxRule(SpmdRule):
    """``x -> out``: ``ab1 -> ab1``."""

    def infer_forward(self, inputs, attrs, ctx):
        names = axis_whole_letters(inputs[0].ndim, attrs)
        return einsum_forward(f"{names}->{names}", inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names = axis_whole_letters(inputs[0].ndim, attrs)
        return einsum_backward(f"{names}->{names}", inputs, outputs, ctx)


class SoftmaxGradRule(SpmdRule):
    """``(out, out_grad) -> x_grad``: ``ab1,ab1 -> ab1``."""

    def infer_forward(self, inputs, attrs, ctx):
        names = axis_whole_letters(inputs[0].ndim, attrs)
        return einsum_grad(f"{names},{names}->{names}", inputs, ctx, grad_operands=[1])


register_rule(SoftmaxRule(), "softmax", "log_softmax")
register_rule(SoftmaxGradRule(), "softmax_grad", "log_softmax_grad")


def cross_entropy_letters(logits_ndim: int, label_ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of the logits (also softmax, loss) and of the label.

    A hard label has size 1 on the class axis (or lacks it); a soft label is shaped like the
    logits. Either way the class axis is whole.
    """
    axis = axis_attr(attrs, "axis", logits_ndim, default=-1)
    logits = letters(logits_ndim, whole=[axis])
    label = logits if label_ndim == logits_ndim else logits[:axis] + logits[axis + 1 :]
    return logits, label


@register("cross_entropy_with_softmax")
class CrossEntropyWithSoftmaxRule(SpmdRule):
    """``(logits, label) -> (softmax, loss)``: ``ab1,ab1 -> ab1,ab1``."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, label = cross_entropy_letters(inputs[0].ndim, inputs[1].ndim, attrs)
        return einsum_forward(f"{x},{label}->{x},{x}", inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        x, label = cross_entropy_letters(inputs[0].ndim, inputs[1].ndim, attrs)
        return einsum_backward(f"{x},{label}->{x},{x}", inputs, outputs, ctx)


@register("cross_entropy_with_softmax_grad")
class CrossEntropyWithSoftmaxGradRule(SpmdRule):
    """``(label, softmax, loss_grad) -> logits_grad``: ``ab1,ab1,ab1 -> ab1``."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, label = cross_entropy_letters(inputs[1].ndim, inputs[0].ndim, attrs)
        return einsum_grad(f"{label},{x},{x}->{x}", inputs, ctx, grad_operands=[2])
