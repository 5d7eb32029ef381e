"""Ring attention's share of a compiled step's price (stage: strategy search and cost report;
:mod:`autopar.pricing` asks it; issue 39).

Compile plans a context-parallel program's collectives as the all-gather-KV plan (K and V
gathered for each attention core) and the ring lowering (:mod:`autopar.passes.ring_attention`)
replaces those gathers, in every rank's program, by the ring's shifts: ``cp - 1`` permutes of
the ``[k|v]`` block forward, ``cp - 1`` of ``[k|v|dk|dv]`` and one of ``[dk|dv]`` backward, and
under recompute ``cp - 1`` of ``[k|v]`` again where the backward re-runs the core (its
:class:`RingPlan` holds each shift's planned step). Priced here, without a rank program:

- the collectives the ring takes the place of (the reshards only the core's own ops read: its K
  and V gathers; the reduce_scatters of dK / dV right after their grad ops) are left out of the
  step (:func:`replaced`);
- each shift runs behind one block's attention (the shift carries the block the next step
  computes with): of the ``cp - 1`` forward shifts, each hides ``min(shift, block)``, a block
  being ``1/cp`` of the core's forward compute on the rank; likewise backward against ``1/cp``
  of the core's backward; the last ``[dk|dv]`` shift home hides nothing (:func:`ring_costs`,
  the bound of ``cost_model/context_parallel.py`` on the compiled program);
- the backward recomputes each block's probabilities from the log-sum-exp: the core's scores
  product, middle and softmax once more;
- memory: the core keeps q, its own K/V block, the output and the fp32 log-sum-exp, not its
  scores or probabilities (:func:`unkept` and :func:`lse_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.cost_model.planner import group_at
from autopar.cost_model.precision import AS_BUILT, Precision, rescaled_time
from autopar.passes.base import CompileState


@dataclass(frozen=True, slots=True)
class RingCost:
    """One rank's ring shifts per micro-batch: seconds, seconds run behind the blocks, bytes
    sent, permutes; and the backward's recomputed probabilities (seconds)."""

    seconds: float = 0.0
    hidden: float = 0.0
    sent: int = 0
    count: int = 0
    recompute: float = 0.0


def rings(state: CompileState) -> tuple[Any, ...]:
    """The planned rings (:class:`autopar.passes.ring_attention.RingCore`), none without ring attention."""
    from autopar.passes.ring_attention import RingPlan

    plan = state.result(RingPlan)
    return plan.cores if plan is not None else ()


def replaced(state: CompileState) -> set[int]:
    """The planned reshards the rings take the place of: those read only by a core's own ops
    (its K / V gathers and every other read the ring cuts from the value as produced; the
    lowering erases them with the core) and the reduce_scatters of dK / dV right after their
    grad op, whose blocks the ring hands on as they are (``RingCore.split_grads``)."""
    from autopar.propagation import SiteKind

    found = rings(state)
    cores = {i for ring in found for i in (*ring.core.ops, *ring.core.backward, *ring.core.recomputed)}
    grads = {key for ring in found for key in ring.split_grads}
    readers: dict[int, list[int]] = {}  # each emitted reshard (the first of those sharing it) -> the ops reading it
    for planned in state.reshards:
        readers.setdefault(planned.index if planned.shared_with is None else planned.shared_with, []).append(planned.need.op)
    out = set()
    for planned in state.reshards:
        root = planned.index if planned.shared_with is None else planned.shared_with
        if all(op in cores for op in readers[root]):
            out.add(planned.index)
        elif planned.need.value in grads and planned.need.site.kind is SiteKind.AFTER_PRODUCER:
            out.add(planned.index)
    return out


def ring_costs(
    state: CompileState, ranks: list[int], seconds: Callable[[Any, int], float], precision: Precision = AS_BUILT
) -> dict[int, RingCost]:  # fmt: skip
    """Each of ``ranks``' ring shifts (module docstring); ``seconds(op, rank)``: an op's priced
    seconds on a rank (the core's blocks are read off its ops); ``precision``: the shifts move
    K / V in it (a float32 program priced as bfloat16: half the bytes, by the alpha-beta formula)."""
    graph, meshes = state.graph, state.propagation.op_meshes
    out = {rank: RingCost() for rank in ranks}
    for ring in rings(state):
        core, parts = ring.core, ring.parts
        ratio = precision.ratio(graph.values[core.k].dtype, graph.values[core.k].kind)
        for rank in ranks:
            if rank not in meshes.get(core.first, state.mesh).ranks:
                continue
            moved = [_moved(step, rank, ratio, state.cluster) for step in ring.shifts]
            (forward_shift, backward_shift, home, rerun), sizes = zip(*moved)
            forward = sum(seconds(graph.ops[i], rank) for i in core.ops)
            backward = sum(seconds(graph.ops[i], rank) for i in core.backward)
            again = sum(seconds(graph.ops[i], rank) for i in (core.first, *core.middle, core.softmax))
            shifts, reruns = parts - 1, (parts - 1 if ring.recomputed is not None else 0)  # (recompute: the forward ring again)
            cost = RingCost(
                shifts * (forward_shift + backward_shift) + home + reruns * rerun,
                shifts * (min(forward_shift, forward / parts) + min(backward_shift, (backward + again) / parts))
                + reruns * min(rerun, forward / parts),
                sum(size * n for size, n in zip(sizes, (shifts, shifts, 1, reruns))),
                2 * shifts + 1 + reruns,
                again,
            )
            was = out[rank]
            out[rank] = RingCost(*(a + b for a, b in zip(_fields(was), _fields(cost))))
    return out


def _moved(step: Any, rank: int, ratio: float, cluster: Any) -> tuple[float, int]:
    """A shift's seconds and bytes on ``rank`` moving ``ratio`` times its planned bytes."""
    if ratio == 1.0:
        return step.time, step.bytes
    group = tuple(group_at(step.src.mesh, rank, step.mesh_dims))
    return rescaled_time("permute", group, step.bytes, step.time, ratio, cluster), int(step.bytes * ratio)


def _fields(cost: RingCost) -> tuple:
    return cost.seconds, cost.hidden, cost.sent, cost.count, cost.recompute


def unkept(state: CompileState) -> set[Any]:
    """Values the all-gather plan keeps for the backward that a ring does not: each core's
    scores, middle values, probabilities and dropout (what its ops make but the output)."""
    graph = state.graph
    out = set()
    for ring in rings(state):
        for index in ring.core.ops:
            out.update(key for key in graph.ops[index].outputs if key is not None and key != ring.core.output)
    return out


def lse_bytes(state: CompileState, rank: int, local: Callable[[Any, Any, int], tuple[int, ...]]) -> int:
    """The fp32 log-sum-exp each ring keeps on ``rank``: one value per query row of its q."""
    total = 0
    for ring in rings(state):
        q = ring.core.q
        dist = state.propagation.dist(q)
        if rank in dist.mesh.ranks:
            total += math.prod(local(state.graph.values[q].shape, dist, rank)[:-1]) * 4
    return total
