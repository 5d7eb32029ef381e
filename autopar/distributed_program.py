"""DistributedProgram: everything compile produced, queried by users and the runtime.

Rank-independent results are computed once by compile: the placement of every serial value,
the planned reshards and buckets (values), the compile report. Rank programs are built on
demand, one rank at a time, by the declared pass pipeline: :meth:`rank_plan` returns the
per-rank contract the runtime consumes, and caches it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.collective import Collective
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError, NativeUnsupported
from autopar.gc_pause import gc_paused
from autopar.graph import ProgramGraph, ValueKey
from autopar.index_feeds import index_uses
from autopar.learning_rate import LearningRateSchedule
from autopar.mesh import ProcessMesh
from autopar.passes.base import CompileState, PassPipeline, RankProgram
from autopar.propagation import ConflictRecord, PropagationResult, ReshardNeed
from autopar.rank_plan import PipelineRole, RankPlan, ValueInfo, ValueTable
from autopar.strategy import EffectiveStrategy, Strategy

if TYPE_CHECKING:
    from paddle.pir import Operation, Program

    from autopar.inspect.cost_report import CostReport
    from autopar.inspect.dump import DumpResult
    from autopar.inspect.query import Decisions
    from autopar.schedule import Action


@dataclass(frozen=True)
class CompileReport:
    """What a user should read after compile: conflicts, unsupported ops, reshards needed."""

    conflicts: list[ConflictRecord]  # (copies: the report is the user's to keep)
    unsupported_ops: list[str]
    reshards: list[ReshardNeed]
    rounds: int

    def __str__(self) -> str:
        lines = [f"propagation converged in {self.rounds} round(s)"]
        lines.append(f"ops without an SPMD rule (computed replicated): {len(self.unsupported_ops)}")
        lines += [f"  {name}" for name in self.unsupported_ops]
        lines.append(f"conflicts: {len(self.conflicts)}")
        lines += [f"  {c}" for c in self.conflicts]
        lines.append(
            f"reshards needed: {len(self.reshards)} (placement changes found by propagation; planning turns each "
            "into zero or more collectives or local slices, later reads share one, fusion packs gradients: "
            "the collectives list counts what runs)"
        )
        return "\n".join(lines)


class DistributedProgram:
    """The result of :func:`autopar.compile` (see DESIGN.md, public API contract)."""

    BACKENDS = ("host", "native", "auto")

    def __init__(
        self, program: Program, startup_program: Program | None, state: CompileState, pipeline: PassPipeline,
        effective: EffectiveStrategy | None = None,
    ) -> None:  # fmt: skip
        self.serial_program = program
        self.serial_startup_program = startup_program
        self.state = state
        self.pipeline = pipeline
        self._plans: dict[tuple[int, str, tuple], RankPlan] = {}
        self._lowered: dict[tuple[int, str, tuple], RankPlan] = {}  # as built, before link order (peers read them)
        self.mesh: ProcessMesh = state.mesh
        self.strategy: Strategy = state.strategy  # the one compile ran (see effective_strategy)
        self.effective_strategy = effective or EffectiveStrategy(state.strategy, state.strategy)  # the user's and what compile ran
        self.graph: ProgramGraph = state.graph
        self.propagation: PropagationResult = state.propagation

    @property
    def world_size(self) -> int:
        return self.mesh.size

    @property
    def report(self) -> CompileReport:
        p = self.propagation
        return CompileReport(list(p.conflicts), list(p.unsupported), list(p.reshards), p.rounds)

    @property
    def unavailable(self) -> str:
        """Why rank programs cannot be built (empty when they can)."""
        return self.state.unavailable

    @functools.cached_property
    def decisions(self) -> Decisions:
        """What compile decided, as values (:mod:`autopar.inspect.query`): per value, per
        reshard, per strategy feature. The public way to ask; the compile state is internal."""
        from autopar.inspect.query import Decisions

        return Decisions(self, self.state)

    @property
    def passes(self) -> PassPipeline:
        """The declared pass pipeline (``print(dist.passes)`` lists it with its options)."""
        return self.pipeline

    def key(self, name_or_value: Any) -> ValueKey:
        return self.values.key(name_or_value)

    @functools.cached_property
    def values(self) -> ValueTable:
        """Serial values as the runtime sees them (names, placements, shapes)."""
        graph, prop = self.graph, self.propagation
        orders = self._sequence_orders()
        infos = {
            key: ValueInfo(key, v.label, v.kind, tuple(v.shape), v.dtype, prop.dist(key), prop.made(key), orders.get(key))
            for key, v in graph.values.items()
            if key in prop.states
        }
        return ValueTable(graph.by_name, graph.key_of, infos, graph.removed, index_uses(graph))

    def _sequence_orders(self) -> dict[ValueKey, Any]:
        """``balance="zigzag"``: the values carrying the sequence in zig-zag order
        (:mod:`autopar.zigzag_values`), which fetches put back in serial order."""
        from autopar.zigzag_values import sequence_orders

        return sequence_orders(self.graph, self.state.zigzag)

    def dist_attr(self, name_or_value: Any) -> DistAttr | tuple[DistAttr, ...]:
        """Placement of a serial value (parameters, feeds and states also by name).

        A vector value (``builtin.combine`` / ``split`` plumbing) answers with its members'.
        """
        key = self.key(name_or_value)
        members = self.graph.vectors.get(key)
        if self.graph.values[key].kind == "vector" and members is not None:
            return tuple(self.propagation.dist(k) for k in members)
        return self.propagation.dist(key)

    def rank_plan(
        self, rank: int, backend: str = "host", after: str | None = None, fetches: Sequence[Any] = ()
    ) -> RankPlan:
        """The per-rank contract for ``backend`` ("host", "native", or "auto": native on GPUs, and
        on CPU when every collective spans the world, unless the native backend cannot run the
        plan — then host), built on first use and cached. ``fetches`` (values or
        names): made whole on every rank at the end of the step, inside the program, so the
        runtime reads them without an exchange. ``after``: the program as it is after the pass
        of that name (not cached; for dumps)."""
        if backend not in self.BACKENDS:
            raise AutoparError(f"unknown backend {backend!r}; expected one of {self.BACKENDS}")
        keys = tuple(item if isinstance(item, tuple) and item in self.values else self.key(item) for item in fetches)
        if backend == "auto":
            from autopar.runtime.device import current_device

            on_gpu = current_device().kind == "gpu"  # NCCL runs sub-groups in the program
            if not (on_gpu or self.collectives_span_world):
                return self.rank_plan(rank, "host", after, keys)
            try:
                return self.rank_plan(rank, "native", after, keys)
            except NativeUnsupported:  # (a pipeline, uneven pieces to gather): the host backend runs any plan
                return self.rank_plan(rank, "host", after, keys)
        if after is not None:
            return self._build_plan(self.build_rank(rank, backend, after, keys), backend)
        cached = self._plans.get((rank, backend, keys))
        if cached is None:
            with gc_paused():
                cached = self._lowered_plan(rank, backend, keys)
                if cached.pipeline is not None:  # its recvs in the order its links carry them: its peers' sends
                    peers = {p: self._lowered_plan(p, backend, keys).pipeline.steps for p in cached.pipeline.peers if p != rank}
                    cached = cached.in_link_order(peers)
            self._plans[(rank, backend, keys)] = cached
        return cached

    def _lowered_plan(self, rank: int, backend: str, keys: tuple[ValueKey, ...]) -> RankPlan:
        """``rank``'s plan as built, its schedule lowered but not yet in link order (cached: a
        pipelined plan reads its peers')."""
        found = self._lowered.get((rank, backend, keys))
        if found is None:
            found = self._lowered[(rank, backend, keys)] = self._build_plan(self.build_rank(rank, backend, fetches=keys), backend)
        return found

    def build_rank(
        self, rank: int, backend: str = "host", upto: str | None = None, fetches: tuple[ValueKey, ...] = ()
    ) -> RankProgram:
        """``rank``'s program rewritten by the passes (up to ``upto``), uncached: for dumps."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise AutoparError(f"rank must be an int, got {rank!r}")
        return self.pipeline.build_rank(self.state, rank, backend, upto, fetches)

    @property
    def collectives_span_world(self) -> bool:
        """Whether every planned collective runs over all ranks of the mesh (what gloo's
        native backend needs on CPU)."""
        return all(
            functools.reduce(lambda n, d: n * self.mesh.shape[d], dims, 1) == self.mesh.size
            for dims in self.state.mesh_dim_sets()
        )

    def _build_plan(self, rp: RankProgram, backend: str) -> RankPlan:
        ops = list(rp.program.global_block().ops)
        where = {op.id(): i for i, op in enumerate(ops)}
        replaced = {key: (where[v.get_defining_op().id()], v.index()) for key, v in rp.replaced.items()}
        collectives = tuple(sorted(((c, where[op_id]) for c, op_id in rp.collectives), key=lambda item: item[1]))
        fetched = tuple((where[v.get_defining_op().id()], v.index()) for v in (rp.fetched[k] for k in rp.fetches if k in rp.fetched))
        return RankPlan(
            rp.rank, self.mesh, backend, rp.program, rp.startup, collectives, dict(rp.rings), self.values,
            tuple(where[op.id()] if op is not None else -1 for op in rp.ops), replaced, tuple(rp.stages),
            tuple(self.pipeline.names()), rp.fetches if len(fetched) == len(rp.fetches) else (), fetched,
            self._pipeline_role(rp, ops), LearningRateSchedule.of(self.serial_program),
        )

    def _pipeline_role(self, rp: RankProgram, ops: list[Operation]) -> PipelineRole | None:
        plan, micro = self.state.pipeline, self.state.micro
        if plan is None or not rp.phases:  # (no pipeline, or the program as it is before pipeline_split: ``after=``)
            return None
        stage = plan.pipeline_rank(rp.rank)
        summed = frozenset(k for k in micro.placements if micro.pending_sum(k)) if micro is not None else frozenset()
        split = frozenset(k for k in micro.placements if micro.split_dim(k) is not None) if micro is not None else frozenset()
        return PipelineRole(
            stage, plan.actions[stage], plan.micro_batches, tuple(rp.phases[op.id()] for op in ops),
            dict(micro.feeds) if micro is not None else {}, summed, split,
        )  # fmt: skip

    def schedule(self, rank: int) -> tuple[Action, ...]:
        """The verified pipeline actions ``rank`` runs each step (``2F0``: stage 2's forward of
        micro-batch 0; send / recv included)."""
        if self.state.pipeline is None:
            raise AutoparError("this program has no pipeline (no stages placed with shard_op, no Strategy.pipeline)")
        if rank not in self.mesh.ranks:
            raise AutoparError(f"rank {rank} is not in {self.mesh}")
        plan = self.state.pipeline
        return plan.actions[plan.pipeline_rank(rank)]

    def rank_program(self, rank: int) -> Program:
        """The PIR program rank ``rank`` runs (local shapes, inserted collectives)."""
        return self.rank_plan(rank).program

    def rank_startup_program(self, rank: int) -> Program:
        """The startup program of ``rank``: the serial initial values, sliced to its pieces."""
        startup = self.rank_plan(rank).startup
        if startup is None:
            raise AutoparError("compile was called without startup_program=; there is no startup to partition")
        return startup

    def comm_ops(self, rank: int) -> list[Collective]:
        """The collectives inserted for ``rank``, in program order: kind, group, bytes, reason, time."""
        return [c for c, _ in self.rank_plan(rank).collectives]

    def local_shape(self, name_or_value: Any, rank: int) -> tuple[int, ...]:
        info = self.values.info(self.key(name_or_value))
        return info.placement.local_shape(info.shape, rank)

    def op_mesh(self, op_index: int) -> ProcessMesh:
        return self.propagation.op_meshes.get(op_index, self.mesh)

    @property
    def cost(self) -> CostReport:
        """Predicted step time, comm bytes and peak memory per rank (see autopar.inspect.cost_report)."""
        from autopar.inspect.cost_report import cost_report

        return cost_report(self)

    def dump_diff(self, directory: Any, **options: Any) -> DumpResult:
        """Per-rank text diffs and graphviz pictures into ``directory`` (see autopar.inspect.dump)."""
        from autopar.inspect.dump import dump_diff

        return dump_diff(self, directory, **options)
