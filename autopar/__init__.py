"""autopar: semi-automatic parallelism for PaddlePaddle static (PIR) programs.

    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main_program, mesh, startup_program=startup)
    dist.dist_attr("linear_0.w_0")
"""

from autopar import errors
from autopar.analysis import Analysis, analyze
from autopar.annotate import keep, reshard, shard_op, shard_tensor
from autopar.compile import compile  # noqa: A004
from autopar.dist_attr import DistAttr
from autopar.distributed_program import CompileReport, DistributedProgram
from autopar.errors import AutoparError
from autopar.inspect.check import CheckReport, check
from autopar.local_map import global_mesh_tensor, local_map, split_mesh, sub_mesh_tensors
from autopar.mesh import ProcessMesh
from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.runtime.executor import Executor
from autopar.runtime.simulator import SimulationResult, simulate
from autopar.strategy import ContextParallel, PipelineConfig, Strategy
from autopar.suggest import Plan, price_plan, suggest

__all__ = [
    "Analysis", "AutoparError", "CheckReport", "CompileReport", "ContextParallel", "Executor", "DistAttr", "DistributedProgram", "Partial", "PipelineConfig", "Placement", "Plan",
    "ProcessMesh", "Replicate", "Shard", "SimulationResult", "Strategy", "analyze", "check", "compile", "errors", "global_mesh_tensor", "keep", "local_map", "price_plan", "reshard", "shard_op", "shard_tensor", "simulate", "split_mesh", "sub_mesh_tensors", "suggest",
]  # fmt: skip
