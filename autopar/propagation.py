"""Sharding propagation: a placement for every value of the program (stage: propagate).

Two phases, both deterministic (program order, no set iteration):

1. **Fixed point** over the graph, forward and backward, to decide the placement of every
   *source* tensor (parameters, feeds, optimizer states) and seed the rest. Each value's
   state carries a priority: ``USER`` (annotation) > ``DERIVED`` (a rule produced it from
   known inputs, or inferred it back from known outputs) > ``REQUIRED`` (a consumer needs it
   so, and nothing better is known) > ``DEFAULT`` (replicated on the op's mesh). A state is
   only replaced by a strictly higher priority, so the iteration terminates.
2. **Materialization** walks the ops once in order: each op's rule, given its inputs' final
   placements, says which placement it needs for each input (a reshard where it differs) and
   which it produces. Outputs take what their op produces — except user-annotated values,
   which keep the annotation (a reshard right after the producer).

Every place where placements compete is recorded as a conflict (op, values, candidates,
resolution): a rule's merge disagreement, a user annotation that differs from what its
producer makes, a source tensor whose consumers need different placements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import VECTOR_OPS, OpNode, ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.op_kinds import SOURCE_OPS
from autopar.propagation_result import (
    ConflictRecord,
    PlacementOverride,
    Priority,
    PropagationResult,
    ReshardNeed,
    ReshardSite,
    SiteKind,
    ValueState,
    frozen_result,
)
from autopar.spmd import Conflict, RuleContext, RuleResult, TensorSpec, get_rule
from autopar.sub_meshes import find_views, restricted, value_meshes, view_result

__all__ = [
    "ConflictRecord", "PlacementOverride", "Priority", "PropagationResult", "Propagator", "ReshardNeed", "ReshardSite",
    "SiteKind", "ValueState", "propagate", "transplant",
]  # fmt: skip


@dataclass
class _Draft:
    """The result as materialization builds it, in place; :func:`propagate` freezes the last one."""

    states: dict[ValueKey, ValueState]
    op_results: dict[int, RuleResult] = field(default_factory=dict)
    op_meshes: dict[int, ProcessMesh] = field(default_factory=dict)
    conflicts: list[ConflictRecord] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    reshards: list[ReshardNeed] = field(default_factory=list)


@contextlib.contextmanager
def _rule_errors(op: OpNode, rule: Any, specs: list[TensorSpec | None]) -> Iterator[None]:
    """A rule that breaks (a bug, or an op form it does not know) is named with its op and inputs."""
    try:
        yield
    except AutoparError:
        raise
    except Exception as err:  # noqa: BLE001  (any rule failure becomes a user-facing error)
        shapes = ", ".join("absent" if s is None else f"{list(s.shape)} {s.dist or '?'}" for s in specs)
        raise AutoparError(
            f"the SPMD rule {type(rule).__name__} failed on {op} (inputs: {shapes}; attrs: "
            f"{ {k: v for k, v in op.attrs.items() if k != 'op_callstack'} }): {type(err).__name__}: {err}"
        ) from err


def transplant(dist: DistAttr, mesh: ProcessMesh) -> DistAttr | None:
    """``dist`` re-expressed on ``mesh`` by mesh dim name (a stage's tensor read on another)."""
    if dist.mesh is mesh or dist.mesh == mesh:
        return dist
    return _transplanted(dist, mesh)


@functools.lru_cache(maxsize=1 << 14)
def _transplanted(dist: DistAttr, mesh: ProcessMesh) -> DistAttr:
    """(Cached: every read across a stage boundary asks, and the layers of a pipeline repeat.)"""
    same = {
        d: mesh.dim_names.index(name)
        for d, name in enumerate(dist.mesh.dim_names)
        if name in mesh.dim_names and mesh.dim_size(name) == dist.mesh.shape[d]
    }
    mapping = [tuple(same[d] for d in dims if d in same) for dims in dist.mapping]  # split order kept
    partial = {same[d]: k for d, k in dist.partial if d in same}
    return DistAttr(mesh, mapping, partial)


class Propagator:
    """Runs both phases over one graph; see the module docstring."""

    def __init__(
        self,
        graph: ProgramGraph,
        mesh: ProcessMesh,
        user: dict[ValueKey, DistAttr],
        op_meshes: dict[int, ProcessMesh],
        cluster: Any = None,
        strategy: dict[ValueKey, DistAttr] | None = None,
    ) -> None:
        self.graph = graph
        self.mesh = mesh
        self.user_op_meshes = op_meshes
        self.cluster = cluster
        self.states: dict[ValueKey, ValueState] = {k: ValueState(d, Priority.STRATEGY, "strategy") for k, d in (strategy or {}).items()}
        self.states.update({k: ValueState(d, Priority.USER, "user") for k, d in user.items()})
        self.ops = [op for op in graph.ops if op.name not in VECTOR_OPS and op.name not in SOURCE_OPS]
        self.views = find_views(graph, mesh, value_meshes(graph, mesh, user, op_meshes), op_meshes)  # splits / joins between the mesh and its sub-meshes
        self.choice_reasons: dict[ValueKey, str] = {}
        self._memo: dict[tuple, RuleResult] = {}
        self._attrs_keys: dict[int, tuple] = {}

    # ---- shared pieces ---------------------------------------------------------------
    def op_mesh(self, op: OpNode) -> ProcessMesh:
        """Annotated mesh; else the forward op's (grad ops); else the first known input's."""
        if op.index in self.user_op_meshes:
            return self.user_op_meshes[op.index]
        if op.forward_op is not None:
            return self.op_mesh(self.graph.ops[op.forward_op])
        for key in op.inputs:
            state = self.states.get(key) if key is not None else None
            if state is not None and self.graph.values[key].kind not in ("constant",):
                return state.dist.mesh
        return self.mesh

    def specs(self, op: OpNode, mesh: ProcessMesh) -> list[TensorSpec | None]:
        out: list[TensorSpec | None] = []
        for key in op.inputs:
            if key is None:
                out.append(None)
                continue
            value = self.graph.values[key]
            state = self.states.get(key)
            dist = transplant(state.dist, mesh) if state is not None else None
            out.append(TensorSpec(value.shape, dist, value.dtype, int(state.priority) if state else 0))
        return out

    def infer(self, op: OpNode, mesh: ProcessMesh, specs: list[TensorSpec | None]) -> RuleResult | None:
        """The op's rule on ``specs``. Rules are pure functions of (specs, attrs, mesh, which
        outputs are read), so results are memoized: the layers of a deep model repeat."""
        view = self.views.get(op.index)
        if view is not None:
            return self._view(op)
        rule = get_rule(op.name)
        if rule is None:
            return None
        key = (op.name, tuple(specs), self._attrs_key(op), self._live(op), mesh)
        found = self._memo.get(key)
        if found is None:
            with _rule_errors(op, rule, specs):
                found = self._memo[key] = rule.infer_forward(specs, op.attrs, self.context(op, mesh))
        return found

    def _view(self, op: OpNode) -> RuleResult:
        """A view's placements (autopar/sub_meshes.py): replicated on the mesh while nothing
        around it is known."""
        keys = [k for k in (*op.inputs, *op.outputs) if k is not None and k in self.states]
        found = view_result(self.views[op.index], op, self.mesh, {k: self.states[k].dist for k in keys})
        return found if found is not None else self.replicated(op, self.mesh)

    def _attrs_key(self, op: OpNode) -> tuple:
        found = self._attrs_keys.get(op.index)
        if found is None:
            found = self._attrs_keys[op.index] = tuple(sorted((k, repr(v)) for k, v in op.attrs.items()))
        return found

    def _live(self, op: OpNode) -> tuple[bool, ...]:
        return tuple(k is not None and bool(self.graph.values[k].users) for k in op.outputs)

    def context(self, op: OpNode, mesh: ProcessMesh) -> RuleContext:
        """Rule context; with a cluster, competing splits are settled by the cost model."""
        live = self._live(op)
        if self.cluster is None:
            return RuleContext(mesh, op_name=op.name, live_outputs=live)
        from autopar.cost_model import make_resolver

        cluster = self.cluster

        def factory(equation: str, specs: Any, op_mesh: ProcessMesh) -> Any:
            return make_resolver(equation, specs, op_mesh, cluster)

        return RuleContext(mesh, op_name=op.name, resolver_factory=factory, live_outputs=live)

    def replicated(self, op: OpNode, mesh: ProcessMesh) -> RuleResult:
        """An op without a rule runs whole on every rank of its mesh."""

        def whole(key: ValueKey | None) -> DistAttr | None:
            return None if key is None else DistAttr.replicated(mesh, len(self.graph.values[key].shape))

        return RuleResult(tuple(map(whole, op.inputs)), tuple(map(whole, op.outputs)))

    def _informative(self, op: OpNode) -> list[ValueKey]:
        return [k for k in op.inputs if k is not None and self.graph.values[k].kind != "constant"]

    def propose(self, key: ValueKey, dist: DistAttr | None, priority: Priority, source: Any, suffix: str = "") -> bool:
        """Record ``dist`` for ``key`` if it outranks what is known; ``source`` (an op, named
        only when it wins) + ``suffix`` says who decided."""
        if dist is None or self.graph.values[key].kind == "vector":
            return False
        state = self.states.get(key)
        if state is not None and (priority <= state.priority or state.dist == dist):
            return False
        self.states[key] = ValueState(dist, priority, f"{source}{suffix}")
        return True

    # ---- phase 1: fixed point --------------------------------------------------------
    def fixed_point(self, max_rounds: int = 50) -> int:
        dirty_fwd = {op.index for op in self.ops}
        dirty_bwd = set(dirty_fwd)
        for rounds in range(1, max_rounds + 1):
            changed: set[ValueKey] = set()
            for op in self.ops:
                if op.index in dirty_fwd:
                    changed |= self.forward_step(op)
            for op in reversed(self.ops):
                if op.index in dirty_bwd:
                    changed |= self.backward_step(op)
            if not changed:
                return rounds
            dirty_fwd = {u for k in changed for u in self.graph.values[k].users}
            dirty_fwd |= {k[0] for k in changed}
            dirty_bwd = {k[0] for k in changed} | dirty_fwd
        return max_rounds

    def forward_step(self, op: OpNode) -> set[ValueKey]:
        informative = self._informative(op)
        if informative and not any(k in self.states for k in informative):
            return set()
        mesh = self.op_mesh(op)
        result = self.infer(op, mesh, self.specs(op, mesh))
        if result is None:
            result = self.replicated(op, mesh)
        changed = set()
        for key, dist in zip(op.outputs, result.outputs):
            if key is not None and self.propose(key, dist, Priority.DERIVED, op):
                changed.add(key)
        for key, dist in zip(op.inputs, result.inputs):
            if key is not None and self.propose(key, self._lifted(key, _complete(dist)), Priority.REQUIRED, op):
                changed.add(key)
        return changed

    def _lifted(self, key: ValueKey, dist: DistAttr | None) -> DistAttr | None:
        """A source read on several sub-meshes (a parameter every copy of a local_map reads) is
        held by the mesh: a requirement of one reader is re-expressed there."""
        if dist is None or not self.views or dist.mesh == self.mesh or self.graph.values[key].kind not in ("parameter", "feed", "state"):
            return dist
        readers = {self.op_mesh(self.graph.ops[u]) for u in self.graph.values[key].users}
        return transplant(dist, self.mesh) if len(readers) > 1 else dist

    def backward_step(self, op: OpNode) -> set[ValueKey]:
        outs = [self.states.get(k) if k is not None else None for k in op.outputs]
        known = [s for s in outs if s is not None]
        if not known or (get_rule(op.name) is None and op.index not in self.views):
            return set()
        if all(k in self.states and self.states[k].priority >= Priority.DERIVED for k in self._informative(op)):
            return set()
        mesh = self.op_mesh(op)
        level = Priority.DERIVED if any(s.priority >= Priority.DERIVED for s in known) else Priority.REQUIRED
        out_specs = [
            TensorSpec(self.graph.values[k].shape, transplant(s.dist, mesh), self.graph.values[k].dtype, int(s.priority))
            if s is not None
            else (TensorSpec(self.graph.values[k].shape) if k is not None else None)
            for k, s in zip(op.outputs, outs)
        ]
        if op.index in self.views:
            result = self._view(op)
            return {k for k, d in zip(op.inputs, result.inputs) if k is not None and self.propose(k, _complete(d), level, op, " (a view)")}
        rule, specs = get_rule(op.name), self.specs(op, mesh)
        key = ("backward", op.name, tuple(specs), tuple(out_specs), self._attrs_key(op), self._live(op), mesh)
        result = self._memo.get(key)
        if result is None:
            with _rule_errors(op, rule, specs):
                result = self._memo[key] = rule.infer_backward(specs, out_specs, op.attrs, self.context(op, mesh))
        changed = set()
        for key, dist in zip(op.inputs, result.inputs):
            if key is not None and self.graph.values[key].kind != "constant":
                if self.propose(key, self._lifted(key, _complete(dist)), level, op, " (from its outputs)"):
                    changed.add(key)
        return changed

    def seed_defaults(self) -> bool:
        """Sources nothing decided: replicated on the mesh of their first consumer."""
        seeded = False
        for key, value in self.graph.values.items():
            op = self.graph.ops[key[0]]
            if key in self.states or value.kind == "vector" or (op.name not in SOURCE_OPS and op.inputs):
                continue
            users = value.users
            mesh = self.op_mesh(self.graph.ops[users[0]]) if users else self.user_op_meshes.get(op.index, self.mesh)
            if self.views and len({self.op_mesh(self.graph.ops[u]) for u in users}) > 1:
                mesh = self.mesh  # read on several sub-meshes (each copy of a local_map): held by the mesh
            self.states[key] = ValueState(DistAttr.replicated(mesh, len(value.shape)), Priority.DEFAULT, "default")
            seeded = True
        return seeded

    # ---- phase 2: materialization ----------------------------------------------------
    def materialize(self) -> _Draft:
        result = _Draft(self.states)
        reduced: dict[ValueKey, DistAttr] = {}  # partial values an earlier read made complete
        for op in self.ops:
            mesh = self.op_mesh(op)
            result.op_meshes[op.index] = mesh
            specs = self.specs(op, mesh)
            inferred = self.infer(op, mesh, specs)
            if inferred is None:
                result.unsupported.append(str(op))
                inferred = self.replicated(op, mesh)
            elif op.index not in self.views:
                inferred = self._read_reduced(op, mesh, specs, inferred, reduced)
                inferred = self._toward_fixed_outputs(op, mesh, specs, inferred)
            result.op_results[op.index] = inferred
            self._record_rule_conflicts(result, op, inferred.conflicts)
            self._settle_outputs(result, op, inferred)
            for pos, (key, need) in enumerate(zip(op.inputs, inferred.inputs)):
                if key is None or need is None:
                    continue
                have = self.states[key].dist
                if have.mesh != need.mesh and self.views:  # a value of the mesh read on a sub-mesh holding it as it is
                    have = restricted(have, need.mesh) or have
                if have != need:
                    result.reshards.append(ReshardNeed(ReshardSite(SiteKind.BEFORE_READ, op.index, pos), key, have, need))
                    if _only_reduces(have, need):
                        reduced.setdefault(key, need)
        self._record_source_conflicts(result)
        return result

    def _read_reduced(
        self, op: OpNode, mesh: ProcessMesh, specs: list[TensorSpec | None], inferred: RuleResult,
        reduced: dict[ValueKey, DistAttr],
    ) -> RuleResult:  # fmt: skip
        """Read the complete copy of a partial value that an earlier read already reduces.

        Data parallelism with global-norm clipping reads each partial gradient twice: the norm
        needs it complete (an all_reduce before its read), the ``multiply`` by the clip factor
        would take it partial and pass the pending sum on to the optimizer (a second
        all_reduce). Once a reduction of the value is planned, a later reader that accepts the
        value partial is offered the reduced copy instead: the same local shape, no new
        collective (the planner shares the earlier reshard), and its result needs no reduction
        downstream. Kept only where the rule takes the copy as offered and its results carry
        fewer pending reductions (a reader of the value's shape only is left as it is).
        """
        offered = list(specs)
        changed = False
        for pos, key in enumerate(op.inputs):
            spec = specs[pos]
            whole = reduced.get(key) if key is not None else None
            if whole is None or spec is None or spec.dist is None or whole.mesh != mesh:
                continue
            if inferred.inputs[pos] == spec.dist and _only_reduces(spec.dist, whole):
                offered[pos] = dataclasses.replace(spec, dist=whole)
                changed = True
        if not changed:
            return inferred
        again = self.infer(op, mesh, offered)
        taken = all(again.inputs[pos] == offered[pos].dist for pos in range(len(offered)) if offered[pos] is not specs[pos])
        return again if taken and _fewer_pending(inferred.outputs, again.outputs) else inferred

    def _toward_fixed_outputs(
        self, op: OpNode, mesh: ProcessMesh, specs: list[TensorSpec | None], inferred: RuleResult,
    ) -> RuleResult:  # fmt: skip
        """Reshard the inputs instead of the output where an output's placement is fixed.

        An annotated output the rule does not produce is resharded after the producer. The
        rule read its inputs without knowing that: a row-parallel output's pending sum, read
        whole by a bias add whose result is annotated split along the sequence, would be
        all-reduced and then sliced — where a reduce_scatter of the input gives the annotated
        placement directly. The rule's backward inference says which inputs make the fixed
        outputs; that reading is kept unless the cost model prices its reshards above the first
        reading's plus the output's (by time, then by ring bytes; a full tie goes to the direct
        reading).
        """
        fixed = [self.states.get(k) if k is not None else None for k in op.outputs]
        wanted = [s.dist if s is not None and s.priority.fixed else None for s in fixed]
        rule = get_rule(op.name)
        free = rule.free_outputs
        if (self.cluster is None and not free) or not any(w is not None and w != p for w, p in zip(wanted, inferred.outputs)):
            return inferred
        out_specs = [
            None if k is None else TensorSpec(self.graph.values[k].shape, transplant(w, mesh) if w is not None else None, self.graph.values[k].dtype)
            for k, w in zip(op.outputs, wanted)
        ]  # fmt: skip
        with _rule_errors(op, rule, specs):
            backward = rule.infer_backward(specs, out_specs, op.attrs, self.context(op, mesh))
        if free and backward.inputs == inferred.inputs:  # it makes the fixed outputs from what it reads: no reshard
            return dataclasses.replace(inferred, outputs=tuple(b if w is not None else o for b, w, o in zip(backward.outputs, wanted, inferred.outputs)))
        if self.cluster is None:
            return inferred
        needs = backward.inputs
        offered = [s if s is None or n is None else dataclasses.replace(s, dist=n) for s, n in zip(specs, needs)]
        again = self.infer(op, mesh, offered)
        if again is None or any(o is not None and a != o.dist for a, o in zip(again.inputs, offered)):
            return inferred
        return again if self._reshard_cost(op, specs, again, wanted) <= self._reshard_cost(op, specs, inferred, wanted) else inferred

    def _reshard_cost(self, op: OpNode, specs: list[TensorSpec | None], inferred: RuleResult, wanted: list[DistAttr | None]) -> tuple[float, float]:
        """Predicted time, then ring bytes, of the reshards an op's reading and its fixed outputs
        need (bytes break ties of time: gloo prices a reduce_scatter as an all_reduce)."""
        from autopar.cost_model import plan_reshard
        from autopar.cost_model.comm import coefficients

        pairs = [(s.dist, n, s.shape, s.dtype) for s, n in zip(specs, inferred.inputs) if s is not None and n is not None and s.dist != n]
        for key, made, want in zip(op.outputs, inferred.outputs, wanted):
            if key is not None and made is not None and want is not None and made != want:
                pairs.append((made, want, self.graph.values[key].shape, self.graph.values[key].dtype))
        plans = [plan_reshard(have, need, shape, dtype, self.cluster) for have, need, shape, dtype in pairs]
        time = sum(plan.time for plan in plans)
        volume = sum(
            coefficients(str(step.kind), len(step.groups[0]), step.bytes)[1]
            for plan in plans for step in plan.steps if not step.kind.is_local and step.groups
        )  # (a transfer between meshes has no group of one mesh: its time is priced, not its ring volume)
        return time, volume

    def _settle_outputs(self, result: _Draft, op: OpNode, inferred: RuleResult) -> None:
        for pos, (key, produced) in enumerate(zip(op.outputs, inferred.outputs)):
            if key is None or produced is None or self.graph.values[key].kind == "vector":
                continue
            state = self.states.get(key)
            if state is not None and state.priority.fixed:
                if state.dist != produced:
                    site = ReshardSite(SiteKind.AFTER_PRODUCER, op.index, pos)
                    result.reshards.append(ReshardNeed(site, key, produced, state.dist))
                    result.conflicts.append(
                        ConflictRecord(
                            str(op), (self.graph.values[key].label,),
                            (("rule", str(produced)), (f"{state.source} annotation", str(state.dist))),
                            str(state.dist), f"{state.source} annotation wins; reshard after the producer",
                        )
                    )  # fmt: skip
                continue
            self.states[key] = ValueState(produced, Priority.DERIVED, str(op))

    def _record_rule_conflicts(self, result: _Draft, op: OpNode, conflicts: tuple[Conflict, ...]) -> None:
        names = tuple(self.graph.values[k].label for k in op.inputs if k is not None)
        for c in conflicts:
            result.conflicts.append(ConflictRecord(str(op), names, c.candidates, c.chosen, f"{c.where}: {c.reason}"))

    def competing_sources(self, result: _Draft) -> dict[ValueKey, list[tuple[str, DistAttr]]]:
        """Parameters / feeds / states whose consumers need different placements."""
        wants: dict[ValueKey, list[tuple[str, DistAttr]]] = {}
        for op_index, inferred in result.op_results.items():
            op = self.graph.ops[op_index]
            for key, need in zip(op.inputs, inferred.inputs):
                if key is not None and need is not None and self.graph.values[key].kind in ("parameter", "feed", "state"):
                    if self.views and need.mesh != self.mesh:  # a read on a sub-mesh: of the mesh's value, as it is there
                        need = transplant(need, self.mesh)
                    wants.setdefault(key, []).append((str(op), need))
        return {k: w for k, w in wants.items() if len({d for _, d in w}) > 1}

    def choose_sources(self, result: _Draft) -> bool:
        """Re-decide competing sources not fixed by the user: the cheapest placement wins."""
        if self.cluster is None:
            return False
        from autopar.cost_model import PlacementOption, choose_placement

        changed = False
        for key, wants in self.competing_sources(result).items():
            state = self.states[key]
            if state.priority.fixed:
                continue
            value = self.graph.values[key]
            candidates = list(dict.fromkeys(_complete(d) for _, d in wants))
            options = [
                PlacementOption(str(c), tuple((c, need, value.shape, value.dtype) for _, need in wants if need != c))
                for c in candidates
            ]
            choice = choose_placement(options, self.cluster)
            self.choice_reasons[key] = choice.reason
            if candidates[choice.index] != state.dist:
                self.states[key] = ValueState(candidates[choice.index], Priority.DERIVED, "cost model")
                changed = True
        return changed

    def align_inplace_states(self, result: _Draft) -> bool:
        """A persistable state an op updates in place (velocity, moments; a batch norm's running
        statistics, which are parameters) takes the placement that op needs: resharding it
        first would update a temporary copy and lose the update. (An update's own parameter
        follows the parameter instead: ZeRO writes its shard back.)"""
        changed = False
        in_place = [self.graph.ops[i] for i in result.op_results if self.graph.ops[i].short_name.endswith("_")]
        readers: dict[ValueKey, int] = {}
        for op in in_place:
            for key in set(op.inputs) - {None}:
                readers[key] = readers.get(key, 0) + 1
        for op_index, inferred in result.op_results.items():
            op = self.graph.ops[op_index]
            if not op.short_name.endswith("_"):
                continue
            kinds = ("state",) if op.role is Role.OPTIMIZER else ("state", "parameter")
            for key, need in zip(op.inputs, inferred.inputs):
                if key is None or need is None or self.graph.values[key].kind not in kinds:
                    continue
                if readers[key] > 1:  # read by several updates (the learning rate): updated by none of them
                    continue
                state = self.states[key]
                if state.dist == need:
                    continue
                if state.priority.fixed:
                    raise AutoparError(
                        f"{self.graph.values[key].label} is annotated {state.dist} ({state.source}) but {op} updates it in place "
                        f"as {need}; annotate it {need} (or leave it to propagation)"
                    )
                self.states[key] = ValueState(_complete(need), Priority.DERIVED, f"{op} (updated in place)")
                changed = True
        return changed

    def _record_source_conflicts(self, result: _Draft) -> None:
        """A parameter / feed / state whose consumers need different placements."""
        for key, wants in self.competing_sources(result).items():
            value = self.graph.values[key]
            state = self.states[key]
            how = self.choice_reasons.get(key) if not state.priority.fixed else None
            reason = how or f"decided by {state.source} ({state.priority.name.lower()})"
            result.conflicts.append(
                ConflictRecord(
                    "consumers of " + value.label, (value.label,),
                    tuple((who, str(d)) for who, d in wants),
                    str(state.dist), reason + "; the others reshard",
                )
            )  # fmt: skip


def _only_reduces(have: DistAttr, need: DistAttr) -> bool:
    """``need`` is ``have`` with some of its pending reductions done (same splits and mesh)."""
    return (
        have.mesh == need.mesh
        and have.mapping == need.mapping
        and bool(have.partial)
        and set(need.partial) < set(have.partial)
    )


def _fewer_pending(before: tuple[DistAttr | None, ...], after: tuple[DistAttr | None, ...]) -> bool:
    """``after`` drops pending reductions of ``before`` and adds none (same splits)."""
    pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
    return (
        all(b.mapping == a.mapping and set(a.partial) <= set(b.partial) for b, a in pairs)
        and any(set(a.partial) < set(b.partial) for b, a in pairs)
    )


def _complete(dist: DistAttr | None) -> DistAttr | None:
    """A requirement proposed to an unknown tensor never makes it partial."""
    return dist.with_partial(None) if dist is not None and dist.partial else dist


def propagate(
    graph: ProgramGraph,
    mesh: ProcessMesh,
    user: dict[ValueKey, DistAttr],
    op_meshes: dict[int, ProcessMesh] | None = None,
    cluster: Any = None,
    strategy: dict[ValueKey, DistAttr] | None = None,
) -> PropagationResult:
    """Placement of every value of ``graph``: see the module docstring.

    ``user``: the user's annotations; ``strategy``: annotations a Strategy pass made (lower
    priority: a user annotation of the same value wins).
    With a ``cluster`` (a cost_model profile), competing placements are settled by cost:
    inside a rule (which operand's split a dim takes) and for a source tensor whose
    consumers need different placements; without one, by the fixed priority order.
    """
    propagator = Propagator(graph, mesh, user, op_meshes or {}, cluster, strategy)
    rounds = propagator.fixed_point()
    if propagator.seed_defaults():
        rounds += propagator.fixed_point()
    result = propagator.materialize()
    for _ in range(8):  # each pass only moves sources to what their consumers need
        changed = propagator.choose_sources(result)
        if changed:
            result = propagator.materialize()
        if propagator.align_inplace_states(result):
            result, changed = propagator.materialize(), True
        if not changed:
            break
    return frozen_result(result.states, result.op_results, result.op_meshes, result.conflicts, result.unsupported, result.reshards, rounds)
