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

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.registry import register_rule

Specs = Sequence[TensorSpec]


def _layout(attrs: Mapping[str, Any], batch: str, channel: str) -> str:
    nhwc = str(attrs.get("data_format", "NCHW")).upper() in ("NHWC", "NDHWC")
    return f"{batch}11{channel}" if nhwc else f"{batch}{channel}11"


def conv_letters(attrs: Mapping[str, Any]) -> tuple[str, str, str]:
    """Letters of (input, filter, output); ``1`` marks dims that stay whole."""
    if int(attrs.get("groups", 1)) == 1:
        return _layout(attrs, "n", "c"), "oc11", _layout(attrs, "n", "o")
    return _layout(attrs, "n", "1"), "1111", _layout(attrs, "n", "1")


def _conv(inputs: Specs, attrs: Mapping[str, Any]) -> str:
    """``(input, filter) -> out``: ``nc11,oc11 -> no11``."""
    x, w, out = conv_letters(attrs)
    return equation([x, w], [out])


def _conv_grad_letters(inputs: Specs, attrs: Mapping[str, Any]) -> list[str]:
    """``(input, filter, out_grad) -> (input_grad, filter_grad)``: input_grad = out_grad ⊛ filter
    (partial over o's mesh dims), filter_grad = input ⊛ out_grad (partial over n's mesh dims:
    data parallelism's pending gradient sum)."""
    return list(conv_letters(attrs))


def _pool(inputs: Specs, attrs: Mapping[str, Any]) -> str:
    """``(x, kernel_size) -> out``: ``nc11 -> nc11``."""
    names = _layout(attrs, "n", "c")
    return f"{names}->{names}"


def _pool_linearity(inputs: Specs, attrs: Mapping[str, Any]) -> str | None:
    return "multi" if attrs.get("pooling_type", "max") == "avg" else None


def _pool_grad_letters(inputs: Specs, attrs: Mapping[str, Any]) -> list[str]:
    """``(x, out, out_grad, kernel_size) -> x_grad``: ``nc11,nc11,nc11 -> nc11``."""
    return [_layout(attrs, "n", "c")] * 3


register_rule(EinsumRule(_conv, linearity="multi"), "conv2d")
register_rule(EquationGradRule(_conv_grad_letters, grad=2, results=(0, 1), shape_only=()), "conv2d_grad")
register_rule(EinsumRule(_pool, linearity=_pool_linearity, tensors=1), "pool2d")
register_rule(EquationGradRule(_pool_grad_letters, grad=2, tensors=3, shape_only=()), "pool2d_grad")
