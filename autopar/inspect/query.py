"""``dist.decisions``: what compile decided, as values — the public query API (stage: inspection).

The command line, ``autopar/inspect/`` and the README ask these questions through this module
only, never the compile state: per value (its placement, who decided it and where it is made),
per reshard (what moved, which collectives, why, bytes, time), and per strategy feature (the
pipeline's stages, schedule and shared parameters; ZeRO's shards; sequence parallelism's
regions; recompute's rewrite). Every answer is a frozen value or a tuple of them.

    d = dist.decisions
    d.value("linear_0.w_0")          # ValueDecision: placement [R,S(0)], decided by "user annotation"
    [r for r in d.reshards() if r.kinds == ("all_gather",)]
    d.pipeline().shared              # parameters read on several stages: owner and copies
    d.zero(), d.sequence(), d.recompute()
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh


@dataclass(frozen=True, slots=True)
class ValueDecision:
    """One serial value: its placement (``produced``: what its op makes, when an annotation
    reshards it right after), who decided it (``decided_by``: "user annotation", "strategy",
    the rule of an op, "default", "cost model: ..."), and where it is made."""

    key: ValueKey
    label: str  # as the user knows it: a name, ``grad(W) %12.1``, ``%7.0``
    kind: str  # "parameter", "feed", "state", "activation", "constant"
    shape: tuple[int, ...]
    dtype: str
    placement: DistAttr
    produced: DistAttr
    decided_by: str
    producer: str  # the op making it, e.g. "pd_op.matmul#8"
    layer: str  # the layer path of its producer ("" when none is known)


@dataclass(frozen=True, slots=True)
class ReshardDecision:
    """A value moved from one placement to another: where, by which steps, why, at what price."""

    index: int
    key: ValueKey
    value: str
    op: str  # the op the reshard serves (its reader; its producer for an after-producer site)
    op_index: int
    site: str  # "before read", "after producer", "write back", "refresh"
    have: DistAttr
    need: DistAttr
    kinds: tuple[str, ...]  # the planned steps, e.g. ("all_reduce",), ("slice",), ("send_recv",)
    bytes: int
    time: float
    reason: str
    shared_with: int | None  # an earlier reshard whose result this one reuses


@dataclass(frozen=True, slots=True)
class SharedParameterDecision:
    """A parameter read on several pipeline stages: updated on ``owner``, copied to ``copies``
    once per step (empty when it is sharded: the others receive it at each read)."""

    name: str
    owner: ProcessMesh
    readers: tuple[ProcessMesh, ...]
    copies: tuple[ProcessMesh, ...]


@dataclass(frozen=True, slots=True)
class PipelineDecision:
    """Stages and schedule: ``meshes`` the pipeline ranks' sub-meshes, ``stages`` each stage's
    mesh index, ``actions`` each pipeline rank's verified actions (send / recv included)."""

    meshes: tuple[ProcessMesh, ...]
    stages: tuple[int, ...]
    micro_batches: int
    schedule: str
    actions: tuple[tuple[Any, ...], ...]
    shared: tuple[SharedParameterDecision, ...]


class Decisions:
    """The query API of one DistributedProgram (``dist.decisions``); see the module docstring."""

    def __init__(self, dist: Any, state: Any) -> None:
        """``state``: what compile decided for ``dist`` (its CompileState; only this API reads it)."""
        self._dist = dist
        self._state = state

    # ---- the program as analysed ---------------------------------------------------------
    @property
    def graph(self) -> ProgramGraph:
        """The analysed serial program's graph view (ops with roles and layers, values with
        shapes): read it, never edit it."""
        return self._state.graph

    @property
    def program(self) -> Any:
        """The serial program compile analysed (recompute's rewrite of yours, when it applies)."""
        return self._state.graph.program

    @property
    def cluster(self) -> Any:
        """The cost model's cluster the plan was priced on."""
        return self._state.cluster

    def label(self, key: ValueKey) -> str:
        """A value as the user knows it (``grad(W) %12.1``, ``updated W``, names)."""
        return self._state.label(key)

    # ---- values ------------------------------------------------------------------------
    def value(self, item: Any) -> ValueDecision:
        """The decision for a Value of the serial program, a name, or a value key."""
        key = item if isinstance(item, tuple) else self._dist.key(item)
        return self._value(key)

    def placement(self, item: Any) -> DistAttr:
        """A value's final placement (``value(item).placement``, without the rest)."""
        key = item if isinstance(item, tuple) else self._dist.key(item)
        return self._state.propagation.dist(key)

    def values(self, kinds: tuple[str, ...] = ()) -> Iterator[ValueDecision]:
        """Every placed value (of ``kinds`` when given), in program order."""
        for key in self._state.graph.tensor_keys():
            if key in self._state.propagation.states and (not kinds or self._state.graph.values[key].kind in kinds):
                yield self._value(key)

    def _value(self, key: ValueKey) -> ValueDecision:
        from autopar.causes import layer_of

        graph, propagation = self._state.graph, self._state.propagation
        value, state = graph.values[key], propagation.states[key]
        decided = {"user": "user annotation", "strategy": "strategy", "default": "default"}.get(state.source, state.source)
        return ValueDecision(
            key, self.label(key), value.kind, tuple(value.shape), value.dtype, state.dist, propagation.made(key), decided,
            str(graph.ops[key[0]]), layer_of(graph, key[0]),
        )  # fmt: skip

    # ---- communication -----------------------------------------------------------------
    def reshards(self) -> tuple[ReshardDecision, ...]:
        """Every planned reshard, in plan order."""
        out = []
        for planned in self._state.reshards:
            need = planned.need
            out.append(ReshardDecision(
                planned.index, need.value, self.label(need.value), str(self._state.graph.ops[need.op]), need.op,
                need.site.kind.value, need.have, need.need, tuple(step.kind.value for step in planned.plan.steps),
                planned.plan.bytes, planned.plan.time, planned.reason, planned.shared_with,
            ))  # fmt: skip
        return tuple(out)

    def collectives(self, rank: int) -> list[Any]:
        """``rank``'s collectives in program order (``dist.comm_ops(rank)``)."""
        return self._dist.comm_ops(rank)

    # ---- strategy features -------------------------------------------------------------
    def pipeline(self) -> PipelineDecision | None:
        plan = self._state.pipeline
        if plan is None:
            return None
        return PipelineDecision(
            plan.meshes, plan.stages, plan.micro_batches, plan.schedule_name,
            tuple(tuple(plan.actions[r]) for r in range(len(plan.meshes))), self._shared(),
        )  # fmt: skip

    def _shared(self) -> tuple[SharedParameterDecision, ...]:
        from autopar.causes import updates
        from autopar.shared_parameters import reader_meshes

        graph, propagation = self._state.graph, self._state.propagation
        out = []
        for update, _ in updates(graph):
            param = update.inputs[0]
            readers = reader_meshes(graph, param, propagation.op_meshes)
            if len(readers) < 2:
                continue
            owner = propagation.op_meshes.get(update.index, readers[0])
            whole = not (propagation.dist(param).sharded_mesh_dims() or propagation.dist(param).partial)
            copies = tuple(m for m in readers if m != owner) if whole else ()
            out.append(SharedParameterDecision(graph.values[param].label, owner, tuple(readers), copies))
        return tuple(out)

    def zero(self) -> tuple[Any, ...]:
        """ZeRO's decision per parameter update (:class:`~autopar.passes.zero_sharding.ZeroShard`:
        the shard placement, or why it stays whole); empty without ZeRO."""
        return tuple(self._state.zero)

    def sequence(self) -> Any:
        """Sequence parallelism's regions (:class:`~autopar.rewrites.sequence_parallel.SequenceRegions`),
        or None."""
        return self._state.sequence

    def rewrites(self) -> tuple[tuple[str, str], ...]:
        """Each serial rewrite that ran (:mod:`autopar.rewrites`) and its one-line report, in order."""
        return tuple(self._state.rewrites)

    def recompute(self) -> Any:
        """Recompute's rewrite and report (:class:`~autopar.rewrites.recompute.Recomputation`: ``print``
        it), or None."""
        return self._state.recompute
