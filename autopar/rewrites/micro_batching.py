"""Micro-batching: the serial program as it runs on one micro-batch (stage: serial rewrite,
before propagation).

A pipeline splits each step's global batch into ``m`` equal micro-batches and runs forward and
backward once per micro-batch; the optimizer runs once per step on the gradients summed over
the micro-batches. Which values shrink, and how, is a sharding question: micro-batches are
data parallelism along a sequential axis. So this module propagates a split of every feed's
batch dim over a 1-d ``micro_batch`` mesh of size ``m`` with the ordinary SPMD rules, and
reads off:

- each value's shape on one micro-batch (the graph's shapes become these; every later stage,
  real propagation and partition included, works on one micro-batch);
- the local correction an op's rule asks for (a mean over the micro-batch is scaled by
  1/m so that losses and gradients become partial sums over the micro-batches);
- the values pending a sum over the micro-batches: the gradients the optimizer reads (the
  runtime accumulates them) and the losses (a fetch adds the micro-batches' pieces).

An op that needs a value whole over the batch before the optimizer (batch statistics, a
reshape folding the batch into another dim) cannot run one micro-batch at a time: refused
by name (an ``autopar.local_map`` region, whose serial meaning is per shard of the whole batch,
naming its opt-in ``groups``). A training dropout can: each micro-batch applies its rows of the serial whole-batch
mask (:mod:`autopar.passes.dropout_slicing` draws it and picks them by the micro-batch's
number, fed as :data:`autopar.feed_names.MICRO_BATCH_FEED`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import OpNode, ProgramGraph, Role, ValueKey, copied_keys
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult, ReshardNeed, SiteKind, propagate
from autopar.rewrites.whole_feeds import WHOLE_BATCH, feed_only
from autopar.spmd import RuleContext, TensorSpec, get_rule, ops_where
from autopar.spmd.base import SpmdRule
from autopar.spmd.batch_norm import split_statistics
from autopar.spmd.vocab_parallel import split_row
from autopar.sub_meshes import local_region_ops

SHAPE_ATTR_OPS = ops_where("shape_attr")  # (reshape, full, expand)

# the opt-in for statistics over all the step's tokens (a router's cumsum over token slots, the
# mean or max of its expert counts), named by every refusal: computed per group of tokens in the
# program itself, its serial meaning is per group, and micro-batches holding whole groups are exact
PER_GROUP = (
    "Statistics over the step's tokens (a router's cumsum over token slots, the mean or max of its expert counts) "
    "run per micro-batch only where the program computes them per group of tokens: route over a leading groups "
    "dim whose count micro_batches divides (the zoo MoE: Config(router_groups=...); docs/moe.md, 'Pipelines')"
)


# the same opt-in for an autopar.local_map region (a router per rank, Paddle's LocalLayer): named
# by the refusal of a local region's split under several micro-batches
PER_LOCAL_GROUP = (
    "Opt in with local_map(..., groups=q), q a multiple of micro_batches: each copy runs fn on q groups of its rows, "
    "group-major, so each micro-batch holds whole groups and the serial reference computes per group too (the zoo "
    "MoE with experts='local': Config(router_groups=q x copies); docs/moe.md, 'Pipelines'); or use one micro-batch"
)


@dataclass(frozen=True)
class MicroBatching:
    """The micro-batch analysis of one program (see the module docstring)."""

    count: int
    placements: Mapping[ValueKey, DistAttr]  # over the 1-d micro_batch mesh
    scales: Mapping[int, float]  # op index -> factor applied to its float results
    feeds: Mapping[str, int]  # feed name -> the dim split into micro-batches
    # reads (op index, operand) of a whole-batch value made from feeds alone (a count of valid
    # tokens): the micro-batching rewrite makes them from the whole feeds (rewrites/whole_feeds.py)
    whole_reads: tuple[tuple[int, int], ...] = ()

    def pending_sum(self, key: ValueKey) -> bool:
        """Whether ``key`` is a partial sum over the micro-batches (add the pieces)."""
        return self.placements[key].partial_dims.get(0) == "sum"

    def moved(
        self, positions: Sequence[int | None], copies: Mapping[int, int], graph: ProgramGraph
    ) -> tuple[MicroBatching, ProgramGraph]:
        """This analysis for a rewrite of its program (recompute's clones), and ``graph`` with
        one micro-batch's shapes for the new ops: op ``i`` is now op ``positions[i]``, a copy
        (``copies``: new op -> the op it copies) is placed and scaled as that op. Another new op
        (a training dropout recomputed from its kept mask, ``x * cast(mask) / (1 - p)``) is
        placed as its rule says from what it reads, in program order; one without a rule is
        refused by name."""
        placements = copied_keys({(positions[i], j): d for (i, j), d in self.placements.items() if positions[i] is not None}, copies)
        scales = {positions[i]: f for i, f in self.scales.items() if positions[i] is not None}
        scales.update({new: scales[source] for new, source in copies.items() if source in scales})
        mesh = ProcessMesh(list(range(self.count)), ["micro_batch"])
        made: dict[ValueKey, DistAttr] = {}
        for op in graph.ops:
            if op.recomputes is not None and op.index not in copies:
                made.update(_placed_by_rule(graph, op, mesh, {**placements, **made}))
        reads = tuple((positions[i], slot) for i, slot in self.whole_reads if positions[i] is not None)
        return MicroBatching(self.count, {**placements, **made}, scales, self.feeds, reads), _shrunk(graph, made)

    def split_dim(self, key: ValueKey) -> int | None:
        """The dim of ``key`` split over the micro-batches (None: not split)."""
        for dim, mesh_dims in enumerate(self.placements[key].mapping):
            if mesh_dims:
                return dim
        return None


def micro_batching(graph: ProgramGraph, count: int) -> tuple[MicroBatching, ProgramGraph]:
    """Analyse ``graph`` for ``count`` micro-batches: the analysis, and a new view of the
    program with one micro-batch's shapes (the program's own stay in ``ValueNode.declared``).
    Every refusal of micro-batching is here. With reads of whole-batch values made from feeds
    alone, only those are returned (``whole_reads``; the rewrite copies their makers and asks
    again)."""
    mesh = ProcessMesh(list(range(count)), ["micro_batch"])
    feeds, annotations = {}, {}
    for key, value in graph.values.items():
        if value.kind != "feed" or not value.shape or value.name.endswith(WHOLE_BATCH):  # (a whole-batch copy: whole)
            continue
        if value.shape[0] % count:
            raise AutoparError(
                f"micro-batching: feed {value.label!r} has {value.shape[0]} rows (dim 0), which {count} micro-batches "
                "do not divide evenly; choose micro_batches dividing the global batch"
            )
        feeds[value.name] = 0
        annotations[key] = DistAttr(mesh, [0] + [-1] * (len(value.shape) - 1))
    result = _cut_whole_batch_values(graph, mesh, annotations)
    reshards = [need for need in result.reshards if not _accumulated(graph, need)]
    whole_reads = tuple(
        (need.op, need.site.slot) for need in reshards
        if need.site.kind is SiteKind.BEFORE_READ and not need.need.sharded_mesh_dims() and feed_only(graph, need.value)
    )  # fmt: skip
    if whole_reads:  # made from the whole feeds first (.whole_feeds); then the rest is decided again
        return MicroBatching(count, {}, {}, feeds, whole_reads), graph
    local = local_region_ops(graph)
    for need in reshards:
        op = graph.ops[need.op]
        value = graph.values[need.value]
        if local and (op.index in local or _feeds_region(graph, op, local)):
            raise AutoparError(
                f"micro-batching: {op}{_layer(op)} {'takes apart' if op.index not in local else 'reads'} {value.label} "
                f"{list(value.shape)} for an autopar.local_map region ({need.need} over the micro-batches, which hold "
                f"{need.have}). Its serial meaning applies fn to each rank's shard of the whole batch; {count} "
                f"micro-batches would apply it to each micro-batch's shards instead. {PER_LOCAL_GROUP}"
            )
        if need.site.kind is SiteKind.AFTER_PRODUCER or _cuttable(graph, need.value, need.have, need.need):
            maker = graph.ops[need.value[0]]
            raise AutoparError(
                f"micro-batching: {maker}{_layer(maker)} makes {value.label} {list(value.shape)} whole over the batch, and "
                f"{op} reads one micro-batch's rows of it ({need.need}); no rule lets {maker.name} make a micro-batch's "
                f"piece: compute it from the inputs' rows, or use one micro-batch. {PER_GROUP}"
            )
        raise AutoparError(
            f"micro-batching: {op}{_layer(op)} reads {value.label} as {need.need}, but one micro-batch holds {need.have}; "
            f"the op needs the whole batch at once and cannot run one micro-batch at a time. {PER_GROUP}"
        )
    placements = {k: s.dist for k, s in result.states.items()}
    _refuse_whole_batch_normalization(graph, placements)
    scales = {op.index: _scale(graph, result.op_results[op.index], op) for op in graph.ops if op.index in result.op_results}
    analysis = MicroBatching(count, placements, {k: f for k, f in scales.items() if f != 1.0}, feeds)
    return analysis, _shrunk(graph, placements)


def recounted(micro: MicroBatching, graph: ProgramGraph, count: int) -> tuple[MicroBatching, ProgramGraph] | None:
    """The analysis of ``graph`` for ``count`` micro-batches from ``micro``, its analysis for
    another count: the same values split the same way, rescaled (None where a split dim
    ``count`` does not divide: then it is made afresh). Micro-batch propagation runs without a
    cost model, and a rule's choice depends on the mesh size only through whether it divides a
    dim: where every dim split one way splits the other, both propagations take the same steps
    (tests/unit/test_analysis.py compares them)."""
    mesh = ProcessMesh(list(range(count)), ["micro_batch"])
    placements = {}
    for key, dist in micro.placements.items():
        moved = DistAttr(mesh, dist.mapping, dist.partial)
        if dist.sharded_mesh_dims():
            value = graph.values[key]
            if any(dims and (size <= 0 or size % count) for size, dims in zip(value.shape, dist.mapping)):
                return None
        placements[key] = moved
    scales = {}
    for index in micro.scales:  # (only ops that rescale do so for any count)
        op = graph.ops[index]
        specs = [None if k is None else TensorSpec(graph.values[k].program_shape, placements[k], graph.values[k].dtype) for k in op.inputs]
        factor = float(get_rule(op.name).local_scale(specs, op.attrs, 0))
        if factor != 1.0:
            scales[index] = factor
    return MicroBatching(count, placements, scales, micro.feeds, micro.whole_reads), _shrunk(graph, placements)


def _placed_by_rule(
    graph: ProgramGraph, op: OpNode, mesh: ProcessMesh, placements: Mapping[ValueKey, DistAttr]
) -> dict[ValueKey, DistAttr]:
    """The placements of ``op``'s results over the micro_batch ``mesh`` that its rule infers
    from its inputs' (an input not placed, a constant, is whole on every micro-batch)."""
    rule = get_rule(op.name)
    if rule is None:
        raise AutoparError(
            f"micro-batching: {op}, recomputed by Strategy.recompute, copies no op of the program and has no SPMD rule"
        )

    def spec(key: ValueKey, dist: DistAttr | None) -> TensorSpec:
        value = graph.values[key]
        return TensorSpec(value.program_shape, dist or DistAttr(mesh, [-1] * len(value.program_shape)), value.dtype)

    inputs = [None if key is None else spec(key, placements.get(key)) for key in op.inputs]
    outputs = rule.infer_forward(inputs, op.attrs, RuleContext(mesh, op_name=op.name)).outputs
    return {
        key: dist if dist is not None else spec(key, None).dist
        for key, dist in zip(op.outputs, outputs) if key is not None and graph.values[key].kind != "vector"
    }  # fmt: skip


def _cut_whole_batch_values(graph: ProgramGraph, mesh: ProcessMesh, feeds: dict[ValueKey, DistAttr]) -> PropagationResult:
    """Propagate the feeds' split; then every value built whole over the batch without reading
    a feed (``paddle.ones([batch, seq])``, an expand of a position table to the batch) that a
    micro-batch's op reads as its rows is cut too: annotated with that split (strategy
    priority), and, where its producer cannot make the split from what it reads, the producer's
    inputs as its rule says it would need them — back to the constants it is built from, which
    make one micro-batch's rows (a ``full`` its shape, an expand its target). Repeated while
    such reads remain (each round reaches one op further back)."""
    cut: dict[ValueKey, DistAttr] = {}
    for _ in range(len(graph.ops) + 1):
        result = propagate(graph, mesh, feeds, {}, strategy=cut)
        more: dict[ValueKey, DistAttr] = {}
        for need in result.reshards:
            if need.site.kind is SiteKind.AFTER_PRODUCER and need.value in cut:
                more.update(_inputs_making(graph, mesh, result, need))
            elif _cuttable(graph, need.value, need.have, need.need):
                more[need.value] = need.need
        more = {key: dist for key, dist in more.items() if key not in cut}
        if not more:
            return result
        cut.update(more)
    return result


def _inputs_making(graph: ProgramGraph, mesh: ProcessMesh, result: PropagationResult, need: ReshardNeed) -> dict[ValueKey, DistAttr]:
    """The cuttable inputs of ``need.value``'s producer, placed as its rule needs them to make
    ``need.need`` (empty without a rule: the producer is then refused by name)."""
    op = graph.ops[need.value[0]]
    rule = get_rule(op.name)
    if rule is None:
        return {}
    specs = [None if k is None else TensorSpec(graph.values[k].shape, result.dist(k), graph.values[k].dtype) for k in op.inputs]
    outs = [
        None if k is None else TensorSpec(graph.values[k].shape, need.need if k == need.value else None, graph.values[k].dtype)
        for k in op.outputs
    ]  # fmt: skip
    wanted = rule.infer_backward(specs, outs, op.attrs, RuleContext(mesh, op_name=op.name)).inputs
    return {
        key: dist for key, dist in zip(op.inputs, wanted)
        if key is not None and dist is not None and _cuttable(graph, key, result.dist(key), dist)
    }  # fmt: skip


def _cuttable(graph: ProgramGraph, key: ValueKey, have: DistAttr, need: DistAttr) -> bool:
    """A read of a micro-batch's rows of a value that is whole (not pending) over the batch
    and is not a parameter, state or feed (those hold the same thing every micro-batch, or
    are split already)."""
    return (
        bool(need.sharded_mesh_dims()) and not have.partial and not have.sharded_mesh_dims()
        and graph.values[key].kind in ("activation", "constant")
    )  # fmt: skip


def _accumulated(graph: ProgramGraph, need: ReshardNeed) -> bool:
    """A read by the once-per-step update of a sum pending over the micro-batches: the runtime
    accumulates it (gradients; a masked mean's parts, :mod:`.masked_mean`); or of a reduction
    the update phase itself leaves pending over them (dynamic loss scaling's overflow flag, a
    max over the gradients it checks): that phase runs once, on the accumulated sums, so what
    it makes is whole there."""
    if graph.ops[need.op].role is not Role.OPTIMIZER or not need.need.is_replicated:
        return False
    if need.have.partial_dims == {0: "sum"}:
        return True
    made_in_update = graph.ops[need.value[0]].role is Role.OPTIMIZER
    return made_in_update and bool(need.have.partial_dims) and not need.have.sharded_mesh_dims()


def _feeds_region(graph: ProgramGraph, op: OpNode, local: set[int], hops: int = 3) -> bool:
    """Whether ``op``'s results reach a local region's op within ``hops`` reads (``local_map``'s
    own reshape and split of its input, a ``builtin.split`` of a vector between)."""
    frontier = [op.index]
    for _ in range(hops):
        frontier = [user for index in frontier for key in graph.ops[index].outputs if key is not None for user in graph.values[key].users]
        if any(index in local for index in frontier):
            return True
    return False


def _layer(op: OpNode) -> str:
    path = str(op.attrs.get("struct_name") or "").strip("/")
    return f" (in {path})" if path else ""


def _refuse_whole_batch_normalization(graph: ProgramGraph, placements: Mapping[ValueKey, DistAttr]) -> None:
    """Batch statistics, or a row normalized over the batch: micro-batches run one after
    another, so no all_reduce can give the whole batch's statistics or finish the row."""
    for op in graph.ops:
        if not op.inputs or op.inputs[0] is None:
            continue
        inputs = [None if key is None else placements.get(key) for key in op.inputs]
        value = graph.values[op.inputs[0]]
        if split_statistics(op.name, op.attrs, inputs, value.shape) is not None:
            raise AutoparError(
                f"micro-batching: {op} takes batch statistics over {value.label}, which each micro-batch holds a "
                "piece of; the statistics need the whole batch at once"
            )
        split = split_row(op.name, op.attrs, inputs)
        if split is not None:
            value = graph.values[op.inputs[split.operand]]
            raise AutoparError(
                f"micro-batching: {op} normalizes over dim {split.axis} of {value.label}, which each micro-batch holds "
                "a piece of; the op needs the whole batch at once and cannot run one micro-batch at a time"
            )


def _shrunk(graph: ProgramGraph, placements: Mapping[ValueKey, DistAttr]) -> ProgramGraph:
    shapes_of: dict[ValueKey, tuple[int, ...]] = {}
    for key, value in graph.values.items():
        dist = placements.get(key)
        if dist is None or value.kind == "vector" or not dist.sharded_mesh_dims():
            continue
        parts = [dist.mesh.size if dims else 1 for dims in dist.mapping]  # (a 1-d micro_batch mesh)
        if all(size > 0 and size % n == 0 for size, n in zip(value.shape, parts)):
            shapes_of[key] = tuple(size // n for size, n in zip(value.shape, parts))
            continue
        shapes = {dist.local_shape(value.shape, r) for r in dist.mesh.ranks}
        if len(shapes) > 1:
            raise AutoparError(
                f"micro-batching: {value.label} of shape {list(value.shape)} would split unevenly into micro-batches "
                f"({sorted(shapes)}); choose micro_batches dividing it"
            )
        shape = shapes.pop()
        if shape != value.shape:
            shapes_of[key] = shape
    attrs = {}
    for op in graph.ops:  # sizes written into an op (a reshape's target, a full's shape) shrink with its result
        out = op.outputs[0] if op.outputs else None
        if op.name in SHAPE_ATTR_OPS and out in shapes_of and "shape" in op.attrs:
            attrs[op.index] = {"shape": list(shapes_of[out])}
    return graph.derived(shapes_of, attrs)


def _scale(graph: ProgramGraph, inferred, op) -> float:
    rule = get_rule(op.name)
    if rule is None or type(rule).local_scale is SpmdRule.local_scale:
        return 1.0
    specs = [
        None if key is None else TensorSpec(graph.values[key].program_shape, dist, graph.values[key].dtype)
        for key, dist in zip(op.inputs, inferred.inputs)
    ]
    return float(rule.local_scale(specs, op.attrs, 0))
