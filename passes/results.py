"""The values the planning passes decide and ``CompileState`` holds (stage: passes, compile time).

A pass module imports :mod:`autopar.passes.base` (``Pass``, ``CompileState``) and returns one of
these from its ``plan``; ``CompileState`` records each once (:meth:`CompileState.result`). So they live here, below both: plain
frozen values over placements, meshes and collective kinds, importing no pass. (Each pass module
re-exports its own: ``autopar.passes.zero_sharding.ZeroShard`` is this ``ZeroShard``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.attention_cores import AffineMiddle, AttentionCore
from autopar.collective import CollectiveKind
from autopar.cost_model.planner import ReshardStep
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.mesh import ProcessMesh
from autopar.propagation_result import PropagationResult
from autopar.schedule import Action


@dataclass(frozen=True, slots=True)
class ZeroShard:
    """ZeRO's decision for one parameter's update.

    ``whole``: the placement the update had under plain data parallelism (the parameter's);
    ``sharded``: the placement states, gradient and update take (None: left whole, ``reason``
    says why).
    """

    param: ValueKey
    label: str
    update_op: int
    whole: DistAttr
    sharded: DistAttr | None
    reason: str
    gradient: ValueKey | None = None  # the value the update reads as the gradient

    def __str__(self) -> str:
        if self.sharded is None:
            return f"{self.label}: left whole ({self.reason})"
        return f"{self.label}: updated as {self.sharded} (was {self.whole})"


@dataclass(frozen=True, slots=True)
class FusedBucket:
    """Several planned reshards moved as one collective of their flat buffer: ZeRO's
    reduce_scatters (or write-back all_gathers) of several parameters (:data:`ZeroBucket`,
    passes/zero_fusion.py), or the all_gathers (or all_reduces) of several values one op reads
    (:data:`SiteBucket`, passes/site_fusion.py)."""

    index: int
    kind: CollectiveKind
    members: tuple[int, ...]  # planned reshard indices, program order
    bytes: int
    time: float
    reason: str
    reduce: str = "sum"  # (a reduction's operator)


ZeroBucket = SiteBucket = FusedBucket


@dataclass(frozen=True)
class PipelinePlan:
    """Stages and schedule of a pipelined program (rank-independent).

    ``meshes``: the pipeline ranks' sub-meshes (``mesh[i]``), in the order the forward pass first
    reaches them; ``stages``: each stage's index into ``meshes`` (stage ``s`` on ``meshes[s % p]``:
    with virtual stages a pipeline rank holds several, Megatron's looping placement).
    """

    meshes: tuple[ProcessMesh, ...]
    stages: tuple[int, ...]
    stage_of: Mapping[int, int]  # serial op index -> stage (sources and constants: absent)
    micro_batches: int
    schedule_name: str
    actions: Mapping[int, tuple[Action, ...]]  # pipeline rank -> its verified actions (send/recv included)

    def pipeline_rank(self, rank: int) -> int:
        for index, mesh in enumerate(self.meshes):
            if rank in mesh.ranks:
                return index
        raise AutoparError(f"rank {rank} holds no pipeline stage (stage meshes: {', '.join(map(str, self.meshes))})")

    def stages_of(self, rank: int) -> set[int]:
        mine = self.pipeline_rank(rank)
        return {stage for stage, index in enumerate(self.stages) if index == mine}


@dataclass(frozen=True)
class ZeroPlan:
    """ZeroSharding's result: its decision per parameter update, the propagation with its
    placements layered on the analysis' (:meth:`~autopar.propagation.PropagationResult.overridden`),
    and the stage-3 parameters gathered again for the backward."""

    stage: int
    shards: tuple[ZeroShard, ...]
    propagation: PropagationResult
    regather: frozenset[ValueKey]


@dataclass(frozen=True)
class LoweringGroups:
    """OpLowering's result: the mesh-dim sets its lowerings' collectives run along (vocabulary-
    parallel rows, batch-norm statistics), for the ring ids (``CompileState.mesh_dim_sets``)."""

    mesh_dims: frozenset[tuple[int, ...]]


@dataclass(frozen=True)
class ZeroBuckets:
    """ZeroBucketFusion's result: ZeRO's fused reduce_scatters / all_gathers (passes/zero_fusion.py)."""

    buckets: tuple[ZeroBucket, ...]


@dataclass(frozen=True)
class SiteBuckets:
    """SiteFusion's result: the all_gathers one op reads, fused (passes/site_fusion.py)."""

    buckets: tuple[SiteBucket, ...]


@dataclass(frozen=True, slots=True)
class BlockValue:
    """What a permute moves, as emit_step reads a serial value: a label, the global shape, the dtype."""

    label: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RingCore:
    """One core's ring, planned once: the core, its middle, the group size, the key length and
    the ring shifts (``[k|v]`` forward, ``[k|v|dk|dv]`` and ``[dk|dv]`` backward, ``[k|v]`` of a
    recomputation) with the values they move."""

    core: AttentionCore
    middle: AffineMiddle
    mesh_dim: int
    parts: int
    keys: int  # the global sequence length of K and V
    shifts: tuple[ReshardStep, ReshardStep, ReshardStep, ReshardStep]  # [k|v], [k|v|dk|dv], [dk|dv], recomputed [k|v]
    values: tuple[BlockValue, BlockValue, BlockValue, BlockValue]  # what each of them moves
    reason: str
    first_grad: int | None  # the matmul_grad ops of the core's backward (None: no backward)
    second_grad: int | None
    split_grads: frozenset[ValueKey] = frozenset()  # dK / dV reduce_scattered by sequence right after their grad op
    recomputed: tuple[int, int] | None = None  # recompute: the backward's clones of the two matmuls
    # grouped-query attention: the forward ring moves K, V before repeat_kv (and the repeat count)
    unrepeated: tuple[ValueKey, ValueKey, int] | None = None


@dataclass(frozen=True)
class RingPlan:
    """RingAttention's result (passes/ring_attention.py): each attention core's ring, program order."""

    cores: tuple[RingCore, ...]
