"""Values of the whole batch that a micro-batch reads, computed from the whole feed (stage:
rewrite, part of micro-batching).

A loss averaged over the valid tokens, ``sum(token_loss * valid) / sum(valid)``, divides each
micro-batch's part by the count of valid tokens of the *whole* batch: the mean of the
micro-batches' means (what Paddle's pipeline computes) is not the serial loss. The count reads
the labels only — a feed — and every micro-batch's labels are known when the step starts. So
the ops making such a value (from feeds and constants alone) are copied to read the whole
feed, a second ``pd_op.data`` named ``<feed>@whole_batch`` that the pipeline runner gives the
step's whole array in every micro-batch, and the reads that need the whole value read the
copy. Each micro-batch's loss and gradient are then its exact share of the serial ones; their
sum over the micro-batches is the serial loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.feed_names import WHOLE_BATCH
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_OPS
from autopar.rewrites.recompute import clone_reading

if TYPE_CHECKING:
    from paddle.pir import Program


def feed_only(graph: ProgramGraph, key: ValueKey) -> bool:
    """Whether ``key`` is computed from feeds and constants alone (forward ops, no parameter,
    state or random op on the way)."""
    seen, pending = set(), [key]
    while pending:
        value = graph.values[pending.pop()]
        op = graph.ops[value.key[0]]
        if op.index in seen:
            continue
        seen.add(op.index)
        if value.kind == "feed" or op.name in CONSTANT_OPS and not op.inputs:
            continue
        if value.kind in ("parameter", "state") or op.role.value != "forward" or not op.inputs:
            return False
        pending += [k for k in op.inputs if k is not None]
    return True


@dataclass(frozen=True)
class WholeFeeds:
    program: Program
    positions: tuple[int, ...]  # old op index -> new index
    meshes: Mapping[int, ProcessMesh]  # new index of each copied op -> the mesh of the read it serves
    values: tuple[str, ...]  # labels of the values now made from whole feeds

    def __str__(self) -> str:
        return f"{', '.join(self.values)} made from the whole batch's feeds in every micro-batch"


def whole_feed_copies(
    program: Any, graph: ProgramGraph, reads: Iterable[tuple[int, int]], op_meshes: Mapping[int, ProcessMesh]
) -> WholeFeeds:  # fmt: skip
    """Copy the makers of the values read at ``reads`` ((reader op index, operand position)) to
    read whole feeds, and point those reads at the copies (module docstring)."""
    import paddle

    reads = sorted(set(reads))
    work = program.clone()
    raw = list(work.global_block().ops)
    ids = {r.id: (i, j) for i, op in enumerate(raw) for j, r in enumerate(op.results()) if r.initialized()}
    made: dict[ValueKey, Any] = {}  # serial value -> its whole-batch copy
    meshes: dict[Any, ProcessMesh] = {}
    with paddle.static.program_guard(work):
        for reader, slot in reads:
            key = graph.ops[reader].inputs[slot]
            site_op, operand = graph.ops[reader].sites[slot]
            paddle.pir.set_insertion_point(raw[site_op])
            copy = _copy(graph, raw, ids, made, key, op_meshes.get(reader), meshes)
            raw[site_op].operand(operand).set_source(copy)
        paddle.pir.reset_insertion_point_to_end()
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    positions = tuple(where[op.id()] for op in raw)
    labels = tuple(dict.fromkeys(graph.values[graph.ops[r].inputs[s]].label for r, s in reads))
    return WholeFeeds(work, positions, {where[op.id()]: m for op, m in meshes.items()}, labels)


def _copy(graph: ProgramGraph, raw: list[Any], ids: Mapping, made: dict, key: ValueKey, mesh: ProcessMesh | None, meshes: dict) -> Any:
    """The whole-batch copy of ``key`` (its makers copied first), at the insertion point."""
    import paddle

    if key in made:
        return made[key]
    value, op = graph.values[key], graph.ops[key[0]]
    if op.name in CONSTANT_OPS and not op.inputs:
        return raw[key[0]].result(key[1])  # a constant is the same for the whole batch
    if value.kind == "feed":
        whole = made[key] = paddle.static.data(value.name + WHOLE_BATCH, list(value.program_shape), value.dtype)
        inserted = [whole.get_defining_op()]
    else:

        def source_of(source: Any) -> Any:
            known = source.initialized() and source.id in ids
            return _copy(graph, raw, ids, made, ids[source.id], mesh, meshes) if known else source

        inserted = clone_reading(raw[key[0]], source_of)
        made.update({(key[0], j): result for j, result in enumerate(inserted[-1].results())})
    if mesh is not None:
        meshes.update(dict.fromkeys(inserted, mesh))
    return made[key]
