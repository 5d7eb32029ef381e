"""batch_norm, batch_norm_ and batch_norm_grad (stage: propagate -> the per-rank lowering
:data:`BATCH_STATISTICS`, emitted by :mod:`autopar.passes.batch_norm_stats`).

Letters for NCHW (``c`` the channel; NHWC / NLC put it last, a 2-D input is ``nc``):

    batch_norm       nchw,c,c,c,c -> nchw,c,c,c,c,1
                     (x, mean, variance, scale, bias -> out, mean_out, variance_out,
                      saved_mean, saved_variance, reserve_space)
    batch_norm_grad  nchw,c,c,c,c,c,c,1,nchw -> nchw,c,c
                     (x, scale, bias, mean_out, variance_out, saved_mean, saved_variance,
                      reserve_space, out_grad -> x_grad, scale_grad, bias_grad)

Every dim of x may keep its split. A channel split needs no communication (each channel is
normalized on its own; scale, bias and the running statistics follow it). A split of the
batch or spatial dims (the *statistic* dims, ``n h w``) is where the serial kernel would be
wrong: with batch statistics (training: not ``is_test``, not ``use_global_stats``) the mean
and variance are over every row. The outputs are nevertheless stated complete, because the
pass :mod:`autopar.passes.batch_norm_stats` replaces such an op, per rank, by local
per-channel sums and one all_reduce of 2·C values (:func:`split_statistics` names the ops it
rewrites); running mean / variance are then updated exactly as serial. In the grad op the
sums of dy and dy·x̂ are all-reduced the same way, so scale_grad and bias_grad come out
complete too (no second all_reduce in the gradient buckets).

With running statistics (``is_test`` without ``trainable_statistics``, or
``use_global_stats``) the op is an elementwise affine map per channel: the local kernel is
exact on any split, outputs complete; its grad is einsum-like, scale_grad / bias_grad
partial (sum) over the statistic dims' mesh dims, a partial out_grad passes through.

batch_norm is not linear: partial inputs are required complete. The training grad requires
out_grad complete too (the rewrite's sums are taken over complete values).

``Strategy(local_batch_norm=True)`` asks for the classic per-rank statistics instead (not equal
to serial): compile marks the training batch_norm (grad) ops of its graph view with
:data:`LOCAL_STATISTICS` (Paddle has no such attribute). Their local kernels then compute what
is wanted, each rank normalizing its rows with its own statistics; the grad is stated like the
running-statistics one (scale_grad / bias_grad partial over the statistic dims' mesh dims, so
they join the gradient sync), and the pass only averages the running mean / variance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import (
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    einsum_backward,
    einsum_forward,
    einsum_grad,
)
from autopar.spmd.lowering import Lowering, OpSite
from autopar.spmd.operands import LETTERS, letters, without_partial
from autopar.spmd.registry import declare, op_key, register

CHANNEL_LAST = ("NHWC", "NDHWC", "NLC", "NWC")


def channel_axis(ndim: int, attrs: Mapping[str, Any]) -> int:
    """The channel dim of batch_norm's x: 1, or the last for a channel-last ``data_format``."""
    last = str(attrs.get("data_format", "NCHW")).upper() in CHANNEL_LAST
    return ndim - 1 if last and ndim > 2 else min(1, ndim - 1)


LOCAL_STATISTICS = "autopar.local_statistics"  # a graph-view attribute, set by compile (see above)


def local_statistics(attrs: Mapping[str, Any]) -> bool:
    """True when the op normalizes each rank's rows with their own statistics
    (``Strategy(local_batch_norm=True)``)."""
    return bool(attrs.get(LOCAL_STATISTICS, False)) and batch_statistics(attrs)


def batch_statistics(attrs: Mapping[str, Any]) -> bool:
    """True when the kernel normalizes with the batch's statistics (Paddle's kernel:
    ``global = (is_test and not trainable_statistics) or use_global_stats``)."""
    test_mode = bool(attrs.get("is_test", False)) and not bool(attrs.get("trainable_statistics", False))
    return not (test_mode or bool(attrs.get("use_global_stats", False)))


def _match_statistics(site: OpSite) -> SplitStatistics | None:
    x_shape = site.shapes[0] if site.shapes else None
    return None if x_shape is None else split_statistics(site.name, site.attrs, site.inputs, x_shape)


def _statistics_group(split: SplitStatistics) -> tuple[int, ...]:
    return split.mesh_dims


# declared by the batch_norm rules; emitted by autopar.passes.batch_norm_stats
BATCH_STATISTICS = Lowering("batch_norm_stats", "statistics-rewritten", order=1, match=_match_statistics, group=_statistics_group)


def _letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """Letters of x and of the per-channel vectors."""
    return letters(ndim), LETTERS[channel_axis(ndim, attrs)]


def _equation(
    names: Sequence[str], specs: Sequence[TensorSpec | None], outputs: Sequence[str]
) -> tuple[list[int], str]:
    kept = [i for i, s in enumerate(specs) if s is not None]
    return kept, ",".join(names[i] for i in kept) + "->" + ",".join(outputs)


def _spread(result: RuleResult, kept: Sequence[int], count: int) -> tuple[DistAttr | None, ...]:
    required: list[DistAttr | None] = [None] * count
    for pos, i in enumerate(kept):
        required[i] = result.inputs[pos]
    return tuple(required)


@register("batch_norm")
class BatchNormRule(SpmdRule):
    """``nchw,c,c,c,c -> nchw,c,c,c,c,1`` (see the module docstring); outputs complete. Not
    data: the statistics' pending sums are the batch-statistics rewrite's, not the reader's."""

    lowering = BATCH_STATISTICS

    def _eq(self, inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[list[int], str, list[str]]:
        x, c = _letters(inputs[0].ndim, attrs)
        outs = [x, c, c, c, c, "1"]
        kept, eq = _equation([x, c, c, c, c], inputs, outs)
        return kept, eq, outs

    def _finish(self, result: RuleResult, kept: list[int], count: int) -> RuleResult:
        outputs = tuple(without_partial(o) or o for o in result.outputs)
        return RuleResult(_spread(result, kept, count), outputs, result.conflicts)

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        kept, eq, _ = self._eq(inputs, attrs)
        return self._finish(einsum_forward(eq, [inputs[i] for i in kept], ctx), kept, len(inputs))

    def infer_backward(self, inputs, outputs, attrs, ctx):
        kept, eq, outs = self._eq(inputs, attrs)
        known = [i for i, o in enumerate(outputs[: len(outs)]) if o is not None]
        sub = eq.split("->")[0] + "->" + ",".join(outs[i] for i in known)
        result = einsum_backward(sub, [inputs[i] for i in kept], [outputs[i] for i in known], ctx)
        return RuleResult(_spread(result, kept, len(inputs)), result.outputs, result.conflicts)


@register("batch_norm_grad")
class BatchNormGradRule(SpmdRule):
    """``nchw,c,c,c,c,c,c,1,nchw -> nchw,c,c``; with batch statistics every input is required
    complete and scale_grad / bias_grad come out complete (the rewrite all-reduces them). Not
    data: which partials remain depends on batch vs running vs local statistics."""

    lowering = BATCH_STATISTICS

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x, c = _letters(inputs[0].ndim, attrs)
        kept, eq = _equation([x, c, c, c, c, c, c, "1", x], inputs, [x, c, c])
        result = einsum_grad(eq, [inputs[i] for i in kept], ctx, grad_operands=[len(kept) - 1])
        required = _spread(result, kept, len(inputs))
        outputs = tuple(result.outputs)
        if batch_statistics(attrs) and not local_statistics(attrs):
            required = tuple(without_partial(a) or a if a is not None else None for a in required)
            outputs = tuple(without_partial(o) or o for o in outputs)
        outputs = tuple(o if i == 0 or inputs[i] is not None else None for i, o in enumerate(outputs))
        return RuleResult(required, outputs, result.conflicts)


@dataclass(frozen=True, slots=True)
class SplitStatistics:
    """A batch_norm (grad) op whose statistic dims ``axes`` of x are split over ``mesh_dims``:
    its per-channel sums must be all-reduced over them."""

    op: str  # "batch_norm" or "batch_norm_grad"
    channel: int  # x's channel dim
    axes: tuple[int, ...]  # x's other dims (summed over)
    mesh_dims: tuple[int, ...]  # the mesh dims splitting them (the all_reduce's)
    count: int  # elements per channel in the whole batch (N·H·W)
    local: bool = False  # per-rank statistics (Strategy(local_batch_norm=True)): only the running ones are averaged


def split_statistics(
    op_name: str, attrs: Mapping[str, Any], inputs: Sequence[DistAttr | None], x_shape: Sequence[int]
) -> SplitStatistics | None:
    """The rewrite ``op_name`` needs when x lies as ``inputs[0]`` (the placement its rule
    required), or None when the local kernel is exact (running statistics, or no statistic
    dim split over more than one rank)."""
    key = op_key(op_name)
    key = key[:-1] if key.endswith("_") else key
    if key not in ("batch_norm", "batch_norm_grad") or not batch_statistics(attrs):
        return None
    dist = inputs[0] if inputs else None
    if dist is None:
        return None
    ndim = len(x_shape)
    channel = channel_axis(ndim, attrs)
    axes = tuple(d for d in range(ndim) if d != channel)
    dims = tuple(sorted({m for d in axes for m in dist.mapping[d]}))
    if math.prod(dist.mesh.shape[m] for m in dims) <= 1:
        return None
    count = math.prod(int(x_shape[d]) for d in axes)
    return SplitStatistics(key, channel, axes, dims, count, local_statistics(attrs))

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("batch_norm", "batch_norm_", normalizing=True)
