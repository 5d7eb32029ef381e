"""What a Strategy asks of compile, read once (stage: the top of compile and analyze).

The Strategy is read here and nowhere below: :func:`plan_compile` checks it, adds what the
program implies (stages placed by annotations imply a pipeline of one micro-batch), and turns
it into values — the serial rewrites to run, the passes to plan, the cluster to price on, the
few facts the analysis needs (pipelined, one stage) and the fields an analysis depends on.
``autopar.compile`` and ``autopar.analyze`` call it first and hand the result down; the
analysis, the rewrites and the passes take these values as arguments, so no module below asks
the Strategy again (``tools/strategy_walk.py`` shows the walk: one module).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.annotate import annotations_of
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh, not_a_mesh
from autopar.passes.allreduce_fusion import AllreduceFusion
from autopar.passes.backend_lowering import BackendLowering
from autopar.passes.base import Pass
from autopar.passes.fetch_replication import FetchReplication
from autopar.passes.op_lowering import OpLowering
from autopar.passes.partition import Partition
from autopar.passes.pipeline_split import PipelineSplit
from autopar.passes.reshard_emission import ReshardEmission
from autopar.passes.reshard_planning import ReshardPlanning
from autopar.passes.ring_attention import RingAttention
from autopar.passes.site_fusion import SiteFusion
from autopar.passes.sub_meshes import SubMeshes
from autopar.passes.zero_fusion import ZeroBucketFusion
from autopar.passes.zero_sharding import ZeroSharding
from autopar.rewrites import (
    ContextParallelSplit,
    DeadOpRemoval,
    LocalBatchNorm,
    LossScalingResults,
    MaskedMeans,
    MicroBatch,
    PipelineStages,
    Recompute,
    Rewrite,
    SequenceParallel,
    ShapeReads,
    StageNorms,
    StageOverflowChecks,
    ZigzagOrder,
)  # fmt: skip
from autopar.rewrites.ring_gradients import RingGradients
from autopar.strategy import ContextParallel, EffectiveStrategy, PipelineConfig, Strategy

if TYPE_CHECKING:
    from paddle.pir import Program

AnalysedField = int | bool | str | tuple[str, ...] | ContextParallel | None  # the value of one of ANALYSED
ANALYSED = (
    "micro_batches", "stages", "pipelined", "sequence_parallel", "recompute", "cluster", "local_batch_norm", "context_parallel",
)  # fmt: skip


@dataclass(frozen=True)
class CompilePlan:
    """A Strategy as compile uses it: ``effective`` (the user's and what runs), the rewrites and
    passes it declares, in order, and what the analysis reads (``analysed``: the fields an
    analysis depends on, :data:`ANALYSED`)."""

    effective: EffectiveStrategy
    rewrites: tuple[Rewrite, ...]
    passes: tuple[Pass, ...]
    analysed: tuple[tuple[str, AnalysedField], ...]

    @property
    def strategy(self) -> Strategy:
        return self.effective.strategy

    def field(self, name: str) -> AnalysedField:
        return dict(self.analysed)[name]

    @property
    def pipelined(self) -> bool:
        return bool(self.field("pipelined"))

    @property
    def single_stage(self) -> bool:
        return self.field("stages") == 1

    @property
    def cluster(self) -> str | None:
        cluster = self.field("cluster")
        return cluster if isinstance(cluster, str) else None


def plan_compile(program: Program | None, mesh: ProcessMesh, strategy: Strategy | None) -> CompilePlan:
    """``strategy`` (None: the default) checked and read, once, into a :class:`CompilePlan`
    (``program``: None when there is no program whose annotations could imply stages)."""
    effective = effective_strategy(program, mesh, strategy)
    chosen = effective.strategy
    passes = passes_for(chosen)
    if program is not None and _has_sub_meshes(program, mesh, chosen.pipeline is not None):  # each rank keeps its own ops
        # (after op_lowering, before the pipeline split and fetch_replication: autopar/sub_meshes.py)
        passes.insert(len(passes) - (3 if chosen.pipeline is not None else 2), SubMeshes())
    return CompilePlan(effective, rewrites_for(chosen), tuple(passes), tuple(analysed_fields(chosen).items()))


def analysed_fields(strategy: Strategy) -> dict[str, AnalysedField]:
    """The fields of ``strategy`` an analysis depends on (see autopar/analysis.py)."""
    pipeline = strategy.pipeline
    return {
        "micro_batches": pipeline.micro_batches if pipeline is not None else 1,
        "stages": pipeline.stages if pipeline is not None else None,
        "pipelined": pipeline is not None,
        "sequence_parallel": strategy.sequence_parallel,
        "recompute": strategy.recompute,
        "cluster": strategy.cluster,
        "local_batch_norm": strategy.local_batch_norm,
        "context_parallel": strategy.context_parallel,
    }


def rewrites_for(strategy: Strategy) -> tuple[Rewrite, ...]:
    """The serial rewrites ``strategy`` declares, in the order they run (autopar/rewrites)."""
    found: list[Rewrite] = [DeadOpRemoval(), ShapeReads(), LossScalingResults()]
    context = strategy.context_parallel
    if context is not None and context.balance == "zigzag":  # first: stages and micro-batches see the reordered program
        found.append(ZigzagOrder(context.dim))
    pipeline = strategy.pipeline
    if pipeline is not None:
        found += [PipelineStages(pipeline.stages), StageNorms(), StageOverflowChecks()]
    if strategy.local_batch_norm:
        found.append(LocalBatchNorm())
    if pipeline is not None and pipeline.micro_batches > 1:
        found += [MaskedMeans(), MicroBatch(pipeline.micro_batches)]
    if strategy.recompute:  # after micro-batching: strategies differing in recompute share it (its clones are copies)
        found.append(Recompute(strategy.recompute))
    if context is not None:  # before sequence parallelism: its first propagation sees the sequence split
        found.append(ContextParallelSplit(context.dim, context.method, context.balance))
    if strategy.sequence_parallel:
        found.append(SequenceParallel(strategy.sequence_parallel))
    cp = strategy.context_parallel
    if cp is not None and cp.method == "ring":  # (after the context-parallel split of the sequence)
        found.append(RingGradients(cp.dim))
    return tuple(found)


def passes_for(strategy: Strategy) -> list[Pass]:
    """The declared pass list of a Strategy (``dist.passes`` prints it)."""
    pipelined = strategy.pipeline is not None
    passes: list[Pass] = [Partition(pipelined=pipelined)]
    if strategy.zero_stage:
        passes.append(ZeroSharding(strategy.zero_stage, pipelined=pipelined))
    passes += [ReshardPlanning(pipelined=pipelined, reduce_dtype=strategy.reduce_dtype, uneven_all_to_all=strategy.uneven_all_to_all),
               ReshardEmission(), SiteFusion()]
    if strategy.fuse_allreduce:
        passes.append(AllreduceFusion(strategy.bucket_bytes))
        if strategy.zero_stage:
            passes.append(ZeroBucketFusion(strategy.bucket_bytes))
    cp = strategy.context_parallel
    if cp is not None and cp.method == "ring":  # before op_lowering: the ring draws the core's dropout itself
        passes.append(RingAttention(cp.dim))
    passes.append(OpLowering())  # the per-op lowerings the rules declare (vocab rows, BN statistics, dropout)
    if strategy.pipeline is not None:
        passes.append(PipelineSplit(strategy.pipeline.micro_batches, strategy.pipeline.schedule))
    passes += [FetchReplication(), BackendLowering()]
    return passes


def effective_strategy(program: Program | None, mesh: ProcessMesh, strategy: Strategy | None) -> EffectiveStrategy:
    """``strategy`` checked, with a pipeline of one micro-batch when the annotations place stages:
    a new value recorded beside the user's (which stays as given)."""
    if not isinstance(mesh, ProcessMesh):
        raise AutoparError(not_a_mesh("compile", mesh))
    checked = checked_strategy(strategy)
    _check_context_parallel(checked.context_parallel, mesh)
    if checked.pipeline is None and program is not None and _has_stages(program, mesh):  # (stages placed by shard_op)
        staged = dataclasses.replace(checked, pipeline=PipelineConfig())  # stages by shard_op, one micro-batch
        why = "pipeline=PipelineConfig() (one micro-batch): the annotations place ops or values on sub-meshes of the mesh"
        return EffectiveStrategy(strategy, staged, (why,))
    return EffectiveStrategy(strategy, checked)


def checked_strategy(strategy: Any) -> Strategy:
    """``strategy`` if it is a Strategy whose every field has its pass (None: the default)."""
    if strategy is not None and not isinstance(strategy, Strategy):
        raise AutoparError(f"strategy must be an autopar.Strategy, got {type(strategy).__name__}")
    strategy = strategy or Strategy()
    strategy.check_implemented()
    return strategy


def _check_context_parallel(context: ContextParallel | None, mesh: ProcessMesh) -> None:
    """Refuse, by name, a context-parallel dim the mesh lacks (what a method or balance cannot
    do is refused where it is done: autopar/rewrites/context_parallel.py, zigzag.py, the ring)."""
    if context is None:
        return
    if context.dim not in mesh.dim_names:
        raise AutoparError(
            f"Strategy.context_parallel: ContextParallel(dim={context.dim!r}) names no dim of the mesh "
            f"(its dims: {list(mesh.dim_names)}); add a mesh dim of that name for the sequence split"
        )


def _has_sub_meshes(program: Program, mesh: ProcessMesh, pipelined: bool = False) -> bool:
    """Whether autopar.local_map placed ops, or annotations placed values, on sub-meshes (under
    a pipeline: sub-meshes that are no stage ``mesh[i]``)."""
    notes = annotations_of(program)
    stages = {mesh[i] for i in range(mesh.shape[0])} if pipelined else set()
    return bool(notes.local_ops) or any(
        attr.mesh != mesh and not attr.mesh.same_grid(mesh) and attr.mesh not in stages for attr, _ in notes.tensors.values()
    )


def _has_stages(program: Program, mesh: ProcessMesh) -> bool:
    """Whether shard_op placed ops on sub-meshes, or (on a mesh whose first dim is ``pp``, as
    Paddle names it) shard_tensor / reshard placed values on its stages."""
    notes = annotations_of(program)
    meshes = list(notes.ops.values())
    if mesh.dim_names[0] == "pp":
        meshes += [attr.mesh for attr, _ in notes.tensors.values()]
    return any(m != mesh and not m.same_grid(mesh) and mesh.contains(m) for m in meshes)
