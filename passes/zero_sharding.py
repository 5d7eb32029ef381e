"""ZeRO: optimizer states, gradients and parameters sharded over the data-parallel mesh dim
(stage: propagated -> zero-sharded; runs before reshard planning).

Data parallelism keeps a whole copy of every optimizer state, gradient and parameter on each
rank of the data-parallel (dp) axis. ZeRO (Rajbhandari et al. 2020) splits them over it:

- stage 1: each optimizer state is split over dp; each rank updates its shard of each
  parameter from the whole (all-reduced) gradient, sliced locally, and the updated shards are
  all-gathered back into the whole parameter (a *write-back* reshard after the in-place update);
- stage 2: also the gradient: a reduce_scatter replaces the all_reduce, each rank receives only
  its shard (reduce_scatter + all_gather move what one all_reduce moves);
- stage 3: also the parameter: each rank stores its shard, and every read of it is an
  all_gather right before the reading op — once for the forward, again for the backward
  (the gathered copy is not kept alive between them); the update needs no write-back.

This pass decides after propagation because the shard must follow the placement propagation
chose for the parameter: a tensor-parallel weight split over ``mp`` on one dim is split over
``dp`` too (its first dim with at least one element per piece, the dp split nested inside
the existing one). It rewrites the propagation result as values — the update op's required
placements, the states' and (stage 3) the parameters' placements, the reshard needs at the
update and at every stage-3 read — and records each decision (:class:`ZeroShard`); planning
and emission then treat these needs like any other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from autopar.causes import updates as parameter_updates
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import OpNode, Role, ValueKey
from autopar.passes.base import CompileState, Pass
from autopar.passes.results import ZeroShard
from autopar.propagation import Priority, PropagationResult, ReshardNeed, ReshardSite, SiteKind, ValueState
from autopar.spmd import RuleResult, get_rule


@dataclass(frozen=True)
class ZeroSharding(Pass):
    stage: int = 1

    name: ClassVar[str] = "zero_sharding"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    plan_ensures: ClassVar[str] = "zero-sharded"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise AutoparError(f"zero_sharding: stage must be 1, 2 or 3, got {self.stage!r}")

    def plan(self, state: CompileState) -> None:
        updates = [op for op, _ in parameter_updates(state.graph) if op.role is Role.OPTIMIZER]
        if not updates:
            raise AutoparError(
                f"Strategy.zero_stage={self.stage}: the program has no optimizer update (sgd_, momentum_, adam_, adamw_)"
            )
        mesh_dim = data_parallel_dim(state, updates)
        state.propagation = state.propagation.derived()  # ZeRO's placements: a new value, the analysis stays
        edits = _ReshardEdits()
        decisions = [self._shard(state, op, mesh_dim, edits) for op in updates]
        edits.apply(state.propagation)
        state.propagation.reshards.sort(key=lambda need: need.op)  # shared reads: the first in program order emits
        state.zero = tuple(decisions)

    def _shard(self, state: CompileState, op: OpNode, mesh_dim: int, edits: _ReshardEdits) -> ZeroShard:
        rule = get_rule(op.name)
        prop, graph = state.propagation, state.graph
        param = op.inputs[0]
        result = prop.op_results[op.index]
        whole = result.inputs[0]
        label = graph.values[param].label
        name = state.mesh.dim_names[mesh_dim]  # a pipeline stage's parameter lies on its stage's sub-mesh
        if name not in whole.mesh.dim_names:
            return ZeroShard(param, label, op.index, whole, None, f"its mesh {whole.mesh} has no dim {name!r}")
        sharded, reason = sharded_placement(whole, graph.values[param].shape, whole.mesh.dim_names.index(name))
        if sharded is None:
            return ZeroShard(param, label, op.index, whole, None, reason)
        like = [i for i in rule.like_param if i < len(op.inputs) and op.inputs[i] is not None]
        grad = next(i for i in like if graph.values[op.inputs[i]].kind not in ("parameter", "state"))
        inputs = tuple(sharded if i in like else d for i, d in enumerate(result.inputs))
        outputs = tuple(
            sharded if j < len(rule.updates) and rule.updates[j] in like and d is not None else d
            for j, d in enumerate(result.outputs)
        )
        prop.op_results[op.index] = RuleResult(inputs, outputs, result.conflicts)
        edits.drop.update(ReshardSite(SiteKind.BEFORE_READ, op.index, i) for i in like)
        for i in like:
            key = op.inputs[i]
            if graph.values[key].kind == "state":
                prop.states[key] = ValueState(sharded, Priority.STRATEGY, f"zero stage {self.stage}")
        for key, dist in zip(op.outputs, outputs):
            if key is not None and dist is not None:
                prop.states[key] = dataclasses.replace(prop.states[key], dist=dist)
        self._gradient(state, op, grad, sharded, edits)
        if self.stage == 3:  # the parameter is stored as its shard; its other readers gather it
            self._move(state, param, sharded, op.index, edits)
            state.regather = state.regather | {param}
        else:
            self._write_back(state, op, param, sharded, edits)
        return ZeroShard(param, label, op.index, whole, sharded, f"stage {self.stage}", op.inputs[grad])

    def _gradient(self, state: CompileState, op: OpNode, slot: int, sharded: DistAttr, edits: _ReshardEdits) -> None:
        """Stage 1: the gradient stays whole until the update, which reads its shard (a
        reduce_scatter there, where the gradient is partial). Stages 2 and 3: the gradient
        is resharded right after the op that makes it, so only its shard outlives it."""
        prop, key = state.propagation, op.inputs[slot]
        if self.stage == 1:
            have = prop.dist(key)
            if have != sharded:
                edits.added.append(ReshardNeed(ReshardSite(SiteKind.BEFORE_READ, op.index, slot), key, have, sharded))
            return
        made = prop.made(key)
        edits.drop_after_producer.add(key)
        self._move(state, key, sharded, op.index, edits)
        if made != sharded:
            site = ReshardSite(SiteKind.AFTER_PRODUCER, key[0], key[1])
            edits.added.append(ReshardNeed(site, key, made, sharded))

    def _write_back(self, state: CompileState, op: OpNode, param: ValueKey, sharded: DistAttr, edits: _ReshardEdits) -> None:
        """Stages 1 and 2: the update reads its shard of the whole parameter and the updated
        shards are gathered back into it."""
        stored = state.propagation.dist(param)
        edits.added.append(ReshardNeed(ReshardSite(SiteKind.BEFORE_READ, op.index, 0), param, stored, sharded))
        updated = op.outputs[0]
        edits.added.append(ReshardNeed(ReshardSite(SiteKind.WRITE_BACK, op.index, 0), updated, sharded, stored))

    def _move(self, state: CompileState, key: ValueKey, placement: DistAttr, skip: int, edits: _ReshardEdits) -> None:
        """``key`` now lies as ``placement``: every reader but op ``skip`` (the update, which
        reads it so) reshards it to what it reads (stage-3 parameters: an all_gather)."""
        prop, graph = state.propagation, state.graph
        old = prop.dist(key)
        prop.states[key] = ValueState(placement, Priority.STRATEGY, f"zero stage {self.stage}")
        readers = [r for r in dict.fromkeys(graph.values[key].users) if r != skip and r in prop.op_results]
        sites = {
            ReshardSite(SiteKind.BEFORE_READ, r, slot)
            for r in readers
            for slot, k in enumerate(graph.ops[r].inputs)
            if k == key
        }
        edits.drop.update(sites)
        for site in sorted(sites, key=lambda s: (s.op, s.slot)):
            need = prop.op_results[site.op].inputs[site.slot] or old
            if need != placement:
                edits.added.append(ReshardNeed(site, key, placement, need))


@dataclasses.dataclass
class _ReshardEdits:
    """ZeRO's changes to the propagation's reshard needs, applied in one pass (filtering the
    list once per parameter made planning quadratic: 0.3 s for a 24-layer GPT at stage 3)."""

    drop: set[ReshardSite] = dataclasses.field(default_factory=set)  # sites whose planned needs go
    drop_after_producer: set[ValueKey] = dataclasses.field(default_factory=set)  # values resharded after their producer no more
    added: list[ReshardNeed] = dataclasses.field(default_factory=list)

    def apply(self, prop: PropagationResult) -> None:
        kept = [
            n for n in prop.reshards
            if n.site not in self.drop and not (n.site.kind is SiteKind.AFTER_PRODUCER and n.value in self.drop_after_producer)
        ]  # fmt: skip
        prop.reshards[:] = kept + self.added
        prop.__dict__.pop("produced", None)  # the cached map of after-producer reshards (of the derived value)


def data_parallel_dim(state: CompileState, updates: list[OpNode]) -> int:
    """The mesh dim named ``dp``; else the only dim of a 1-d mesh; else the one mesh dim every
    partial gradient is pending over."""
    mesh = state.mesh
    if "dp" in mesh.dim_names:
        return mesh.dim_names.index("dp")
    if mesh.ndim == 1:
        if state.strategy.pipeline is not None:
            raise AutoparError(
                f"Strategy.zero_stage={state.strategy.zero_stage}: {mesh}'s only dim carries the pipeline stages; "
                "ZeRO shards over a data-parallel dim: use a 2-d mesh such as ['pp', 'dp']"
            )
        return 0
    pending = set()
    for op in updates:
        for key in op.inputs:
            if key is not None and state.graph.values[key].kind == "activation":
                pending |= set(state.propagation.dist(key).partial_dims)
    if len(pending) == 1:
        return pending.pop()
    raise AutoparError(
        f"Strategy.zero_stage={state.strategy.zero_stage}: cannot tell which dim of {mesh} is data parallel "
        f"(gradients are pending over {sorted(mesh.dim_names[d] for d in pending) or 'no dim'}); name it 'dp'"
    )


def sharded_placement(whole: DistAttr, shape: tuple[int, ...], mesh_dim: int) -> tuple[DistAttr | None, str]:
    """``whole`` further split over ``mesh_dim``: on its first tensor dim that splits evenly
    (every backend gathers even pieces), else on the first that keeps every piece non-empty
    (None and why, where none does)."""
    if mesh_dim in whole.sharded_mesh_dims():
        return None, f"already split over mesh dim {whole.mesh.dim_names[mesh_dim]!r}"
    if whole.is_partial:
        return None, f"its update is partial ({whole})"
    size = whole.mesh.shape[mesh_dim]
    parts = [math.prod(whole.mesh.shape[d] for d in dims) for dims in whole.mapping]
    even = [t for t, extent in enumerate(shape) if extent % (parts[t] * size) == 0]
    filled = [t for t, extent in enumerate(shape) if extent // parts[t] >= size]
    chosen = (even or filled or [None])[0]
    if chosen is None:
        return None, f"shape {list(shape)} has no dim with {size} elements per piece"
    mapping = list(whole.mapping)
    mapping[chosen] = (*mapping[chosen], mesh_dim)
    return DistAttr.of(whole.mesh, tuple(mapping), whole.partial), ""
