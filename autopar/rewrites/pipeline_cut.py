"""The automatic cut of ``PipelineConfig(stages=n)`` (stage: annotation): the stage each forward
op of an unannotated program runs on.

A stage is one contiguous run of the forward pass, cut between layers. The units cut are the
calls at the shallowest depth of Paddle's ``struct_name`` paths at which one layer class is
called at least ``n`` times — the repeated blocks, however deep they sit
(``Model/Decoder/DecoderLayer_k``: before, the one ``Model`` call around them was a single unit
and the whole model went to stage 0) — else the shallowest depth that has at least ``n`` units
(the top-level blocks when there are enough, their sub-layers only when not), so a cut does
not fall inside a residual block whose sum closes after it. Before that, every distinct path was a layer
(``/Block/``, ``/Block/Linear_1/``, ...): a block's residual add, recorded under ``/Block/``, went
back to an earlier stage than the block's second Linear — one block + a head on two stages ran
mesh0 -> mesh1 -> mesh0 (rank 0 had two stages: 1F1B refused it), and two blocks were cut after
the second's LayerNorm (its backward sent 1 -> 0 -> 1 -> 0).

The runs balance the ops' predicted time (a linear partition: the largest run as small as it
can be, each run at least one unit): each forward op weighs its forward and backward on the
cost model's device (3x the forward's roofline time: matmul FLOPs, memory-bound ops by bytes;
an op the compute table lacks by its bytes) plus a launch cost per op. Before, each op weighed
one: a wide first block and three narrow ones were cut two and two, the wide one's stage four
times slower. An op of no layer goes with the op before it; a unit met again
after a later one (a layer called twice) stays on the later stage: runs never go back. Run ``i``
is on ``mesh[i % mesh.shape[0]]``: with ``n`` = the pipeline ranks each rank has one run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from autopar.cost_model import op_cost_or_traffic
from autopar.cost_model.cluster import Cluster
from autopar.errors import AnnotationError
from autopar.graph import ProgramGraph, Role
from autopar.layer_paths import path_of, repeated_depth
from autopar.mesh import ProcessMesh
from autopar.op_kinds import SOURCE_OPS

Unit = tuple[str, ...]  # a layer path cut to the chosen depth: ("Block_1",)


def layer_stages(
    graph: ProgramGraph, mesh: ProcessMesh, stages: int, placed: dict[int, ProcessMesh], cluster: Cluster,
    kept: Collection[int] = (),
) -> dict[int, ProcessMesh]:  # fmt: skip
    """Op index -> the sub-mesh ``PipelineConfig(stages=stages)`` places each forward op on
    (one stage: none, every op runs on the whole mesh, accumulating gradients). ``placed`` may
    hold ``autopar.reshard`` copies only (``kept``: the user wrote them; each keeps its mesh and
    its placement, the cut places the other ops); any other placement is the user's cut."""
    written = sorted(set(placed) - set(kept))
    if written:
        op = graph.ops[written[0]]
        raise AnnotationError(
            f"PipelineConfig(stages={stages}) places the layers itself, but {op}{_in_layer(op)} is placed on "
            f"{placed[op.index]} with shard_op: remove the shard_op placements, or stages={stages}"
        )
    if stages == 1:
        return dict(placed)
    forward = [op for op in graph.ops if op.role is Role.FORWARD and op.name not in SOURCE_OPS and op.inputs]
    paths = [_path(op) for op in forward]
    stage_of = cut_stages(paths, stages, [op_seconds(graph, op, cluster) for op in forward])
    return {op.index: mesh[stage % mesh.shape[0]] for op, stage in zip(forward, stage_of)} | dict(placed)


def _in_layer(op: Any) -> str:
    path = path_of(op)
    return f" (in {'/'.join(path)})" if path else ""


def op_seconds(graph: ProgramGraph, op: Any, cluster: Cluster) -> float:
    """A forward op's predicted forward + backward seconds on ``cluster``'s device (whole shapes:
    the cut compares runs, not ranks)."""
    inputs = [graph.values[k].shape for k in op.inputs if k is not None]
    outputs = [graph.values[k].shape for k in op.outputs if k is not None]
    dtype = next((graph.values[k].dtype for k in op.outputs if k is not None), "float32")
    cost, _ = op_cost_or_traffic(op.name, inputs, outputs, op.attrs, dtype)
    return 3.0 * cost.time(cluster, dtype) + cluster.device.op_seconds


def cut_stages(paths: Sequence[Unit | None], stages: int, weights: Sequence[float] | None = None) -> list[int]:
    """The stage of each op, given each op's layer path in forward order (None: no layer) and
    its weight (default 1 each); non-decreasing, every stage in ``0..stages-1`` used."""
    units, of_op = _units(paths, stages)
    unit_weights = [0.0] * len(units)
    for i, unit in enumerate(of_op):
        unit_weights[unit] += 1.0 if weights is None else weights[i]
    first = _partition(unit_weights, stages)
    out, stage = [], 0
    for unit in of_op:
        stage = max(stage, first[unit])
        out.append(stage)
    return out


def _path(op: Any) -> Unit | None:
    return path_of(op) or None


def _units(paths: Sequence[Unit | None], stages: int) -> tuple[list[Unit], list[int]]:
    """The units at the shallowest depth with ``stages`` of them (in the order the forward pass
    meets them) and each op's unit (an op of no layer: the op before's)."""
    deepest = max((len(p) for p in paths if p), default=0)
    repeated = repeated_depth([p for p in paths if p], times=stages)  # the repeated blocks, however deep
    for depth in [repeated] if repeated is not None else range(1, deepest + 1):
        units = list(dict.fromkeys(p[:depth] for p in paths if p))
        if len(units) >= stages:
            break
    else:
        layers = list(dict.fromkeys("/" + "/".join(p) + "/" for p in paths if p))
        raise AnnotationError(
            f"PipelineConfig(stages={stages}): the program has {len(layers)} layers ({layers}) to split"
        )
    index = {unit: i for i, unit in enumerate(units)}
    of_op, current = [], 0
    for path in paths:
        current = index[path[:depth]] if path else current
        of_op.append(current)
    return units, of_op


def _partition(weights: Sequence[float], parts: int) -> list[int]:
    """Unit -> its part: ``parts`` contiguous non-empty runs of ``weights`` whose largest sum is
    the smallest possible (ties: the earliest cuts)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest largest sum of the first i units in k runs; cut[k][i]: its last run's start
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    part, end = [0] * n, n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        part[start:end] = [k - 1] * (end - start)
        end = start
    return part
