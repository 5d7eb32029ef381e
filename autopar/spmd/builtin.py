"""Ops that only read their operand where it lies: fetches, shadow outputs, prints.

They compute nothing per element, so any placement is fine: the requirement is the operand's
current placement (no reshard) and there are no tensor outputs to place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.registry import declare, register


@register("shadow_output", "fetch", "print")
class ReadAsIsRule(SpmdRule):
    """``x -> (x)``: reads ``x`` as it is; an output (fetch, print) lies like it. Not an
    equation: the operand's placement, partials included, is kept whatever it is."""

    def infer_forward(self, inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        from autopar.dist_attr import DistAttr

        required = tuple(
            None if s is None else (s.dist if s.dist is not None else DistAttr.replicated(ctx.mesh, s.ndim)) for s in inputs
        )
        return RuleResult(required, tuple(required[:1]))  # fetch / print pass their operand on

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("fetch", free=True)
declare("builtin.parameter", "data", cpu_float16=True)  # read from the scope in any dtype
declare("print", side_effect=True)
