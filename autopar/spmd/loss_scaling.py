"""Dynamic loss scaling: check_finite_and_unscale_, update_loss_scaling_ and the memcpy of the
overflow flag (stage: propagate).

``paddle.amp.GradScaler(use_dynamic_loss_scaling=True)`` (fp16) appends, after the backward
(docs/paddle_amp.md, Q1 and Q4)::

    check_finite_and_unscale_  g[0..n-1], scale -> g[0..n-1] / scale, found_inf [1] bool
    update_loss_scaling_       g[0..n-1], found_inf, scale, good, bad, stop_update
                                   -> g (zeroed where found_inf), scale, good, bad
    memcpy                     found_inf -> found_inf (to the host; adamw_'s operand 9 reads it)

Each gradient keeps its placement through both ops: unscaling divides every element by one
whole scalar, and zeroing on a whole flag maps a pending sum of pieces to a pending sum of
zeros, so splits and pending sums pass through untouched (the planner reduces the gradient
where the update reads it, as without scaling).

**found_inf is derived from the gradients' placements.** A rank holding a piece of a gradient
(split over mp, ZeRO's shard, a data-parallel gradient still pending its sum) can only say
whether *its piece* holds an inf or nan: found_inf is a pending max (``P(max)``) over every
mesh dim any checked gradient is split or pending over, and whole where every gradient is whole
and identical. update_loss_scaling_ and the optimizer ops require it whole, so the planner
resolves it into one ``all_reduce(max)`` over exactly those mesh dims, before the first of them
reads it. A pending sum whose pieces are finite has a finite sum unless the sum itself
overflows (not seen by a piece: the one case a check of the reduced gradient would catch and
this one misses; fp32 gradients of O1 do not get near it).

On an overflow Paddle's kernel multiplies the gradients by 0 instead of unscaling them, so in a
step where one rank's piece overflowed the ranks' unscaled pieces are not pieces of one tensor;
they are discarded — update_loss_scaling_ zeroes every piece on the agreed flag and adamw_
skips — which is why the flag must be agreed before either reads it.

The loss scale, the good / bad step counts and stop_update are required whole (replicated
states, updated alike on every rank from the agreed flag: the replica check covers them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.operands import replicated
from autopar.spmd.registry import declare, register

OVERFLOW_REDUCE = "max"  # how the pieces' overflow flags combine: any piece overflowed


def _as_is(spec: TensorSpec | None, ctx: RuleContext) -> DistAttr | None:
    if spec is None:
        return None
    return spec.dist if spec.dist is not None else DistAttr.replicated(ctx.mesh, spec.ndim)


def pending_overflow(gradients: Sequence[DistAttr | None], ctx: RuleContext, ndim: int = 1) -> DistAttr:
    """The overflow flag of ``gradients`` checked where they lie: a pending max over every mesh
    dim one of them is split or pending over (whole where none is)."""
    dims: set[int] = set()
    for dist in gradients:
        if dist is not None:
            dims |= dist.sharded_mesh_dims() | set(dist.partial_dims)
    return DistAttr.of(ctx.mesh, ((),) * ndim, {d: OVERFLOW_REDUCE for d in sorted(dims)})


@register("check_finite_and_unscale_", "check_finite_and_unscale")
class CheckFiniteRule(SpmdRule):
    """``(g[0..n-1], scale) -> (g[0..n-1] / scale, found_inf)``: each g as it lies (pending
    sums kept), scale whole, found_inf a pending max over the mesh dims the g are split or
    pending over (module docstring). Not an equation: the flag reduces over the operands'
    mesh dims, not over dim letters."""

    def infer_forward(self, inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        grads = [_as_is(s, ctx) for s in inputs[:-1]]
        scale = replicated(ctx, inputs[-1])
        return RuleResult((*grads, scale), (*grads, pending_overflow(grads, ctx)))


@register("update_loss_scaling_", "update_loss_scaling")
class UpdateLossScalingRule(SpmdRule):
    """``(g[0..n-1], found_inf, scale, good, bad, stop_update) -> (g[0..n-1], scale, good,
    bad)``: each g as it lies, everything else whole (found_inf included: every rank zeroes
    its gradients and moves the scale on the same, agreed flag)."""

    STATES = 5  # found_inf, scale, good, bad, stop_update

    def infer_forward(self, inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        count = len(inputs) - self.STATES
        grads = [_as_is(s, ctx) for s in inputs[:count]]
        states = [replicated(ctx, s) for s in inputs[count:]]
        return RuleResult((*grads, *states), (*grads, *states[1:4]))


@register("memcpy", "memcpy_d2h", "memcpy_h2d")
class CopyRule(SpmdRule):
    """``x -> out``: a copy to another place; out lies exactly like x, a pending reduction of any
    kind included (x is required as it lies)."""

    def infer_forward(self, inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        x = _as_is(inputs[0], ctx)
        return RuleResult((x, *(replicated(ctx, s) for s in inputs[1:])), (x,))


# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("memcpy", "memcpy_d2h", "memcpy_h2d", flops_per_element=0)
declare("check_finite_and_unscale_", checks_overflow=True, scales_in_place=True)
declare("check_finite_and_unscale", checks_overflow=True)
declare("update_loss_scaling_", moves_loss_scale=True, scales_in_place=True)
declare("update_loss_scaling", moves_loss_scale=True)
