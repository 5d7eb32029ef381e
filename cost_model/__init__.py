"""Cluster description, communication / compute / memory costs and the reshard planner
(installed as ``autopar.cost_model``; stage: plan reshards and the cost report)."""

from autopar.cost_model.choice import CostResolver, PlacementChoice, PlacementOption, choose_placement, make_resolver
from autopar.cost_model.cluster import (
    Cluster,
    Device,
    Link,
    default_cluster,
    dtype_bytes,
    hardware_profile,
    load_cluster,
    shipped_profile,
)
from autopar.cost_model.comm import COLLECTIVES, collective_time, groups_time
from autopar.cost_model.compute import OpCost, einsum_cost, op_cost, op_cost_or_traffic
from autopar.cost_model.memory import MemoryEstimate, TensorInfo, memory_per_rank, tensor_bytes
from autopar.cost_model.planner import STEP_KINDS, ReshardPlan, ReshardStep, plan_reshard

__all__ = [
    "COLLECTIVES", "STEP_KINDS", "Cluster", "CostResolver", "Device", "Link", "MemoryEstimate", "OpCost",
    "PlacementChoice", "PlacementOption", "ReshardPlan", "ReshardStep", "TensorInfo",
    "choose_placement", "collective_time", "default_cluster", "dtype_bytes", "einsum_cost", "groups_time",
    "hardware_profile", "load_cluster", "make_resolver", "memory_per_rank", "op_cost", "op_cost_or_traffic", "plan_reshard",
    "shipped_profile", "tensor_bytes",
]  # fmt: skip
