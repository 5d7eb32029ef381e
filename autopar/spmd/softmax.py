"""softmax, log_softmax, cross_entropy_with_softmax and their grads (stage: propagate).

    softmax / log_softmax        abv -> abv            (x -> out)
    softmax_grad / log_softmax_grad  abv,abv -> abv    (out, out_grad -> x_grad)
    cross_entropy_with_softmax   abv,ab1 -> abv,ab1    (logits, hard label -> softmax, loss)
    cross_entropy_with_softmax_grad  ab1,abv,ab1 -> abv  (label, softmax, loss_grad -> logits_grad)

Every dim keeps its split, the normalized (class) axis ``v`` included: a row split over
ranks is finished with all_reduces of per-row values (B·S each) instead of gathering the
row (Megatron's vocabulary-parallel cross-entropy):

- softmax: the row max (max) and the sum of exponentials (sum); log_softmax the same;
- their grads: the row sum of ``out * out_grad`` (softmax) or of ``out_grad`` (log_softmax);
- cross-entropy: the row max, the sum of exponentials and the target logit; the loss comes
  out whole on every rank of the class split (not partial), the softmax split like the
  logits; its grad needs nothing (``softmax - one_hot(label)`` is local to each class).

Paddle's kernels cannot finish a split row, so ops whose normalized axis is split are
rewritten per rank (:mod:`autopar.passes.vocab_parallel`, decompositions in
:mod:`autopar.spmd.vocab_parallel`). A soft label, or cross-entropy without softmax, keeps
the class axis whole (``ab1,ab1 -> ab1,ab1``: split logits are gathered first). None of the
forward ops is linear (inputs must be complete); every grad is linear in the incoming
gradient, so its partials pass through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec, einsum_backward, einsum_forward
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.operands import axis_attr, letters
from autopar.spmd.registry import declare, register, register_rule
from autopar.spmd.vocab_parallel import VOCAB_ROWS, class_parallel


def _softmax(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``x -> out``: ``abv -> abv``."""
    names = letters(inputs[0].ndim)
    return f"{names}->{names}"


def _softmax_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(out, out_grad) -> x_grad``: ``abv,abv -> abv``."""
    return [letters(inputs[0].ndim)] * 2


register_rule(EinsumRule(_softmax), "softmax", "log_softmax", lowering=VOCAB_ROWS)
register_rule(
    EquationGradRule(_softmax_grad_letters, grad=1, shape_only=()), "softmax_grad", "log_softmax_grad", lowering=VOCAB_ROWS
)


def cross_entropy_letters(logits_ndim: int, label_ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str, str]:
    """Letters of the logits (also the softmax), the label and the loss.

    A hard label has size 1 on the class axis (or lacks it), as has the loss; a soft label
    is shaped like the logits. The class axis may be split only for a hard label.
    """
    axis = axis_attr(attrs, "axis", logits_ndim, default=-1)
    logits = letters(logits_ndim, whole=[] if class_parallel(attrs) else [axis])
    loss = logits[:axis] + "1" + logits[axis + 1 :]
    if label_ndim == logits_ndim:
        label = loss if class_parallel(attrs) else logits
    else:
        label = logits[:axis] + logits[axis + 1 :]
    return logits, label, loss


@register("cross_entropy_with_softmax")
class CrossEntropyWithSoftmaxRule(SpmdRule):
    """``(logits, label) -> (softmax, loss)``: ``abv,ab1 -> abv,ab1``, the loss whole over v's mesh dims.
    Not data: the vocabulary-parallel rewrite leaves the loss whole, which no equation states."""

    lowering = VOCAB_ROWS

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, label, loss = cross_entropy_letters(inputs[0].ndim, inputs[1].ndim, attrs)
        return _loss_whole(einsum_forward(f"{x},{label}->{x},{loss}", inputs, ctx), attrs)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        x, label, loss = cross_entropy_letters(inputs[0].ndim, inputs[1].ndim, attrs)
        return einsum_backward(f"{x},{label}->{x},{loss}", inputs, outputs, ctx)


def _loss_whole(result: RuleResult, attrs: Mapping[str, Any]) -> RuleResult:
    """The class split's all_reduces leave the loss whole on every rank (not pending)."""
    softmax, loss = result.outputs
    axis = axis_attr(attrs, "axis", softmax.ndim, default=-1)
    split = set(softmax.mapping[axis])
    kept = {d: k for d, k in loss.partial if d not in split}
    return RuleResult(result.inputs, (softmax, loss.with_partial(kept)), result.conflicts)


def _cross_entropy_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(label, softmax, loss_grad) -> logits_grad``: ``ab1,abv,ab1 -> abv``."""
    x, label, loss = cross_entropy_letters(inputs[1].ndim, inputs[0].ndim, attrs)
    return [label, x, loss]


register_rule(
    EquationGradRule(_cross_entropy_grad_letters, grad=2, results=(1,), shape_only=()),
    "cross_entropy_with_softmax_grad",
    lowering=VOCAB_ROWS,
)

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("log_softmax", to_loss=True)
declare("softmax", keeps_split=True, to_loss=True)
declare("cross_entropy_with_softmax", zigzag_passes="in_place")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
