"""Cost-based choice between competing placements (stage: propagate).

Where placements compete (two operands of a matmul split the same letter differently, a
parameter whose consumers want different placements), the propagation asks
:func:`choose_placement`: every option lists the reshards it needs and its compute time; the
smaller total wins (ties: the earlier option, so the caller's default order stands), and the
returned :class:`PlacementChoice` carries both costs for the conflict report.

:func:`make_resolver` builds a callable for ``RuleContext.resolve`` (see
``autopar.spmd.base.merge_letters``) for an einsum-described op: option = "the letter takes
this operand's split"; its reshards = every other operand that has the letter moving to that
split; its compute = the op's einsum cost with the letter split that way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.cost_model.cluster import Cluster, default_cluster
from autopar.cost_model.compute import einsum_cost
from autopar.cost_model.planner import ReshardPlan, plan_reshard
from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh
from autopar.units import format_time


@dataclass(frozen=True, slots=True)
class PlacementOption:
    """One candidate: a label, the reshards it needs ``(have, need, global shape, dtype)``, compute seconds."""

    label: str
    reshards: tuple[tuple[DistAttr, DistAttr, tuple[int, ...], str], ...] = ()
    compute: float = 0.0


@dataclass(frozen=True, slots=True)
class PlacementChoice:
    """The winner (``index``) and every option's reshard plans, reshard and compute seconds."""

    index: int
    labels: tuple[str, ...]
    plans: tuple[tuple[ReshardPlan, ...], ...]
    compute_times: tuple[float, ...]

    @property
    def reshard_times(self) -> tuple[float, ...]:
        return tuple(sum(p.time for p in plans) for plans in self.plans)

    @property
    def totals(self) -> tuple[float, ...]:
        return tuple(r + c for r, c in zip(self.reshard_times, self.compute_times))

    @property
    def reason(self) -> str:
        """``lower cost: A 12.3us (reshard 10.0us + compute 2.3us) vs B 20.1us (...)``."""
        parts = [
            f"{label} {format_time(total)} (reshard {format_time(r)} + compute {format_time(c)})"
            for label, total, r, c in zip(self.labels, self.totals, self.reshard_times, self.compute_times)
        ]
        winner = parts[self.index]
        others = [p for i, p in enumerate(parts) if i != self.index]
        return f"lower cost: {winner} vs {' vs '.join(others)}" if others else f"only option: {winner}"


def choose_placement(options: Sequence[PlacementOption], cluster: Cluster | None = None) -> PlacementChoice:
    """The option with the smallest reshard + compute time (ties: the earliest)."""
    if not options:
        raise ValueError("choose_placement needs at least one option")
    plans = []
    for option in options:
        plans.append(
            tuple(plan_reshard(have, need, shape, dtype, cluster) for have, need, shape, dtype in option.reshards)
        )
    choice = PlacementChoice(0, tuple(o.label for o in options), tuple(plans), tuple(o.compute for o in options))
    totals = choice.totals
    best = min(range(len(options)), key=lambda i: (round(totals[i] * 1e12), i))
    return PlacementChoice(best, choice.labels, choice.plans, choice.compute_times)


@dataclass
class CostResolver:
    """``RuleContext.resolve`` for an einsum op: ``resolver(letter, [(operand, mesh dims), ...]) -> position``.

    ``choices`` collects ``(letter, PlacementChoice)`` for each call, for the conflict report.
    """

    equation: str
    specs: Sequence[Any]  # autopar.spmd.TensorSpec (shape, dist, dtype) per operand; None for absent
    mesh: ProcessMesh
    cluster: Cluster | None = None
    choices: list[tuple[str, PlacementChoice]] = field(default_factory=list)

    def __call__(self, where: str, candidates: list[tuple[int, tuple[int, ...]]]) -> int:
        letters = self.equation.split("->")[0].split(",")
        sizes = {c: s for spec, term in zip(self.specs, letters) if spec is not None for c, s in zip(term, spec.shape)}
        dtype = next((s.dtype for s in self.specs if s is not None), "float32")
        cluster = self.cluster or default_cluster().fitted(self.mesh.ranks)
        options = []
        for operand, dims in candidates:
            reshards = []
            for spec, term in zip(self.specs, letters):
                if spec is None or spec.dist is None or where not in term:
                    continue
                need = _with_split(spec.dist, term.index(where), dims)
                if need != spec.dist:
                    reshards.append((spec.dist, need, tuple(spec.shape), spec.dtype))
            parts = math.prod(self.mesh.shape[d] for d in dims)
            compute = einsum_cost(self.equation, sizes, dtype, {where: parts}).time(cluster, dtype)
            names = "/".join(self.mesh.dim_names[d] for d in dims) or "not split"
            options.append(PlacementOption(f"operand {operand} ({where} over {names})", tuple(reshards), compute))
        choice = choose_placement(options, cluster)
        self.choices.append((where, choice))
        return choice.index


def _with_split(dist: DistAttr, tensor_dim: int, dims: tuple[int, ...]) -> DistAttr:
    """``dist`` with ``tensor_dim`` split over ``dims`` (those mesh dims freed elsewhere)."""
    mapping = [tuple(d for d in m if d not in dims) for m in dist.mapping]
    mapping[tensor_dim] = tuple(dims)  # in the order given: it is the piece order
    partial = {d: k for d, k in dist.partial if d not in dims}
    return DistAttr(dist.mesh, mapping, partial)


def make_resolver(
    equation: str, specs: Sequence[Any], mesh: ProcessMesh, cluster: Cluster | None = None
) -> CostResolver:
    """A cost-based ``RuleContext.resolve`` for an op described by ``equation`` over ``specs``."""
    return CostResolver(equation, list(specs), mesh, cluster)
