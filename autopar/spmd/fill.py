"""Fill ops: full, full_like, fill, full_, empty(_like), full_int_array, ... (stage: propagate).

A fill reads no values, so it can produce any placement that is not partial: each rank fills
its own piece (the partition pass rewrites a ``shape`` attribute to the local shape).

    full, full_int_array, full_with_tensor, empty, assign_value  -> replicated (forward);
        backward inference gives the output the requested splits, never a partial
    full_like, empty_like, fill, full_  x -> out: out lies like x without its partial (a fill
        of a partial tensor is a complete tensor); x is read only for its shape, so it is
        required as it lies (no reshard)
    full_batch_size_like  x -> out: out's ``output_dim_idx`` follows x's ``input_dim_idx``
    assign_value_  buffer -> out: writes the global values: replicated
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.operands import replicated, without_partial
from autopar.spmd.registry import declare, register


def _out_ndim(attrs: Mapping[str, Any], default: int, inputs: Sequence[TensorSpec | None] = ()) -> int:
    """Rank of the filled tensor: ``attrs["shape"]``, else the length of a trailing shape operand."""
    shape = attrs.get("shape")
    if isinstance(shape, (list, tuple)):
        return len(shape)
    if inputs and inputs[-1] is not None and inputs[-1].ndim == 1 and inputs[-1].dtype.startswith("int"):
        return inputs[-1].shape[0]
    return default


@register("full", "full_int_array", "full_with_tensor", "empty", "assign_value")
class FullRule(SpmdRule):
    """``(int-array / scalar operands) -> out``: replicated; backward takes the wanted splits
    (not an equation: no operand has the output's dims)."""

    free_outputs = True

    def infer_forward(self, inputs, attrs, ctx):
        ndim = _out_ndim(attrs, 1, inputs)
        return RuleResult(tuple(replicated(ctx, s) for s in inputs), (DistAttr.replicated(ctx.mesh, ndim),))

    def infer_backward(self, inputs, outputs, attrs, ctx):
        out = outputs[0]
        dist = without_partial(out.dist) or out.dist or DistAttr.replicated(ctx.mesh, out.ndim)
        return RuleResult(tuple(replicated(ctx, s) for s in inputs), (dist,))


def _as_is(spec: TensorSpec, ctx: RuleContext) -> DistAttr:
    return spec.dist if spec.dist is not None else DistAttr.replicated(ctx.mesh, spec.ndim)


@register("full_like", "empty_like", "fill", "full_")
class FullLikeRule(SpmdRule):
    """``(x, [value]) -> out``: ``ab -> ab`` without x's partial; x required as it lies (not an
    equation: x's placement is taken, never merged or resharded)."""

    def infer_forward(self, inputs, attrs, ctx):
        x = _as_is(inputs[0], ctx)
        out = DistAttr.of(ctx.mesh, x.mapping)
        return RuleResult((x,) + tuple(replicated(ctx, s) for s in inputs[1:]), (out,))

    def infer_backward(self, inputs, outputs, attrs, ctx):
        out = outputs[0]
        if out.dist is None:
            return self.infer_forward(inputs, attrs, ctx)
        x = inputs[0]
        keep = x.dist.partial if x.dist is not None and x.dist.mapping == out.dist.mapping else ()
        return RuleResult(
            (DistAttr.of(ctx.mesh, out.dist.mapping, keep),) + tuple(replicated(ctx, s) for s in inputs[1:]),
            (DistAttr.of(ctx.mesh, out.dist.mapping),),
        )


@register("full_batch_size_like")
class FullBatchSizeLikeRule(SpmdRule):
    """``input -> out``: out dim ``output_dim_idx`` (size of input dim ``input_dim_idx``) follows it
    (not an equation: x is taken as it lies)."""

    def infer_forward(self, inputs, attrs, ctx):
        x = _as_is(inputs[0], ctx)
        ndim = _out_ndim(attrs, 1)
        src, dst = int(attrs.get("input_dim_idx", 0)), int(attrs.get("output_dim_idx", 0))
        mapping = [()] * ndim
        mapping[dst] = x.mapping[src] if x.ndim else ()
        return RuleResult((x,), (DistAttr.of(ctx.mesh, tuple(mapping)),))


@register("assign_value_")
class AssignValueRule(SpmdRule):
    """``buffer -> out``: the op writes the global values, so both are replicated (the output's
    rank comes from an attribute, not an operand)."""

    def infer_forward(self, inputs: Sequence[TensorSpec | None], attrs, ctx):
        return RuleResult(
            tuple(replicated(ctx, s) for s in inputs),
            (DistAttr.replicated(ctx.mesh, _out_ndim(attrs, inputs[0].ndim)),),
        )

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("assign_value_", neutral_source=True)
declare("full", "full_int_array", free=True, neutral_source=True)
declare("full", shape_attr=True)
declare("full", "full_like", loss_seed=True)
declare("full_like", flops_per_element=0, keeps_split=True, neutral_source=True)
declare("full_like", zigzag_passes="in_place")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
