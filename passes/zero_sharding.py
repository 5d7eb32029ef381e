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
the existing one). It changes no placement in place: it states its placements as a
:class:`~autopar.propagation.PlacementOverride` — the update op's required placements, the
states' and (stage 3) the parameters' placements, the reshard needs at the update and at every
stage-3 read — layered on the analysis' propagation (which other strategies compiled from the
same analysis still read as it was), and records each decision (:class:`ZeroShard`) in its
result, :class:`ZeroPlan`; planning and emission then treat these needs like any other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from autopar.causes import updates as parameter_updates
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import OpNode, Role, ValueKey
from autopar.passes.base import CompileState, Pass
from autopar.passes.results import ZeroPlan, ZeroShard
from autopar.propagation import (
    PlacementOverride,
    Priority,
    PropagationResult,
    ReshardNeed,
    ReshardSite,
    SiteKind,
    ValueState,
)
from autopar.spmd import RuleResult, get_rule


@dataclass(frozen=True)
class ZeroSharding(Pass):
    """ZeRO at ``stage`` over the data-parallel mesh dim; ``pipelined``: the Strategy places
    pipeline stages (then a 1-d mesh's only dim carries them, not data parallelism)."""

    stage: int = 1
    pipelined: bool = False

    name: ClassVar[str] = "zero_sharding"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    plan_ensures: ClassVar[str] = "zero-sharded"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise AutoparError(f"zero_sharding: stage must be 1, 2 or 3, got {self.stage!r}")

    def plan(self, state: CompileState) -> ZeroPlan:
        updates = [op for op, _ in parameter_updates(state.graph) if op.role is Role.OPTIMIZER]
        if not updates:
            raise AutoparError(
                f"Strategy.zero_stage={self.stage}: the program has no optimizer update (sgd_, momentum_, adam_, adamw_)"
            )
        mesh_dim = data_parallel_dim(state, updates, self.stage, self.pipelined)
        edits = _Edits(state.propagation)
        decisions = [self._shard(state, op, mesh_dim, edits) for op in updates]
        override = edits.override(f"ZeRO stage {self.stage}")
        return ZeroPlan(self.stage, tuple(decisions), state.propagation.overridden(override), frozenset(edits.regather))

    def _shard(self, state: CompileState, op: OpNode, mesh_dim: int, edits: _Edits) -> ZeroShard:
        rule = get_rule(op.name)
        prop, graph = edits, state.graph
        param = op.inputs[0]
        result = prop.op_result(op.index)
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
        edits.op_results[op.index] = RuleResult(inputs, outputs, result.conflicts)
        edits.drop.update(ReshardSite(SiteKind.BEFORE_READ, op.index, i) for i in like)
        for i in like:
            key = op.inputs[i]
            if graph.values[key].kind == "state":
                edits.states[key] = ValueState(sharded, Priority.STRATEGY, f"zero stage {self.stage}")
        for key, dist in zip(op.outputs, outputs):
            if key is not None and dist is not None:
                edits.states[key] = dataclasses.replace(prop.state(key), dist=dist)
        self._gradient(state, op, grad, sharded, edits)
        on_sub_meshes = self.stage == 3 and _read_on_sub_meshes(edits, graph, param, op.index, whole.mesh)
        if self.stage == 3 and not on_sub_meshes:  # the parameter is stored as its shard; its other readers gather it
            self._move(state, param, sharded, op.index, edits)
            edits.regather.add(param)
        else:
            self._write_back(state, op, param, sharded, edits)
        how = "stage 3, stored whole: read on sub-meshes as it is (autopar.local_map)" if on_sub_meshes else f"stage {self.stage}"
        return ZeroShard(param, label, op.index, whole, sharded, how, op.inputs[grad])

    def _gradient(self, state: CompileState, op: OpNode, slot: int, sharded: DistAttr, edits: _Edits) -> None:
        """Stage 1: the gradient stays whole until the update, which reads its shard (a
        reduce_scatter there, where the gradient is partial). Stages 2 and 3: the gradient
        is resharded right after the op that makes it, so only its shard outlives it."""
        prop, key = edits, op.inputs[slot]
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

    def _write_back(self, state: CompileState, op: OpNode, param: ValueKey, sharded: DistAttr, edits: _Edits) -> None:
        """Stages 1 and 2: the update reads its shard of the whole parameter and the updated
        shards are gathered back into it."""
        stored = edits.dist(param)
        edits.added.append(ReshardNeed(ReshardSite(SiteKind.BEFORE_READ, op.index, 0), param, stored, sharded))
        updated = op.outputs[0]
        edits.added.append(ReshardNeed(ReshardSite(SiteKind.WRITE_BACK, op.index, 0), updated, sharded, stored))

    def _move(self, state: CompileState, key: ValueKey, placement: DistAttr, skip: int, edits: _Edits) -> None:
        """``key`` now lies as ``placement``: every reader but op ``skip`` (the update, which
        reads it so) reshards it to what it reads (stage-3 parameters: an all_gather)."""
        prop, graph = edits, state.graph
        old = prop.dist(key)
        edits.states[key] = ValueState(placement, Priority.STRATEGY, f"zero stage {self.stage}")
        readers = [r for r in dict.fromkeys(graph.values[key].users) if r != skip and r in prop.base.op_results]
        sites = {
            ReshardSite(SiteKind.BEFORE_READ, r, slot)
            for r in readers
            for slot, k in enumerate(graph.ops[r].inputs)
            if k == key
        }
        edits.drop.update(sites)
        for site in sorted(sites, key=lambda s: (s.op, s.slot)):
            need = prop.op_result(site.op).inputs[site.slot] or old
            if need != placement:
                edits.added.append(ReshardNeed(site, key, placement, need))


def _read_on_sub_meshes(edits: _Edits, graph, param: ValueKey, update: int, mesh) -> bool:
    """Whether an op other than ``update`` reads ``param`` on a sub-mesh of ``mesh`` (the copies
    of an ``autopar.local_map`` reading a parameter every copy shares). Such a read is a view of
    the whole parameter; a stage-3 shard would need a gather on the mesh whose ranks read it on
    different copies, so the parameter stays whole between steps (its states and gradient are
    still sharded, as at stage 2)."""
    for reader in dict.fromkeys(graph.values[param].users):
        if reader == update or reader not in edits.base.op_results:
            continue
        needs = edits.op_result(reader).inputs
        if any(k == param and d is not None and d.mesh != mesh for k, d in zip(graph.ops[reader].inputs, needs)):
            return True
    return False


@dataclass
class _Edits:
    """ZeRO's placements while it decides them: read through to the analysis' propagation
    (``base``) where it has not decided yet; made into one :class:`PlacementOverride` at the
    end (its needs applied in one pass: filtering per parameter made planning quadratic)."""

    base: PropagationResult
    states: dict[ValueKey, ValueState] = field(default_factory=dict)
    op_results: dict[int, RuleResult] = field(default_factory=dict)
    drop: set[ReshardSite] = field(default_factory=set)  # sites whose planned needs go
    drop_after_producer: set[ValueKey] = field(default_factory=set)  # values resharded after their producer no more
    added: list[ReshardNeed] = field(default_factory=list)
    regather: set[ValueKey] = field(default_factory=set)  # stage-3 parameters, gathered again for the backward

    def state(self, key: ValueKey) -> ValueState:
        found = self.states.get(key)
        return found if found is not None else self.base.states[key]

    def dist(self, key: ValueKey) -> DistAttr:
        return self.state(key).dist

    def made(self, key: ValueKey) -> DistAttr:
        found = self.base.produced.get(key)
        return found if found is not None else self.dist(key)

    def op_result(self, index: int) -> RuleResult:
        found = self.op_results.get(index)
        return found if found is not None else self.base.op_results[index]

    def override(self, reason: str) -> PlacementOverride:
        return PlacementOverride(
            reason, self.states, self.op_results, frozenset(self.drop), frozenset(self.drop_after_producer), tuple(self.added)
        )


def data_parallel_dim(state: CompileState, updates: list[OpNode], stage: int, pipelined: bool) -> int:
    """The mesh dim named ``dp``; else the only dim of a 1-d mesh; else the one mesh dim every
    partial gradient is pending over."""
    mesh = state.mesh
    if "dp" in mesh.dim_names:
        return mesh.dim_names.index("dp")
    if mesh.ndim == 1:
        if pipelined:
            raise AutoparError(
                f"Strategy.zero_stage={stage}: {mesh}'s only dim carries the pipeline stages; "
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
        f"Strategy.zero_stage={stage}: cannot tell which dim of {mesh} is data parallel "
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
