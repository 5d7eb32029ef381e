"""Ops that grow dims: pad, pad3d, repeat_interleave (repeats an int or a tensor), and their
grads (stage: propagate).

    pad                a1c -> a1c       (x, pad_value): a dim padded on either side is whole
                                        (``paddings``: two per dim, before and after)
    pad3d              ab111 -> ab111   (x, paddings) NCDHW / NDHWC: the padded spatial dims
                                        whole, all three when ``paddings`` is computed at run time
    repeat_interleave  abc -> abc       (x): the axis keeps its split when x's size there is
                                        a multiple of the number of parts: rank r's rows then
                                        repeat into exactly rank r's piece of out; else (or
                                        with a fixed ``output_size``) it is whole
    repeat_interleave_with_tensor_index  a1c,1 -> a1c   (x, repeats): per-row counts, the axis whole
    *_grad             the same letters: (x, out_grad) -> x_grad, (x, repeats, out_grad) -> x_grad

pad with a zero pad value, every other pad3d mode (reflect, replicate, circular: copies of
elements) and repeat_interleave are linear in x: a pending sum passes. Only pad_grad and
pad3d_grad read x for its shape alone (Paddle's no-need-buffer), so only there a pending x
is left pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec, einsum_backward, einsum_forward
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import axis_attr, letters, spread
from autopar.spmd.registry import register, register_rule

SPATIAL = {"NCDHW": (4, 3, 2), "NDHWC": (3, 2, 1)}  # dims of W, H, D: paddings come as W, H, D pairs


def _pad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    ndim = inputs[0].ndim
    pads = attrs.get("paddings")
    if not isinstance(pads, (list, tuple)) or len(pads) != 2 * ndim:
        return letters(ndim, whole=range(ndim))
    return letters(ndim, whole=[d for d in range(ndim) if pads[2 * d] or pads[2 * d + 1]])


def _pad3d_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    spatial = SPATIAL.get(str(attrs.get("data_format", "NCDHW")), SPATIAL["NCDHW"])
    pads = attrs.get("paddings")
    if not isinstance(pads, (list, tuple)) or len(pads) != 6:
        return letters(inputs[0].ndim, whole=spatial)
    return letters(inputs[0].ndim, whole=[d for i, d in enumerate(spatial) if pads[2 * i] or pads[2 * i + 1]])


Letters = Callable[[Sequence[TensorSpec], Mapping[str, Any]], str]


def _same(names: Letters) -> Callable[[Sequence[TensorSpec], Mapping[str, Any]], str]:
    """The forward equation ``x -> x``."""

    def build(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
        x = names(inputs, attrs)
        return f"{x}->{x}"

    return build


def _twice(names: Letters) -> Callable[[Sequence[TensorSpec], Mapping[str, Any]], list[str]]:
    """A grad's ``(x, out_grad)`` letters."""
    return lambda inputs, attrs: [names(inputs, attrs)] * 2


def _pad_linearity(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str | None:
    """pad / pad3d are linear when the padding adds no constant."""
    mode, value = attrs.get("mode", "constant"), attrs.get("pad_value")
    zero = isinstance(value, (int, float)) and float(value) == 0.0
    return "multi" if mode != "constant" or zero else None


register_rule(EinsumRule(_same(_pad_letters), linearity=_pad_linearity, tensors=1), "pad")
register_rule(EinsumRule(_same(_pad3d_letters), linearity=_pad_linearity, tensors=1), "pad3d")
register_rule(EquationGradRule(_twice(_pad_letters), grad=1, tensors=2), "pad_grad")
register_rule(EquationGradRule(_twice(_pad3d_letters), grad=1, tensors=2), "pad3d_grad")


def _repeat_axis(x: TensorSpec, attrs: Mapping[str, Any]) -> int | None:
    """The axis repeat_interleave may keep split (None: none may be)."""
    if attrs.get("axis") is None or not x.ndim or int(attrs.get("output_size", -1)) > 0:
        return None
    return axis_attr(attrs, "axis", x.ndim)


def _even_or_whole(solve: Callable[[str], RuleResult], x: TensorSpec, attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
    """``solve(x letters)`` with the axis's letter kept if its split comes out even, else whole."""
    axis = _repeat_axis(x, attrs)
    if axis is not None:
        result = solve(letters(x.ndim))
        parts = math.prod(ctx.mesh.shape[d] for d in result.inputs[0].mapping[axis])
        if x.shape[axis] % parts == 0:
            return result
    whole = range(x.ndim) if attrs.get("axis") is None else [axis_attr(attrs, "axis", x.ndim)]
    return solve(letters(x.ndim, whole=whole))


@register("repeat_interleave")
class RepeatInterleaveRule(SpmdRule):
    """``(x) -> out``: ``abc -> abc`` (see the module docstring). Not data: whether the axis
    keeps its split depends on the split solved (even pieces only)."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        def solve(x: str) -> RuleResult:
            return spread(einsum_forward(f"{x}->{x}", inputs[:1], ctx, linearity="multi"), [0], inputs, ctx)

        return _even_or_whole(solve, inputs[0], attrs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        def solve(x: str) -> RuleResult:
            return spread(einsum_backward(f"{x}->{x}", inputs[:1], outputs[:1], ctx), [0], inputs, ctx)

        return _even_or_whole(solve, inputs[0], attrs, ctx)


@register("repeat_interleave_grad")
class RepeatInterleaveGradRule(SpmdRule):
    """``(x, out_grad) -> x_grad``: the sum of each row's copies, split like the forward op
    (not data: the same evenness check)."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        def solve(x: str) -> RuleResult:
            return EquationGradRule(lambda specs, a: [x, x], grad=1, tensors=2, shape_only=()).infer_forward(inputs, attrs, ctx)

        return _even_or_whole(solve, inputs[0], attrs, ctx)


def _by_tensor(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """repeat_interleave_with_tensor_index: ``a1c -> a1c``, the repeats whole."""
    x = letters(inputs[0].ndim, whole=[axis_attr(attrs, "axis", inputs[0].ndim)] if inputs[0].ndim else [])
    return equation([x], [x])


def _by_tensor_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, repeats, out_grad) -> x_grad``."""
    x = _by_tensor(inputs, attrs).split("->")[1]
    return [x, "1" * inputs[1].ndim, x]


register_rule(EinsumRule(_by_tensor, linearity="multi", tensors=1), "repeat_interleave_with_tensor_index")
register_rule(EquationGradRule(_by_tensor_grad_letters, grad=2, tensors=3, shape_only=()), "repeat_interleave_with_tensor_index_grad")
