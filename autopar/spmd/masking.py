"""Ops models use to build masks and broadcast tables: expand, tril / triu, where, logical and
bitwise ops, arange, and their grads (stage: propagate).

    expand        1b -> ab     (x [1, S] to [B, S]): a broadcast dim takes any split of the
                               output (each rank expands to its own piece); its gradient is a
                               partial sum over the mesh dims that split it
    tril / triu   ab11 -> ab11 the last two dims whole (the diagonal is counted from the corner)
    where         abc,abc,abc -> abc   (Paddle broadcasts the operands first); grad linear in g
    masked_fill   abc,abc, -> abc      (x, mask, the 0-d fill value); its grad: out_grad where
                               the mask is off for x, the sum where it is on for the value
    logical_* / bitwise_*      broadcasting elementwise, as compare ops
    tile          ab -> a1     (repeat_times [1, 2]): a repeated dim whole, the rest keeps its split
    arange        -> a         whole: each element is its own index, so no rank can make a piece
                               of it without knowing its offset (linspace alike)
    expand_as     1b,ab -> ab  expand to the static target_shape; the second operand is read for
                               its shape only, so it keeps whatever split the output takes
    label_smooth  ab1 -> ab1   the class dim whole (the kernel divides by its size)

A mask built from a batch-sized constant (``paddle.ones([B, S])``) or an expand to the batch is
then split like the batch it is added to (data parallelism, micro-batches) instead of being
made whole on every rank and sliced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import (
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    einsum_backward,
    einsum_forward,
)  # fmt: skip
from autopar.spmd.elementwise import broadcast_equation, same_equation
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.operands import letters, replicated, spread
from autopar.spmd.registry import declare, register, register_rule


def expand_target(x_shape: Sequence[int], attrs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """expand's output shape from its (constant) ``shape`` operand; ``-1`` keeps x's size.
    None when the shape is computed at run time."""
    target = attrs.get("shape")
    if not isinstance(target, (list, tuple)):
        return None
    offset = len(target) - len(x_shape)
    return tuple(int(x_shape[i - offset]) if int(t) == -1 else int(t) for i, t in enumerate(target))


def _expand_letters(x_shape: Sequence[int], attrs: Mapping[str, Any]) -> tuple[str, str] | None:
    out = expand_target(x_shape, attrs)
    if out is None:
        return None
    (x, _), out_letters = broadcast_letters([x_shape, out])
    return x, out_letters


@register("expand", "broadcast_to")
class ExpandRule(SpmdRule):
    """``(x, shape) -> out`` (see the module docstring); the shape operand stays whole. Not
    data: a target computed in the program (from a shape read) is not known to the forward
    inference, which keeps the output whole; the backward one reads it from the output's static
    shape (the partition pass writes each rank's own target, whatever computed it)."""

    free_outputs = True

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        found = _expand_letters(inputs[0].shape, attrs)
        if found is None:  # a shape known at run time only: whole
            return RuleResult(tuple(replicated(ctx, s) for s in inputs), (replicated(ctx, inputs[0]),))
        rule = EinsumRule(lambda specs, attrs: equation([found[0]], [found[1]]), linearity="multi")
        return spread(rule.infer_forward(inputs[:1], attrs, ctx), [0], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        found = _expand_letters(inputs[0].shape, {"shape": list(outputs[0].shape)})  # (the target may be computed)
        rule = EinsumRule(lambda specs, attrs: equation([found[0]], [found[1]]))
        return spread(rule.infer_backward(inputs[:1], outputs, attrs, ctx), [0], inputs, ctx)


def _expand_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, out_grad, shape) -> x_grad``: the sum over the broadcast dims; x is read for its
    shape only."""
    (x, out), _ = broadcast_letters([inputs[0].shape, inputs[1].shape])
    return [x, out]


register_rule(EquationGradRule(_expand_grad_letters, grad=1, tensors=2, shape_only=(0,)), "expand_grad", "broadcast_to_grad")


def _last_two_whole(specs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``ab11 -> ab11``: tril / triu and their grads (the diagonal counts from the corner)."""
    ndim = specs[0].ndim
    names = letters(ndim, whole=range(max(ndim - 2, 0), ndim))
    return f"{names}->{names}"


register_rule(EinsumRule(_last_two_whole, linearity="multi"), "tril", "triu", "tril_grad", "triu_grad")


def _where_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(condition, x, y, out_grad) -> (x_grad, y_grad)``: out_grad where the condition picks
    the operand, 0 elsewhere: linear in out_grad (its pending sum passes through)."""
    return broadcast_letters([s.shape for s in inputs])[0]


def _arange(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(start, end, step) -> out``: ``1,1,1 -> 1``, whole (see the module docstring)."""
    return equation(["1" * s.ndim for s in inputs if s is not None], ["1"])


register_rule(EquationGradRule(_where_grad_letters, grad=3, results=(1, 2), shape_only=()), "where_grad")
register_rule(EquationGradRule(_where_grad_letters, grad=3, results=(0, 2), shape_only=()), "masked_fill_grad")
register_rule(EinsumRule(_arange), "arange", "linspace")


def _expand_as(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(x, y) -> out``: x broadcast to ``target_shape`` as an expand; y has out's letters
    (its shape is out's; it is read for nothing else)."""
    (x, out), _ = broadcast_letters([inputs[0].shape, list(attrs["target_shape"])])
    return equation([x] + ([out] if len(inputs) > 1 and inputs[1] is not None else []), [out])


register_rule(EinsumRule(_expand_as, linearity="first"), "expand_as")
register_rule(EquationGradRule(_expand_grad_letters, grad=1, tensors=2, shape_only=(0,)), "expand_as_grad")


def _label_smooth(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(label, prior_dist?) -> out``: ``(1 - eps) * label + eps / classes`` (or ``eps * prior``)."""
    names = letters(inputs[0].ndim)[:-1] + "1"
    return equation([names], [names])


register_rule(EinsumRule(_label_smooth, tensors=1), "label_smooth")
register_rule(EinsumRule(same_equation, linearity="multi"), "label_smooth_grad")


def _tile_letters(x_shape: Sequence[int], attrs: Mapping[str, Any]) -> tuple[str, str] | None:
    """x's and out's letters for ``tile``: a repeated dim (and a new leading one) is whole."""
    repeats = attrs.get("repeat_times")
    if not isinstance(repeats, (list, tuple)):
        return None
    repeats = [int(r) for r in repeats]
    ndim = max(len(x_shape), len(repeats))
    repeats = [1] * (ndim - len(repeats)) + repeats
    offset = ndim - len(x_shape)
    whole = [i for i, r in enumerate(repeats) if r != 1 or i < offset]
    out = letters(ndim, whole=whole)
    return out[offset:], out


@register("tile")
class TileRule(SpmdRule):
    """``(x, repeat_times) -> out``: ``ab -> a1`` for ``repeat_times=[1, 2]``; a dim repeated
    is whole (its copies would not be contiguous pieces), the others keep their split. Not data:
    ``repeat_times`` computed at run time leaves everything whole (output rank unknown)."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        found = _tile_letters(inputs[0].shape, attrs)
        if found is None:
            return RuleResult(tuple(replicated(ctx, s) for s in inputs), (DistAttr.replicated(ctx.mesh, inputs[0].ndim),))
        return spread(einsum_forward(equation([found[0]], [found[1]]), inputs[:1], ctx, linearity="multi"), [0], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        found = _tile_letters(inputs[0].shape, attrs)
        if found is None:
            return self.infer_forward(inputs, attrs, ctx)
        return spread(einsum_backward(equation([found[0]], [found[1]]), inputs[:1], outputs, ctx), [0], inputs, ctx)


def _tile_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, out_grad, repeat_times) -> x_grad``: the sum of the copies; x gives the shape."""
    found = _tile_letters(inputs[0].shape, attrs)
    return list(found) if found is not None else [letters(inputs[0].ndim, whole=range(inputs[0].ndim))] * 2


register_rule(EquationGradRule(_tile_grad_letters, grad=1, tensors=2, shape_only=(0,)), "tile_grad")
register_rule(EinsumRule(broadcast_equation), "where", "masked_fill")
register_rule(EinsumRule(broadcast_equation), "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor")
register_rule(EinsumRule(same_equation, tensors=1), "bitwise_not")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("arange", neutral_source=True)
declare("expand", "tile", "tril", "triu", "where", keeps_split=True)
declare("expand", shape_attr=True)
declare("expand", zigzag_passes="in_place")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
