"""Optimizer update ops: sgd_, momentum_, adam_, adamw_ (stage: propagate).

An update is elementwise over the parameter, so any split of it works, as long as the
gradient and the optimizer states lie exactly like it:

    sgd_      p,lr,g,[mp] -> p,[mp]                        every p-shaped operand: p's splits
    momentum_ p,g,v,lr,[mp] -> p,v,[mp]
    adam(w)_  p,g,lr,m1,m2,[m2max],b1p,b2p,[mp],[skip],b1,b2,eps -> p,m1,m2,[m2max],b1p,b2p,[mp]

The parameter's placement decides (if it has none yet, the gradient's splits, then a
state's). The gradient and states are required complete (never partial): the planner turns a
partial gradient into an all_reduce, or a reduce_scatter where the parameter is split
(ZeRO). learning_rate, beta pows, beta1/beta2/epsilon and skip_update are required
replicated; every output lies like the input it updates in place. ``assign_out_(x, out)``
(an in-place copy into ``out``) is such an update too, ``out`` deciding.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.dist_attr import DistAttr
from autopar.spmd.base import Conflict, RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.operands import replicated
from autopar.spmd.registry import declare, register_rule


class OptimizerRule(SpmdRule):
    """``like_param``: operand positions lying like the parameter (position 0 first);
    ``outputs``: per result, the operand it updates in place (a parameter-like one follows
    the parameter; any other is replicated). Not an equation: the parameter's whole placement
    decides, no per-dim merge with the gradient's."""

    def __init__(self, like_param: Sequence[int], outputs: Sequence[int]) -> None:
        self.like_param = tuple(like_param)
        self.updates = tuple(outputs)

    def _choose(
        self, inputs: Sequence[TensorSpec | None], ctx: RuleContext
    ) -> tuple[tuple[tuple[int, ...], ...], list[Conflict]]:
        known = [i for i in self.like_param if inputs[i] is not None and inputs[i].dist is not None]
        if not known:
            return ((),) * inputs[0].ndim, []
        mapping = inputs[known[0]].dist.mapping
        differing = [i for i in known if inputs[i].dist.mapping != mapping]
        if not differing:
            return mapping, []
        chosen = str(DistAttr.of(ctx.mesh, mapping))
        conflict = Conflict(
            where="parameter-shaped operands",
            candidates=tuple((f"operand {i}", str(DistAttr.of(ctx.mesh, inputs[i].dist.mapping))) for i in known),
            chosen=chosen,
            reason=f"operand {known[0]} (the parameter first) decides",
        )
        return mapping, [conflict]

    def _result(self, inputs, mapping, conflicts, ctx) -> RuleResult:
        like = DistAttr.of(ctx.mesh, mapping)
        required = tuple(
            None if s is None else (like if i in self.like_param else replicated(ctx, s)) for i, s in enumerate(inputs)
        )
        outputs = tuple(
            None
            if source >= len(inputs) or inputs[source] is None
            else (like if source in self.like_param else replicated(ctx, inputs[source]))
            for source in self.updates
        )
        return RuleResult(required, outputs, tuple(conflicts))

    def infer_forward(self, inputs, attrs, ctx):
        mapping, conflicts = self._choose(inputs, ctx)
        return self._result(inputs, mapping, conflicts, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        """Known inputs decide; else the updated parameter's placement."""
        if any(inputs[i] is not None and inputs[i].dist is not None for i in self.like_param):
            return self.infer_forward(inputs, attrs, ctx)
        out = outputs[0] if outputs else None
        if out is None or out.dist is None:
            return self.infer_forward(inputs, attrs, ctx)
        return self._result(inputs, out.dist.mapping, [], ctx)


SGD = OptimizerRule(like_param=(0, 2, 3), outputs=(0, 3))
MOMENTUM = OptimizerRule(like_param=(0, 1, 2, 4), outputs=(0, 2, 4))
ADAM = OptimizerRule(like_param=(0, 1, 3, 4, 5, 8), outputs=(0, 3, 4, 5, 6, 7, 8))
register_rule(SGD, "sgd_", "sgd")
register_rule(MOMENTUM, "momentum_", "momentum")
register_rule(ADAM, "adam_", "adam", "adamw_", "adamw")
# assign_out_(x, out) writes x into out in place (a bf16 parameter refreshed from its fp32 master
# after an update on the master): the destination's placement decides, x is brought to it
register_rule(OptimizerRule(like_param=(1, 0), outputs=(1,)), "assign_out_")
declare("assign_out_", cpu_float16=True, zigzag_passes="in_place")  # the float16 parameter refreshed from its master
# (FLOPs per parameter element, states per parameter) of one update, keyed as the cost model asks
declare("sgd_", "momentum_", "adam_", "adamw_", updates_parameter=True)
declare("adamw_", cpu_twinned="on_master")  # no bf16 / fp16 CPU kernel for a low-precision parameter
declare("sgd", optimizer_cost=(2, 0))
declare("momentum", optimizer_cost=(4, 1))
declare("adam", optimizer_cost=(12, 2))
declare("adamw", optimizer_cost=(14, 2))
