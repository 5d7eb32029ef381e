"""conv2d, pool2d and their grads (stage: propagate).

conv2d (NCHW; filter ``[O, C/groups, kh, kw]``) is a contraction over input channels with
a spatial window; spatial dims are required whole (a window crosses shard borders):

    conv2d  nc11,oc11 -> no11      (groups == 1; NHWC: n11c,oc11 -> n11o)

so a batch split gives a batch-split output, a filter split on ``O`` an output-channel split,
and an input-channel split a partial sum (c is contracted). With ``groups > 1`` channels are
tied to their group, so only the batch may be split (``nC11,OC11 -> nO11``). conv2d is
linear in each operand (one partial operand may pass through).

pool2d works per (sample, channel): ``nc11 -> nc11``; avg pooling is linear (partials pass
through), max pooling is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.spmd.base import SpmdRule, einsum_backward, einsum_forward, einsum_grad
from autopar.spmd.operands import spread
from autopar.spmd.registry import register


def _layout(attrs: Mapping[str, Any], batch: str, channel: str) -> str:
    nhwc = str(attrs.get("data_format", "NCHW")).upper() in ("NHWC", "NDHWC")
    return f"{batch}11{channel}" if nhwc else f"{batch}{channel}11"


def conv_letters(attrs: Mapping[str, Any]) -> tuple[str, str, str]:
    """Letters of (input, filter, output); ``1`` marks dims that stay whole."""
    if int(attrs.get("groups", 1)) == 1:
        return _layout(attrs, "n", "c"), "oc11", _layout(attrs, "n", "o")
    return _layout(attrs, "n", "1"), "1111", _layout(attrs, "n", "1")


@register("conv2d")
class Conv2dRule(SpmdRule):
    """``(input, filter) -> out``: ``nc11,oc11 -> no11`` (see the module docstring)."""

    def infer_forward(self, inputs, attrs, ctx):
        x, w, out = conv_letters(attrs)
        return einsum_forward(f"{x},{w}->{out}", inputs, ctx, linearity="multi")

    def infer_backward(self, inputs, outputs, attrs, ctx):
        x, w, out = conv_letters(attrs)
        return einsum_backward(f"{x},{w}->{out}", inputs, outputs, ctx)


@register("conv2d_grad")
class Conv2dGradRule(SpmdRule):
    """``(input, filter, out_grad) -> (input_grad, filter_grad)``.

    input_grad = out_grad ⊛ filter (partial over o's mesh dims), filter_grad = input ⊛ out_grad
    (partial over n's mesh dims: data parallelism's pending gradient sum).
    """

    def infer_forward(self, inputs, attrs, ctx):
        x, w, out = conv_letters(attrs)
        return einsum_grad(f"{x},{w},{out}->{x},{w}", inputs, ctx, grad_operands=[2])


def _pool_letters(attrs: Mapping[str, Any]) -> str:
    return _layout(attrs, "n", "c")


@register("pool2d")
class Pool2dRule(SpmdRule):
    """``(x, kernel_size) -> out``: ``nc11 -> nc11``; avg pooling keeps partials."""

    def infer_forward(self, inputs, attrs, ctx):
        names = _pool_letters(attrs)
        linear = "multi" if attrs.get("pooling_type", "max") == "avg" else None
        return spread(einsum_forward(f"{names}->{names}", inputs[:1], ctx, linearity=linear), [0], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names = _pool_letters(attrs)
        return spread(einsum_backward(f"{names}->{names}", inputs[:1], outputs, ctx), [0], inputs, ctx)


@register("pool2d_grad")
class Pool2dGradRule(SpmdRule):
    """``(x, out, out_grad, kernel_size) -> x_grad``: ``nc11,nc11,nc11 -> nc11``."""

    def infer_forward(self, inputs, attrs, ctx):
        names = _pool_letters(attrs)
        result = einsum_grad(f"{names},{names},{names}->{names}", inputs[:3], ctx, grad_operands=[2])
        return spread(result, [0, 1, 2], inputs, ctx)
