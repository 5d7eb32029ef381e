"""``autopar.compile``: the driver from an annotated serial program to a DistributedProgram.

Stages run in order: graph -> propagate -> partition -> reshard insertion -> all-reduce
fusion (later issues add ZeRO, pipeline split and schedules; backend lowering runs per backend). The user's program is only read,
never modified: every rank program is a clone.
"""

from __future__ import annotations

from typing import Any

from autopar.annotate import annotations_of
from autopar.dist_attr import DistAttr
from autopar.distributed_program import DistributedProgram
from autopar.errors import AnnotationError, AutoparError
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.passes.allreduce_fusion import AllreduceFusionPass
from autopar.passes.base import CompileState, PassPipeline
from autopar.passes.partition import PartitionPass
from autopar.passes.reshard_insertion import ReshardInsertionPass
from autopar.propagation import propagate
from autopar.strategy import Strategy


def compile(  # noqa: A001  (the public name the design card fixes)
    program: Any,
    mesh: ProcessMesh,
    startup_program: Any = None,
    strategy: Strategy | None = None,
) -> DistributedProgram:
    """Propagate the annotations of ``program`` over ``mesh``; see DESIGN.md for the contract."""
    state = analyze(program, mesh, startup_program, strategy)
    staged = sorted({str(m) for m in state.propagation.op_meshes.values() if m != mesh})
    if staged:
        # sub-mesh (pipeline stage) programs need stage splitting and send/recv: the pipeline
        # issue. Propagation results stay available; rank programs say why they are missing.
        state.unavailable = f"ops run on sub-meshes {staged}; per-rank programs for pipeline stages are not built yet"
    else:
        passes = [PartitionPass(), ReshardInsertionPass()]
        if state.strategy.fuse_allreduce:
            passes.append(AllreduceFusionPass(int(state.strategy.allreduce_bucket_mb * (1 << 20))))
        PassPipeline(passes).run(state)
    return DistributedProgram(program, startup_program, state)


def analyze(program: Any, mesh: ProcessMesh, startup_program: Any = None, strategy: Strategy | None = None) -> CompileState:
    """The first stages only: graph view, annotations and propagation (no program rewrites)."""
    if not isinstance(mesh, ProcessMesh):
        raise AutoparError(f"compile needs an autopar.ProcessMesh, got {type(mesh).__name__}")
    if not hasattr(program, "global_block"):
        raise AutoparError(f"compile needs a Paddle static (PIR) Program, got {type(program).__name__}")
    strategy = strategy or Strategy()
    graph = ProgramGraph(program)
    user = _user_placements(program, graph, mesh)
    op_meshes = _op_meshes(program, graph, mesh)
    cluster = _cluster(strategy)
    result = propagate(graph, mesh, user, op_meshes, cluster=cluster.fitted(mesh.ranks))
    return CompileState(graph, result, mesh, strategy, cluster=cluster, startup=startup_program)


def _cluster(strategy: Strategy) -> Any:
    from autopar.cost_model.cluster import default_cluster, load_cluster

    return load_cluster(strategy.cluster) if strategy.cluster else default_cluster()


def _user_placements(program: Any, graph: ProgramGraph, mesh: ProcessMesh) -> dict[ValueKey, DistAttr]:
    placements = {}
    for impl_id, (attr, label) in annotations_of(program).tensors.items():
        key = graph._by_impl.get(impl_id)
        if key is None:
            raise AnnotationError(f"tensor {label!r} is annotated but is not a value of the compiled program")
        if not mesh.contains(attr.mesh):
            raise AnnotationError(f"tensor {label!r} is annotated on {attr.mesh}, which is not a sub-mesh of {mesh}")
        shape = graph.values[key].shape
        for tensor_dim, size in enumerate(shape):
            parts = attr.shard_index(tensor_dim, attr.mesh.ranks[0])[1]
            if parts > size:
                raise AnnotationError(
                    f"tensor {label!r} of shape {list(shape)}: dim {tensor_dim} ({size} elements) split into {parts} "
                    "pieces would leave ranks an empty piece"
                )
        placements[key] = attr
    return placements


def _op_meshes(program: Any, graph: ProgramGraph, mesh: ProcessMesh) -> dict[int, ProcessMesh]:
    by_id = {op.op_id: op.index for op in graph.ops}
    meshes = {}
    for op_id, op_mesh in annotations_of(program).ops.items():
        if op_id not in by_id:
            continue  # an op erased from the program after shard_op recorded it
        op = graph.ops[by_id[op_id]]
        if not mesh.contains(op_mesh):
            raise AnnotationError(f"op {op} is placed by shard_op on {op_mesh}, which is not a sub-mesh of {mesh}")
        meshes[op.index] = op_mesh
    return meshes
