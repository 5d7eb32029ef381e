"""Pass infrastructure: frozen, named passes over the compile state (stage: passes).

A pass has two halves, both deterministic:

- ``plan(state)`` runs once at compile time and makes rank-independent decisions as values
  (which collectives a reshard needs, which gradients share a bucket): its cost does not
  grow with the world size.
- ``emit(state, rank_program)`` rewrites ONE rank's program from those values. It never asks
  "which rank am I" of the environment: the rank is an argument, so every rank's program can
  be built (and tested) in one process, and a process of a 1024-rank job builds only its own.

Each half declares the stages it needs and leaves, so the IR's progress is checkable:
propagated -> reshard-planned -> buckets-planned at compile; partitioned -> comm-inserted ->
comm-fused -> lowered per rank. A :class:`PassPipeline` runs the passes in order and calls its callback
after each, where per-pass dumps hook in (``build_rank(rank, upto=name)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from autopar.collective import Collective
from autopar.cost_model.planner import ReshardPlan
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, ValueKey, once_per_graph
from autopar.mesh import ProcessMesh
from autopar.passes.results import LoweringGroups, PipelinePlan, SiteBuckets, ZeroBuckets, ZeroPlan, ZeroShard
from autopar.propagation import PropagationResult, ReshardNeed

if TYPE_CHECKING:  # (types only; tests/unit/test_import_cycles.py counts these imports too)
    from paddle.pir import Operation, Program, Value

    from autopar.cost_model.cluster import Cluster
    from autopar.rewrites import Rewrite
    from autopar.rewrites.micro_batching import MicroBatching
    from autopar.rewrites.recompute import Recomputation
    from autopar.rewrites.sequence_parallel import SequenceRegions
    from autopar.schedule import Phase
    from autopar.strategy import Strategy

R = TypeVar("R")


@dataclass(frozen=True)
class PlannedReshard:
    """One reshard need and the steps planned for it (every rank emits from this value).

    ``shared_with``: the index of an earlier planned reshard moving the same value to the
    same placement before a read; this one reuses that result instead of moving it again.
    ``explain``: makes the reason, read as :attr:`reason` — written when a rank program or a
    report asks (a strategy search plans many strategies and reads few reasons).
    """

    index: int
    need: ReshardNeed
    plan: ReshardPlan
    explain: Callable[[], str] = field(repr=False, compare=False)
    shared_with: int | None = None

    @property
    def reason(self) -> str:
        """Why the reshard is there: the feature and layer, then what it moves (see
        passes/reshard_planning.py)."""
        text = self.__dict__.get("_reason")
        if text is None:
            text = self.__dict__["_reason"] = self.explain()
        return text


@dataclass(frozen=True, slots=True)
class GradientBucket:
    """Gradient all-reduces fused into one buffer (see :mod:`autopar.passes.allreduce_fusion`)."""

    index: int
    members: tuple[int, ...]  # planned reshard indices, program order
    mesh_dims: tuple[int, ...]
    reduce: str
    src: DistAttr  # the flat buffer's pending reductions (dst: replicated)
    dtype: str
    numel: int
    bytes: int
    time: float
    reason: str
    zeroed: tuple[int, ...] = ()  # mesh dims along which all copies but the first are zeroed first (make_partial)


@dataclass(frozen=True)
class PlannedReshards:
    """ReshardPlanning's result: every reshard need's planned steps, in need order."""

    reshards: tuple[PlannedReshard, ...]


@dataclass(frozen=True)
class GradientFusion:
    """AllreduceFusion's result: its buckets, and the planned reshards it moved onto another
    plan to share a bucket (by planned index; planning's own result is unchanged)."""

    buckets: tuple[GradientBucket, ...]
    rerouted: Mapping[int, PlannedReshard]


@dataclass(frozen=True)
class AnalysedProgram:
    """What every strategy compiled from one analysis shares, read only: the graph view, the
    propagation, the cluster, the serial rewrites' decisions (autopar.analysis)."""

    graph: ProgramGraph
    propagation: PropagationResult
    mesh: ProcessMesh
    cluster: Cluster | None = None  # the cost model's cluster, fitted to the mesh
    startup: Program | None = None  # the serial startup program (read only)
    micro: MicroBatching | None = None  # micro-batching analysis (autopar.rewrites.micro_batching), when the pipeline runs several
    recompute: Recomputation | None = None  # the recompute rewrite and its report (autopar.rewrites.recompute), when the Strategy asks for it
    sequence: SequenceRegions | None = None  # sequence parallelism's split activations (autopar.rewrites.sequence_parallel.SequenceRegions)
    regather: frozenset[ValueKey] = frozenset()  # values gathered again for the backward, not kept from the forward (recompute)
    rewrites: tuple[tuple[str, str], ...] = ()  # (rewrite, its report) of each serial rewrite, in order (autopar.rewrites)
    single_stage: bool = False  # the Strategy's pipeline has one stage: the whole mesh (PipelineConfig(stages=1))
    zigzag: tuple[int, ...] | None = None  # balance="zigzag": the sequence positions in the order the program holds them


_RESULT_FIELDS = {"pipeline": PipelinePlan, "zero_buckets": ZeroBuckets, "site_buckets": SiteBuckets}


class CompileState:
    """One compile of one Strategy over an analysis: the analysis' values (shared, read only)
    and each planning pass's result, recorded once (:meth:`record`, :meth:`result`).

    A pass's ``plan`` returns its result, a frozen value; the pipeline records it by its type and
    no pass can change another's (a second result of one type is refused). The fields later
    passes read (``propagation``, ``reshards``, ``buckets``, ``zero``, ``pipeline``...) are
    read from those results: ``propagation`` is ZeRO's (the analysis' with its placements
    layered on) when ZeRO ran, else the analysis'.
    """

    def __init__(self, analysed: AnalysedProgram, strategy: Strategy) -> None:
        self.analysed = analysed
        self.strategy = strategy
        self.graph, self.mesh, self.cluster, self.startup = analysed.graph, analysed.mesh, analysed.cluster, analysed.startup
        self.micro, self.recompute, self.sequence, self.rewrites = analysed.micro, analysed.recompute, analysed.sequence, analysed.rewrites
        self.propagation: PropagationResult = analysed.propagation
        self.regather: frozenset[ValueKey] = analysed.regather
        self.zigzag = analysed.zigzag
        self.unavailable = ""  # why no rank programs can be built (empty: they can)
        self.stages: list[str] = ["propagated"]
        self._results: dict[type, object] = {}
        self._reshards: tuple[PlannedReshard, ...] | None = None  # (read per op and per rank: made once per result)
        self._dim_sets: list[tuple[int, ...]] | None = None

    def record(self, result: object) -> None:
        """Keep a pass's result (once per type: passes do not edit each other's results)."""
        kind = type(result)
        if kind in self._results:
            raise AutoparError(f"the compile already has a {kind.__name__}: a pass's result is recorded once")
        self._results[kind] = result
        self._reshards = None
        if isinstance(result, ZeroPlan):
            self.propagation, self.regather = result.propagation, self.regather | result.regather

    def result(self, kind: type[R]) -> R | None:
        """The recorded result of type ``kind`` (None: no pass made one)."""
        found = self._results.get(kind)
        return found if found is None or isinstance(found, kind) else None

    def __getattr__(self, name: str) -> object:
        kind = _RESULT_FIELDS.get(name)
        if kind is None:
            raise AttributeError(name)
        found = self.__dict__.get("_results", {}).get(kind)
        if found is None:
            return None if kind is PipelinePlan else ()
        return found if kind is PipelinePlan else found.buckets

    def __setattr__(self, name: str, value: object) -> None:
        """``state.pipeline = plan``, ``state.zero_buckets = buckets``: recorded as that pass's result."""
        kind = _RESULT_FIELDS.get(name)
        if kind is None:
            object.__setattr__(self, name, value)
        else:
            self.record(value if kind is PipelinePlan else kind(tuple(value)))

    @property
    def zero(self) -> tuple[ZeroShard, ...]:
        """ZeRO's decision per parameter update (passes/zero_sharding.py)."""
        plan = self.result(ZeroPlan)
        return plan.shards if plan is not None else ()

    @property
    def reshards(self) -> tuple[PlannedReshard, ...]:
        """The planned reshards (reshard planning's, with those gradient fusion rerouted)."""
        if self._reshards is None:
            planned, fusion = self.result(PlannedReshards), self.result(GradientFusion)
            found = planned.reshards if planned is not None else ()
            if fusion is not None and fusion.rerouted:
                found = tuple(fusion.rerouted.get(p.index, p) for p in found)
            self._reshards = found
        return self._reshards

    @property
    def buckets(self) -> tuple[GradientBucket, ...]:
        """Gradient all-reduces fused into buckets (passes/allreduce_fusion.py)."""
        fusion = self.result(GradientFusion)
        return fusion.buckets if fusion is not None else ()

    def label(self, key: ValueKey) -> str:
        """A value as the user knows it: parameters, feeds and states by name, the gradient an
        update reads as ``grad(W) %12.1``, its result as ``updated W`` (for reasons and reports)."""
        return _gradient_names(self.graph).get(key, self.graph.values[key].label)

    def mesh_dim_sets(self) -> list[tuple[int, ...]]:
        """Mesh-dim sets some collective runs along, in plan order (the basis of ring ids)."""
        seen: dict[tuple[int, ...], None] = {}
        for planned in self.reshards:
            for step in planned.plan.steps:
                if not step.kind.is_local:
                    seen.setdefault(tuple(step.mesh_dims), None)
        for bucket in self.buckets:
            seen.setdefault(bucket.mesh_dims, None)
        lowered = self.result(LoweringGroups)
        for dims in sorted(lowered.mesh_dims if lowered is not None else ()):  # vocabulary-parallel rows, batch-norm statistics
            seen.setdefault(dims, None)
        return list(seen)

    def ring_of(self, mesh_dims: Sequence[int], group: Sequence[int]) -> int:
        """A communicator id every member of ``group`` computes alike, from values only.

        ``mesh_dims``-set index x world size + the group's index among the mesh's groups
        along those dims (its coordinate on the other dims, row-major). Asked once planning
        is done (rank programs are built after compile).
        """
        if self._dim_sets is None:
            self._dim_sets = self.mesh_dim_sets()
        sets = self._dim_sets
        dims = tuple(mesh_dims)
        coord = self.mesh.coordinate(group[0])
        index = 0
        for d in range(self.mesh.ndim):
            if d not in dims:
                index = index * self.mesh.shape[d] + coord[d]
        # a set no planned collective uses (a fetch's): after the planned ones, by its bitmask
        slot = sets.index(dims) if dims in sets else len(sets) + sum(1 << d for d in dims)
        return slot * self.mesh.size + index


@once_per_graph
def _gradient_names(graph: ProgramGraph) -> dict[ValueKey, str]:
    """User-facing labels of the values each optimizer update reads as its gradient
    (``grad(W) %12.1``; ``clipped grad(W) %20.0`` when clipping rescaled it, the raw one still
    ``grad(W)``) and of the parameter it writes (``updated W``)."""
    from autopar.causes import gradients, updates

    names = {}
    for key, gradient in gradients(graph).items():
        prefix = "clipped grad" if gradient.clipped else "grad"
        names[key] = f"{prefix}({graph.values[gradient.param].label}) {graph.values[key].label}"
    for op, _ in updates(graph):
        if op.outputs and op.outputs[0] is not None:
            names[op.outputs[0]] = f"updated {graph.values[op.inputs[0]].label}"
    return names


@dataclass
class RankProgram:
    """One rank's program under construction (a clone of the serial one)."""

    rank: int
    program: Program
    ops: list[Operation | None]  # serial op index -> op of the clone (None: erased, another pipeline stage's)
    backend: str = "host"  # the form built: "host" (collectives run by the runtime) or "native"
    startup: Program | None = None  # the rank's startup program: serial initial values, sliced
    collectives: list[tuple[Collective, int]] = field(default_factory=list)  # (value, id of the op carrying it)
    replaced: dict[ValueKey, Value] = field(default_factory=dict)  # value after a local-scale correction
    final: dict[ValueKey, Value] = field(default_factory=dict)  # value after its after-producer reshard
    resharded: dict[int, Value] = field(default_factory=dict)  # planned reshard index -> its result
    rings: dict[tuple[int, ...], int] = field(default_factory=dict)  # groups this rank is in -> ring id
    stages: list[str] = field(default_factory=list)
    fetches: tuple[ValueKey, ...] = ()  # values the runtime fetches (made whole by fetch_replication)
    fetched: dict[ValueKey, Value] = field(default_factory=dict)  # fetch -> its whole value
    phases: dict[int, Phase] = field(default_factory=dict)  # op id -> pipeline phase (autopar.schedule.Phase: F0, B1, OPT)
    update_side: set[int] = field(default_factory=set)  # ids of ops inserted for a read by an update: run with it

    def value(self, key: ValueKey) -> Value:
        """The serial value's result in this clone, as its op made it."""
        return self.ops[key[0]].result(key[1])

    def produced(self, key: ValueKey) -> Value:
        """The serial value as its producer makes it (after a local-scale correction, if any):
        what a fetch reads, in the produced placement."""
        replaced = self.replaced.get(key)
        return replaced if replaced is not None else self.value(key)

    def current(self, key: ValueKey) -> Value:
        """What later ops read for the serial value: in its final placement (after an
        after-producer reshard, if any)."""
        final = self.final.get(key)
        return final if final is not None else self.produced(key)


class Pass:
    """Base of the frozen pass dataclasses; override ``plan`` and/or ``emit``.

    ``plan_requires`` / ``plan_ensures``: compile-state stages around ``plan``;
    ``emit_requires`` (rank-program or compile-state stages) / ``emit_ensures`` around ``emit``.
    """

    name: ClassVar[str] = "pass"
    plan_requires: ClassVar[tuple[str, ...]] = ()
    plan_ensures: ClassVar[str] = ""
    emit_requires: ClassVar[tuple[str, ...]] = ()
    emit_ensures: ClassVar[str] = ""

    def plan(self, state: CompileState) -> object | None:
        """Compile-time, rank-independent decisions (default: none), returned as the pass's
        frozen result (the pipeline records it: :meth:`CompileState.result`)."""

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        """Rewrite one rank's program (default: nothing)."""

    @property
    def per_rank(self) -> bool:
        return type(self).emit is not Pass.emit

    def options(self) -> dict[str, Any]:
        """The options to print (a :func:`declared` input at its default is left out)."""
        if not hasattr(self, "__dataclass_fields__"):
            return {}
        return {
            f.name: getattr(self, f.name) for f in fields(self)
            if not (f.metadata.get("declared") and getattr(self, f.name) == f.default)
        }  # fmt: skip

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{self.name}({opts})"


def declared(default: bool = False) -> Any:
    """A pass input the Strategy's pass list decides (``passes_for`` in autopar/compile.py):
    generic passes read what a strategy decided from these, never from ``state.strategy``.
    Printed only when it differs from ``default``."""
    return field(default=default, metadata={"declared": True})


@dataclass(frozen=True)
class PassPipeline:
    """The declared passes of one compile; ``callback(pass, state, rank_program_or_None)``
    runs after each plan step and after each emit."""

    passes: tuple[Pass, ...]
    callback: Callable[[Pass, CompileState, RankProgram | None], None] | None = None
    rewrites: tuple[Rewrite, ...] = ()  # the serial rewrites before propagation (autopar.rewrites), for printing

    def plan(self, state: CompileState) -> CompileState:
        for p in self.passes:
            _check_stages(p, p.plan_requires, state.stages, "the compile state")
            result = p.plan(state)
            if result is not None:
                state.record(result)
            if p.plan_ensures:
                state.stages.append(p.plan_ensures)
            if self.callback is not None:
                self.callback(p, state, None)
        return state

    def build_rank(
        self, state: CompileState, rank: int, backend: str = "host", upto: str | None = None,
        fetches: tuple[ValueKey, ...] = (),
    ) -> RankProgram:  # fmt: skip
        """``rank``'s program for ``backend`` (and the values ``fetches`` the runtime will read):
        a clone of the serial one rewritten by every per-rank pass in order (up to and including
        the pass named ``upto``)."""
        if state.unavailable:
            raise AutoparError(state.unavailable)
        if rank not in state.mesh.ranks:
            raise AutoparError(f"rank {rank} is not in {state.mesh}")
        if upto is not None and upto not in self.names():
            raise AutoparError(f"no pass named {upto!r}; the passes are {self.names()}")
        clone = state.graph.program.clone()
        rp = RankProgram(rank, clone, list(clone.global_block().ops), backend, stages=["propagated"], fetches=fetches)
        for p in self.passes:
            if p.per_rank:
                _check_stages(p, p.emit_requires, rp.stages + state.stages, f"rank {rank}'s program")
                p.emit(state, rp)
                if p.emit_ensures:
                    rp.stages.append(p.emit_ensures)
                if self.callback is not None:
                    self.callback(p, state, rp)
            if p.name == upto:
                break
        return rp

    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __str__(self) -> str:
        """The rewrites (before propagation), then the passes, numbered in the order they run."""
        steps = [f"{r}  (rewrite)" for r in self.rewrites] + [str(p) for p in self.passes]
        return "\n".join(f"{i + 1}. {step}" for i, step in enumerate(steps))


def _check_stages(p: Pass, required: tuple[str, ...], stages: list[str], what: str) -> None:
    missing = [stage for stage in required if stage not in stages]
    if missing:
        raise AutoparError(f"pass {p.name!r} needs {what} {', '.join(missing)}; it is {' -> '.join(stages)}")
