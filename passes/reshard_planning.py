"""Reshard planning: every reshard need planned once, as values (stage: propagated ->
reshard-planned).

Propagation records a :class:`~autopar.propagation.ReshardNeed` wherever a value must change
placement (a consumer reads it otherwise, or an annotation differs from what its producer
makes). This pass asks the cost model for the cheapest steps of each need, once for the
whole job, and says why the reshard is there. Emission (:mod:`.reshard_emission`) only turns
these values into ops of a rank's program; nothing is planned again per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from autopar.causes import gradients, in_layer, layer_of, parameter_layer, reshard_cause
from autopar.collective_kinds import kind_of
from autopar.cost_model import ReshardPlan, plan_reshard
from autopar.dist_attr import DistAttr
from autopar.dropless import dropless_plan
from autopar.errors import AutoparError
from autopar.graph import Role, ValueKey
from autopar.passes.base import CompileState, Pass, PlannedReshard, PlannedReshards, declared
from autopar.passes.results import ZeroPlan
from autopar.passes.zero_sharding import ZeroShard
from autopar.propagation import ReshardNeed, SiteKind
from autopar.shared_parameters import replica_refreshes

SOURCES = ("parameter", "state", "feed")


@dataclass(frozen=True)
class ReshardPlanning(Pass):
    """``pipelined``: the Strategy places pipeline stages — reshards may cross stage meshes, and
    copies of a parameter on other stages follow its update (refresh needs). ``reduce_dtype``:
    the dtype gradient reductions move (None: the gradient's own); a gradient reduced in
    another dtype is planned, priced and emitted in it, cast before and back after
    (:mod:`.reshard_emission`). ``uneven_all_to_all``: the all_to_alls of a dropless MoE buffer
    are planned and priced as the uneven all_to_all (:func:`autopar.dropless.dropless_plan`)."""

    pipelined: bool = declared()
    reduce_dtype: str | None = declared(None)
    uneven_all_to_all: bool = declared()

    name: ClassVar[str] = "reshard_planning"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    plan_ensures: ClassVar[str] = "reshard-planned"

    def plan(self, state: CompileState) -> PlannedReshards:
        grads = gradients(state.graph) if self.reduce_dtype is not None else {}
        first_read: dict[tuple, int] = {}
        zero_plan = state.result(ZeroPlan)
        zero = {z.gradient: z for z in state.zero}
        zero_sync = f"ZeRO-{zero_plan.stage} gradient sync" if zero_plan is not None else ""
        planned: list[PlannedReshard] = []
        written_back = {(n.op, n.site.slot) for n in state.propagation.reshards if n.site.kind is SiteKind.WRITE_BACK}
        needs = list(state.propagation.reshards)
        if self.pipelined:  # copies of a parameter on other stages follow its update
            needs += replica_refreshes(state.graph, state.propagation)
        for index, need in enumerate(needs):
            value = state.graph.values[need.value]
            have = need.have
            whole = not (have.partial or have.sharded_mesh_dims())
            if value.kind in SOURCES and have.mesh != need.need.mesh and whole and need.site.kind is not SiteKind.REFRESH:
                # a whole parameter, state or feed: every rank has its own copy (start-up and feeds run everywhere)
                have = DistAttr.replicated(need.need.mesh, len(value.shape))
            moved = self.reduce_dtype if need.value in grads and have.partial else value.dtype  # (a gradient reduction)
            plan = plan_reshard(have, need.need, value.shape, moved, state.cluster)
            if self.uneven_all_to_all:
                plan = dropless_plan(state.graph, plan, state.cluster)
            if not plan.steps:
                continue
            _check_site(state, need, plan, written_back, self.pipelined)
            shared = None
            if need.site.kind is SiteKind.BEFORE_READ:
                # a value in ``regather`` (ZeRO-3 parameters) is gathered again for the backward
                phase = state.graph.ops[need.op].role is Role.FORWARD if need.value in state.regather else None
                shared = first_read.setdefault((need.value, need.need, phase), index)
                shared = None if shared == index else shared
            planned.append(PlannedReshard(index, need, plan, partial(_reason, state, need, zero, zero_sync), shared))
        return PlannedReshards(tuple(planned))


def _reason(state: CompileState, need: ReshardNeed, zero_of: Mapping[ValueKey, ZeroShard], zero_sync: str) -> str:
    """``cause: detail``: the feature and layer (:mod:`autopar.causes`), then what the reshard
    moves from which placement to which (``zero_of``: ZeRO's shard by the gradient it reduces)."""
    label = state.label(need.value)
    op = state.graph.ops[need.op]
    zero = zero_of.get(need.value)
    if zero is not None and need.site.kind is SiteKind.AFTER_PRODUCER:
        layer = parameter_layer(state.graph, zero.param)
        return (
            f"{in_layer(zero_sync, layer)}: {label} is reduced to its "
            f"{need.need} shards right after {op} makes it ({need.have})"
        )
    if need.site.kind is SiteKind.REFRESH:
        layer = parameter_layer(state.graph, need.value)
        return (
            f"{in_layer('pipeline shared parameter', layer)}: {label} is read on {need.need.mesh} too, which keeps a copy; "
            f"{op} updates it on {need.have.mesh}, and the updated value replaces the copy once per step"
        )
    if need.site.kind is SiteKind.WRITE_BACK:
        target = state.graph.values[op.inputs[need.site.slot]].label
        cause = in_layer("ZeRO parameter gather", layer_of(state.graph, op.index))
        return f"{cause}: {op} updated its {need.have} shard of {target}; gathered back into {target} ({need.need})"
    cause = reshard_cause(state, need)
    if need.site.kind is SiteKind.AFTER_PRODUCER:
        return f"{cause}: {label} is annotated {need.need}; its producer {op} makes {need.have}"
    return f"{cause}: {op} reads {label} as {need.need}; it is {need.have}"


def _check_site(
    state: CompileState, need: ReshardNeed, plan: ReshardPlan, written_back: set[tuple[int, int]], pipelined: bool
) -> None:  # fmt: skip
    """Refuse, by name, reshards that have no place in the program (yet)."""
    value = state.graph.values[need.value]
    reader = state.graph.ops[need.op]
    for step in plan.steps:
        if kind_of(step.kind).crosses_meshes and not pipelined:
            raise AutoparError(f"reshard of {value.label} across meshes ({step}): meshes of several stages need a pipeline")
    if need.site.kind is not SiteKind.BEFORE_READ:
        return
    in_place = reader.short_name.endswith("_") and value.kind in ("parameter", "state")
    if in_place and (need.op, need.site.slot) not in written_back:
        raise AutoparError(
            f"{reader} updates {value.label} in place but needs it as {need.need} while it is {need.have}: "
            "a resharded copy would take the update and lose it"
        )
    if reader.sites[need.site.slot][1] < 0:
        raise AutoparError(
            f"{reader} reads {value.label} inside a vector not built by builtin.combine; "
            f"it would need a reshard {need.have} -> {need.need} that cannot be placed there"
        )
