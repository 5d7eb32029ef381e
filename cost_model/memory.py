"""Per-rank memory: parameters, gradients, optimizer states, activations (stage: cost report).

Every tensor's bytes on a rank are its local piece under its DistAttr
(:meth:`DistAttr.local_shape`), times the dtype size; a tensor without a DistAttr is whole on
every rank. Gradients take their parameter's placement unless given (ZeRO-2 shards them);
optimizer states are ``states_per_param`` float32 tensors placed like the parameter unless
given (ZeRO-1). Activations are the forward values kept for backward, as listed by the caller.

Mixed precision is counted by each tensor's own dtype, not a global flag: a bfloat16 parameter
or activation takes 2 bytes an element (its gradient too), and a parameter whose optimizer keeps
a master copy (Paddle's O2: the persistable ``<param>_fp32_master_0``; ``TensorInfo.master``,
its dtype) holds it beside its states, placed as they are (ZeRO shards masters and states
alike). Adam in mixed precision: 2 + 2 + 4 + 8 bytes per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from autopar.cost_model.cluster import dtype_bytes
from autopar.cost_model.compute import OPTIMIZERS
from autopar.dist_attr import DistAttr
from autopar.errors import CostModelError


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor as the memory model sees it: global shape, dtype, placement (None: whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    dist: DistAttr | None = None
    master: str | None = None  # a parameter's master copy's dtype (O2: "float32"); None: no master


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one rank holds, by category."""

    rank: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations


def tensor_bytes(shape: Sequence[int], dtype: str, dist: DistAttr | None, rank: int) -> int:
    """Bytes of ``rank``'s piece (0 if ``rank`` is not on the tensor's mesh)."""
    if dist is None:
        return math.prod(shape) * dtype_bytes(dtype)
    if rank not in dist.mesh.ranks:
        return 0
    return math.prod(dist.local_shape(shape, rank)) * dtype_bytes(dtype)


def memory_per_rank(
    ranks: Iterable[int],
    parameters: Sequence[TensorInfo],
    activations: Sequence[TensorInfo] = (),
    optimizer: str = "adam",
    grad_dists: Mapping[str, DistAttr] | None = None,
    state_dists: Mapping[str, DistAttr] | None = None,
) -> dict[int, MemoryEstimate]:
    """Memory of each rank: parameters, their gradients and optimizer states (with each
    parameter's master copy, placed like its states), saved activations."""
    if optimizer not in OPTIMIZERS:
        raise CostModelError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)}")
    states = OPTIMIZERS[optimizer][1]
    grad_dists, state_dists = grad_dists or {}, state_dists or {}
    out = {}
    for rank in ranks:
        params = sum(tensor_bytes(p.shape, p.dtype, p.dist, rank) for p in parameters)
        grads = sum(tensor_bytes(p.shape, p.dtype, grad_dists.get(p.name, p.dist), rank) for p in parameters)
        opt = states * sum(tensor_bytes(p.shape, "float32", state_dists.get(p.name, p.dist), rank) for p in parameters)
        opt += sum(tensor_bytes(p.shape, p.master, state_dists.get(p.name, p.dist), rank) for p in parameters if p.master)
        acts = sum(tensor_bytes(a.shape, a.dtype, a.dist, rank) for a in activations)
        out[rank] = MemoryEstimate(rank, params, grads, opt, acts)
    return out
