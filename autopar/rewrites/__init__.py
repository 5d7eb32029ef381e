"""Serial rewrites: what a Strategy changes before propagation, one protocol for all
(stage: rewrites, between annotate and propagate).

compile = annotate -> **rewrites** -> propagate -> passes. A rewrite takes the analysis built
so far, an :class:`Analysed` value, and returns a new one; it never edits its input. What it
may change: the program (a rewritten clone: recompute), the graph view of it (one micro-batch's
shapes, per-rank batch statistics), the annotations it adds at strategy priority (below the
user's, above the rules': sequence parallelism's split activations), the op meshes (pipeline
stages), and its own typed decision (``micro``, ``recompute``, ``sequence``) with a one-line
report. The Strategy declares the list (:func:`autopar.compile_plan.rewrites_for`), printed first by
``print(dist.passes)``; every refusal of one kind lives in the rewrite that makes the decision
(micro-batching's in :mod:`.micro_batching`).

Why a value: one analysis serves several strategies (``autopar.analyze``), and the passes read
what each rewrite decided as typed fields of the compile state, never a mutated graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from autopar.annotate import annotations_of
from autopar.attention_cores import attention_cores
from autopar.dist_attr import DistAttr
from autopar.errors import AnnotationError, AutoparError
from autopar.graph import ProgramGraph, Role, ValueKey, copied_keys
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult, propagate, transplant
from autopar.recompute_clones import clone_outputs
from autopar.rewrites.context_parallel import (
    ULYSSES,
    ZIGZAG,
    ContextSplit,
    head_placements,
    head_splits,
    sequence_after,
    sequence_carriers,
    sequence_feeds,
    sequence_length,
)
from autopar.rewrites.dead_ops import dead_ops
from autopar.rewrites.loss_scaling import loss_scaling_results
from autopar.rewrites.masked_mean import deferred_means
from autopar.rewrites.micro_batching import MicroBatching, recounted
from autopar.rewrites.micro_batching import micro_batching as micro_batch_view
from autopar.rewrites.pipeline_cut import layer_stages
from autopar.rewrites.recompute import Recomputation
from autopar.rewrites.recompute import recompute as recompute_program
from autopar.rewrites.sequence_parallel import SequenceRegions, sequence_regions
from autopar.rewrites.stage_constants import stage_constants as copy_constants
from autopar.rewrites.stage_inference import infer_stages, on_stages, reader_stages
from autopar.rewrites.stage_norms import stage_norms
from autopar.rewrites.stage_overflow import stage_overflow_checks
from autopar.rewrites.static_shapes import static_shapes as constant_shapes
from autopar.rewrites.whole_feeds import whole_feed_copies
from autopar.rewrites.zigzag import refuse_work_along_the_sequence, reordered_feeds, zigzag
from autopar.shared_parameters import owner_meshes, reader_meshes
from autopar.spmd.batch_norm import LOCAL_STATISTICS, batch_statistics
from autopar.spmd.registry import op_key
from autopar.sub_meshes import onto_stage_sub_meshes, spans_stages, stage_container
from autopar.zigzag_values import zigzag_order

if TYPE_CHECKING:
    from paddle.pir import Program

    from autopar.cost_model.cluster import Cluster


@dataclass(frozen=True)
class Analysed:
    """The analysis of one program on one mesh as the rewrites build it (never edited: each
    rewrite returns a new value with ``dataclasses.replace``)."""

    program: Program  # the serial program ``graph`` views: the user's, or a rewrite's clone of it
    graph: ProgramGraph
    mesh: ProcessMesh
    cluster: Cluster
    user: Mapping[ValueKey, DistAttr]  # the user's annotations
    op_meshes: Mapping[int, ProcessMesh]  # op index -> the sub-mesh it runs on (shard_op, pipeline stages)
    made: Mapping[ValueKey, tuple[DistAttr, str]] = dataclasses.field(default_factory=dict)  # at strategy priority, by rewrite
    recompute: Recomputation | None = None
    micro: MicroBatching | None = None
    sequence: SequenceRegions | None = None
    context: ContextSplit | None = None
    zigzag: tuple[int, ...] | None = None  # the zig-zag rewrite's order of the sequence positions (autopar.zigzag_values)
    reports: tuple[tuple[str, str], ...] = ()  # (rewrite, what it did)
    propagated: PropagationResult | None = dataclasses.field(default=None, compare=False, repr=False)  # when known

    def propagate(self) -> PropagationResult:
        """Propagation of the annotations over the graph as it stands (computed once: an
        analysis a later one is derived from keeps it; read only)."""
        if self.propagated is None:
            made = {key: attr for key, (attr, _) in self.made.items()}
            result = propagate(self.graph, self.mesh, dict(self.user), dict(self.op_meshes), cluster=self.cluster, strategy=made)
            object.__setattr__(self, "propagated", result)
        return self.propagated

    def annotated(self, rewrite: Rewrite, placements: Mapping[ValueKey, DistAttr]) -> dict[ValueKey, tuple[DistAttr, str]]:
        """The strategy annotations with ``rewrite``'s ``placements`` added; two rewrites
        placing one value differently is refused, naming both."""
        made = dict(self.made)
        for key, attr in placements.items():
            earlier = made.setdefault(key, (attr, rewrite.name))
            if earlier[0] != attr:
                raise AutoparError(
                    f"rewrites {earlier[1]!r} and {rewrite.name!r} place {self.graph.values[key].label} differently: "
                    f"{earlier[0]} vs {attr}"
                )
        return made

    def moved(
        self, program: Any, positions: Sequence[int | None], recomputes: Mapping[int, int] | None = None,
        copies: Mapping[int, int] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The fields of this analysis for ``program``, a rewrite of its program whose op ``i``
        is now op ``positions[i]`` (None: erased): the graph of it, through which the user's
        Values and op ids (and every earlier rewrite's) stand for their new keys, seen as this
        analysis sees its own (one micro-batch's shapes, marked ops: ``copies``, new op -> the
        op it copies, are seen as that op), and the annotations and op meshes at their new indices."""
        graph = ProgramGraph(program, recomputes=recomputes)
        old = self.graph
        graph.removed.update(old.removed)
        ops = {op.op_id: op.index for op in old.ops} | old.op_aliases
        graph.alias(
            {vid: (positions[i], j) for vid, (i, j) in old._by_impl.items() if positions[i] is not None},
            {op_id: positions[i] for op_id, i in ops.items() if positions[i] is not None},
        )

        def keys(mapping: Mapping[ValueKey, Any]) -> dict[ValueKey, Any]:
            return {(positions[i], j): v for (i, j), v in mapping.items() if positions[i] is not None}

        if old.view_shapes or old.view_attrs:
            shapes = copied_keys(keys(old.view_shapes), copies or {})
            attrs = {positions[i]: a for i, a in old.view_attrs.items() if positions[i] is not None}
            attrs.update({new: attrs[source] for new, source in (copies or {}).items() if source in attrs})
            graph = graph.derived(shapes, attrs)
        op_meshes = {positions[i]: m for i, m in self.op_meshes.items() if positions[i] is not None}
        return {"program": program, "graph": graph, "user": keys(self.user), "made": keys(self.made), "op_meshes": op_meshes}

    def reported(self, rewrite: Rewrite, text: str, **changes: Any) -> Analysed:
        """This analysis with ``changes`` and ``rewrite``'s report appended (not propagated)."""
        return dataclasses.replace(self, reports=(*self.reports, (rewrite.name, text)), propagated=None, **changes)


class Rewrite:
    """Base of the frozen rewrite dataclasses: ``apply`` returns a new :class:`Analysed`."""

    name: ClassVar[str] = "rewrite"

    def apply(self, work: Analysed) -> Analysed:
        raise NotImplementedError

    def derive(self, work: Analysed, sibling: Analysed) -> Analysed | None:
        """What ``apply(work)`` returns, made from ``sibling``: what a rewrite of this kind with
        other parameters made of ``work`` (None: apply it). ``autopar.analyze(..., base=)``
        asks, where two strategies part at this rewrite."""
        return None

    def __str__(self) -> str:
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        return f"{self.name}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"


@dataclass(frozen=True)
class DeadOpRemoval(Rewrite):
    """Ops whose results nothing reads removed from a clone (:mod:`.dead_ops`), except the
    values ``autopar.keep`` names: they neither block micro-batching nor get collectives."""

    name: ClassVar[str] = "dead_ops"

    def apply(self, work: Analysed) -> Analysed:
        pruned = dead_ops(work.program, work.graph, frozenset(annotations_of(work.program).keep))
        if pruned is None:
            return work.reported(self, "no dead op")
        moved = work.moved(pruned.program, pruned.positions)
        moved["graph"].removed.update(pruned.values)
        return work.reported(self, str(pruned), **moved)


def _op_for_op(rewrite: Rewrite, work: Analysed, rewritten: Any, nothing: str) -> Analysed:
    """``work`` after a rewrite that keeps every op where it was (``rewritten``: its result,
    with ``.program``; None: it found nothing to do, reported as ``nothing``)."""
    if rewritten is None:
        return work.reported(rewrite, nothing)
    same = tuple(range(len(work.graph.ops)))
    return work.reported(rewrite, str(rewritten), **work.moved(rewritten.program, same))


def _per_stage(rewrite: Rewrite, work: Analysed, staged: Any, nothing: str) -> Analysed:
    """``work`` after a rewrite that moves ops and places the ones it makes on stages
    (``staged``: its result, with ``.program``, ``.positions`` and ``.meshes``; None: nothing
    to do, reported as ``nothing``)."""
    if staged is None:
        return work.reported(rewrite, nothing)
    moved = work.moved(staged.program, staged.positions)
    return work.reported(rewrite, str(staged), **{**moved, "op_meshes": {**moved["op_meshes"], **staged.meshes}})


@dataclass(frozen=True)
class ShapeReads(Rewrite):
    """Shape reads made constants (:mod:`.static_shapes`): a shape is known from the global
    shape, never gathered."""

    name: ClassVar[str] = "static_shapes"

    def apply(self, work: Analysed) -> Analysed:
        return _op_for_op(self, work, constant_shapes(work.program), "no shape read")


@dataclass(frozen=True)
class LossScalingResults(Rewrite):
    """Dynamic loss scaling's in-place ops read through their results (:mod:`.loss_scaling`):
    the optimizer reads the checked gradients, so a reshard between them lands on the value
    that exists there."""

    name: ClassVar[str] = "loss_scaling_results"

    def apply(self, work: Analysed) -> Analysed:
        return _op_for_op(self, work, loss_scaling_results(work.program), "no dynamic loss scaling")


@dataclass(frozen=True)
class PipelineStages(Rewrite):
    """Where each op of a pipeline runs: ``PipelineConfig(stages=n)``'s layer cut
    (:mod:`.pipeline_cut`), else the stages shard_op placed and those the annotations on stage
    meshes imply (:mod:`.stage_inference`), values built from constants on every stage reading
    them (:mod:`.stage_constants`), a parameter read on several
    stages owned by its first reader's (:func:`~autopar.shared_parameters.owner_meshes`), and a
    parameter annotated on the whole mesh moved to the stage reading it."""

    stages: int | None = None
    name: ClassVar[str] = "pipeline_stages"

    def apply(self, work: Analysed) -> Analysed:
        op_meshes, user = dict(work.op_meshes), dict(work.user)
        local = {i: m for i, m in op_meshes.items() if spans_stages(work.mesh, m)}  # autopar.local_map copies (autopar/sub_meshes.py)
        if local and self.stages is None:
            raise AnnotationError(
                f"autopar.local_map under a pipeline: {work.graph.ops[min(local)]} runs on {local[min(local)]}, which keeps the "
                "pipeline dim; the copies run on the sub-meshes of the stages PipelineConfig(stages=n) cuts (give stages=n)"
            )
        if self.stages is not None:
            kept = reshard_copies(work.graph, work.user, op_meshes)
            # (a reshard copy onto the whole mesh is cut as any op: its annotation moves to its stage, _onto_stages)
            placed = {i: m for i, m in op_meshes.items() if i not in local and not (i in kept and m == work.mesh)}
            op_meshes = layer_stages(work.graph, work.mesh, self.stages, placed, work.cluster, kept)
            if local or any(spans_stages(work.mesh, a.mesh) for a in user.values()):  # each on its stage's sub-mesh
                user, op_meshes = onto_stage_sub_meshes(work.graph, work.mesh, user, op_meshes, local)
        elif on_stages(work.mesh, work.user):  # parameters annotated on stage meshes place their ops (Paddle's way)
            op_meshes = infer_stages(work.graph, work.mesh, work.user, op_meshes)
        if op_meshes:
            op_meshes = reader_stages(work.graph, op_meshes)
        staged = copy_constants(work.program, work.graph, op_meshes)
        if staged is not None:
            work = work.reported(self, str(staged), **work.moved(staged.program, staged.positions))
            op_meshes = {**{staged.positions[i]: m for i, m in op_meshes.items() if staged.positions[i] is not None}, **staged.meshes}
        stages_of_ops = {i: stage_container(work.mesh, m) for i, m in op_meshes.items()}  # (an op on a stage's sub-mesh: that stage)
        op_meshes = {**owner_meshes(work.graph, stages_of_ops), **op_meshes}
        if staged is not None:
            user = {(staged.positions[i], j): a for (i, j), a in user.items() if staged.positions[i] is not None}
        user = _onto_stages(work.graph, work.mesh, user, op_meshes)
        counts: dict[ProcessMesh, int] = {}
        for index, mesh in op_meshes.items():
            if work.graph.ops[index].role is Role.FORWARD:
                counts[mesh] = counts.get(mesh, 0) + 1
        text = ", ".join(f"{count} forward ops on {mesh}" for mesh, count in counts.items())
        return work.reported(self, text or "no op placed", op_meshes=op_meshes, user=user)


@dataclass(frozen=True)
class StageNorms(Rewrite):
    """Global-norm clipping's squared norms added on each pipeline stage before they are
    stacked (:mod:`.stage_norms`): one transfer per stage pair and step, not one per parameter."""

    name: ClassVar[str] = "stage_norms"

    def apply(self, work: Analysed) -> Analysed:
        return _per_stage(self, work, stage_norms(work.program, work.graph, work.op_meshes), "no clip norm crosses stages")


@dataclass(frozen=True)
class StageOverflowChecks(Rewrite):
    """Dynamic loss scaling's check and update split by pipeline stage, the stages' overflow
    flags combined and read by every stage (:mod:`.stage_overflow`): no gradient crosses a
    stage for its check, and every stage moves its copy of the loss scale alike."""

    name: ClassVar[str] = "stage_overflow_checks"

    def apply(self, work: Analysed) -> Analysed:
        staged = stage_overflow_checks(work.program, work.graph, work.op_meshes)
        return _per_stage(self, work, staged, "no loss-scaling check crosses stages")


@dataclass(frozen=True)
class Recompute(Rewrite):
    """Selective recompute (:mod:`.recompute`): a clone of the program with the selected ops
    cloned into the backward; annotations and op meshes follow the ops to their new indices."""

    selection: bool | tuple[str, ...] = True
    name: ClassVar[str] = "recompute"

    def apply(self, work: Analysed) -> Analysed:
        rewrite = recompute_program(work.program, self.selection, work.op_meshes, work.graph)
        moved = work.moved(rewrite.program, rewrite.positions, recomputes=rewrite.clones, copies=rewrite.copies)
        placed = moved["op_meshes"]  # a clone runs where the op it recomputes does (a view on a stage's sub-meshes too)
        moved["op_meshes"] = {**{c: placed[o] for c, o in rewrite.clones.items() if o in placed}, **placed}
        micro = work.micro
        if micro is not None:  # the clones run on the micro-batch the ops they copy run on (and are seen so)
            micro, moved["graph"] = micro.moved(rewrite.positions, rewrite.copies, moved["graph"])
        return work.reported(self, str(rewrite).splitlines()[0], recompute=rewrite, micro=micro, **moved)


@dataclass(frozen=True)
class LocalBatchNorm(Rewrite):
    """``Strategy(local_batch_norm=True)``: each training batch_norm (grad) op of the graph view
    is marked :data:`~autopar.spmd.batch_norm.LOCAL_STATISTICS`, so that its rules state per-rank
    statistics (the program is unchanged; passes/batch_norm_stats.py averages the running ones)."""

    name: ClassVar[str] = "local_batch_norm"

    def apply(self, work: Analysed) -> Analysed:
        marked = {
            op.index: {LOCAL_STATISTICS: True}
            for op in work.graph.ops
            if op_key(op.name).removesuffix("_") in ("batch_norm", "batch_norm_grad") and batch_statistics(op.attrs)
        }
        return work.reported(self, f"{len(marked)} batch_norm op(s) with per-rank statistics", graph=work.graph.derived(attrs=marked))


@dataclass(frozen=True)
class MaskedMeans(Rewrite):
    """A loss ``mean(masked_select(x, mask))`` divided by the selected count once per step
    (:mod:`.masked_mean`): exact over micro-batches whatever the mask."""

    name: ClassVar[str] = "masked_mean"

    def apply(self, work: Analysed) -> Analysed:
        rewritten = deferred_means(work.program, work.graph, work.op_meshes)
        if rewritten is None:
            return work.reported(self, "no masked mean")
        work = work.reported(self, str(rewritten), **work.moved(rewritten.program, rewritten.positions))
        return dataclasses.replace(work, op_meshes={**work.op_meshes, **rewritten.meshes})


@dataclass(frozen=True)
class MicroBatch(Rewrite):
    """The program as it runs on one of ``count`` micro-batches (:mod:`.micro_batching`): the
    graph's shapes become one micro-batch's; refused by name where an op needs the whole batch."""

    count: int = 1
    name: ClassVar[str] = "micro_batching"

    def apply(self, work: Analysed) -> Analysed:
        micro, graph = micro_batch_view(work.graph, self.count)
        for _ in range(len(work.graph.ops)):  # a count over the whole batch: made from the whole feeds
            if not micro.whole_reads:
                break
            copies = whole_feed_copies(work.program, work.graph, micro.whole_reads, work.op_meshes)
            work = work.reported(self, str(copies), **work.moved(copies.program, copies.positions))
            work = dataclasses.replace(work, op_meshes={**work.op_meshes, **copies.meshes})
            micro, graph = micro_batch_view(work.graph, self.count)
        return self._reported(work, micro, graph)

    def derive(self, work: Analysed, sibling: Analysed) -> Analysed | None:
        if sibling.micro is None or sibling.program is not work.program:  # (the sibling copied whole-batch counts)
            return None
        made = recounted(sibling.micro, work.graph, self.count)
        return None if made is None else self._reported(work, *made)

    def _reported(self, work: Analysed, micro: MicroBatching, graph: ProgramGraph) -> Analysed:
        text = f"{len(micro.feeds)} feed(s) split into {self.count} micro-batches; {len(micro.scales)} op(s) rescaled"
        return work.reported(self, text, graph=graph, micro=micro)


@dataclass(frozen=True)
class SequenceParallel(Rewrite):
    """Sequence parallelism (:mod:`.sequence_parallel`): from a first propagation, the
    activations between tensor-parallel regions annotated ``Shard(seq)`` at strategy priority."""

    asked: bool | str = True
    name: ClassVar[str] = "sequence_parallel"

    def apply(self, work: Analysed) -> Analysed:
        first = work.propagate()
        regions = sequence_regions(work.graph, first, work.mesh, self.asked)
        made = work.annotated(self, regions.annotations(work.graph, first))
        split = sum(1 for v in regions.values if v.seq_dim is not None)
        return work.reported(self, f"{split} activation(s) split along the sequence over {regions.axis!r}", made=made, sequence=regions)


@dataclass(frozen=True)
class ContextParallelSplit(Rewrite):
    """Context parallelism (:mod:`.context_parallel`): the feeds carrying the sequence (and the
    activations you resharded onto pipeline stages) split on it over ``dim`` (a placement you
    annotated is kept, ``dim`` added); for ``method="all_to_all"`` (Ulysses), from a first
    propagation, each attention core's q, k, v, probabilities and output split on heads
    instead, at strategy priority. ``balance="zigzag"``: the feeds' reordered copies
    (:class:`ZigzagOrder`) are split instead of the feeds."""

    dim: str = "sep"
    method: str = "all_gather"
    balance: str | None = None
    name: ClassVar[str] = "context_parallel"

    def apply(self, work: Analysed) -> Analysed:
        stand_ins = self._stand_ins(work)
        copies = [(index, 0) for index in reshard_copies(work.graph, work.user, work.op_meshes)]  # onto pipeline stages
        length, carriers, placed = sequence_carriers(work.graph, work.mesh, work.user, work.op_meshes, self.dim, copies, stand_ins)
        user = {**work.user, **{key: attr for key, attr in placed.items() if key in work.user}}
        made = work.annotated(self, {key: attr for key, attr in placed.items() if key not in work.user})
        work = dataclasses.replace(work, user=user, made=made, propagated=None)
        heads: tuple = ()
        if self.method == ULYSSES:
            first = work.propagate()
            splits = head_splits(work.graph, first, attention_cores(work.graph), self.dim)
            placements = head_placements(first, {k: s for k, s in splits.items() if k not in work.user}, self.dim)
            placements.update({k: a for k, a in sequence_after(work.graph, first, splits, self.dim).items() if k not in work.user})
            for key, clones in clone_outputs(work.graph).items():  # a recomputed value is placed as the forward's
                if key in placements:
                    placements.update(dict.fromkeys(clones, placements[key]))
            made = work.annotated(self, placements)
            heads = tuple(splits.values())
        split = ContextSplit(self.dim, work.mesh.dim_size(self.dim), self.method, length, carriers, heads)
        return work.reported(self, str(split), made=made, context=split)

    def _stand_ins(self, work: Analysed) -> dict[ValueKey, ValueKey]:
        """The feeds read through their zig-zag copies (:class:`ZigzagOrder` made them) -> those
        copies, placed instead of the feeds; none without a balance."""
        return reordered_feeds(work.graph, sequence_length(work.graph, self.dim)) if self.balance == ZIGZAG else {}


@dataclass(frozen=True)
class ZigzagOrder(Rewrite):
    """``ContextParallel(balance="zigzag")``: the sequence reordered in the program
    (:mod:`.zigzag`) — feeds, position aranges, causal masks — so that the context-parallel
    split gives rank i chunks i and 2cp-1-i. Runs first (before pipeline stages and
    micro-batching, which then see the reordered program as the user's)."""

    dim: str = "sep"
    name: ClassVar[str] = "zigzag_order"

    def apply(self, work: Analysed) -> Analysed:
        length = sequence_length(work.graph, self.dim)
        feeds = [v.key for v in sequence_feeds(work.graph) if v.shape[1] == length]
        reordered = zigzag(work.program, work.graph, length, work.mesh.dim_size(self.dim), feeds, work.op_meshes, self.dim)
        moved = work.moved(reordered.program, reordered.positions)
        refuse_work_along_the_sequence(moved["graph"], length, work.mesh.dim_size(self.dim), self.dim)
        order = zigzag_order(length, work.mesh.dim_size(self.dim))
        return work.reported(self, str(reordered), zigzag=order, **{**moved, "op_meshes": {**moved["op_meshes"], **reordered.meshes}})


def apply_all(rewrites: tuple[Rewrite, ...], work: Analysed) -> Analysed:
    return applied(rewrites, work)[-1]


def derived(rewrites: Sequence[Rewrite], base_rewrites: Sequence[Rewrite], base_steps: Sequence[Analysed]) -> list[Analysed]:
    """The analysis after each of ``rewrites``, from another strategy's (``base_rewrites`` and
    the values ``base_steps`` before and after each): the rewrites both run first are not run
    again, and where the two part at rewrites of one kind, that rewrite derives its value from
    the other's (:meth:`Rewrite.derive`)."""
    shared = 0
    while shared < min(len(rewrites), len(base_rewrites)) and rewrites[shared] == base_rewrites[shared]:
        shared += 1
    steps = list(base_steps[: shared + 1])
    rest = list(rewrites[shared:])
    if rest and shared < len(base_rewrites) and type(rest[0]) is type(base_rewrites[shared]):
        made = rest[0].derive(steps[-1], base_steps[shared + 1])
        if made is not None:
            steps.append(made)
            rest = rest[1:]
    return steps + applied(rest, steps[-1])[1:]


def applied(rewrites: Sequence[Rewrite], work: Analysed) -> list[Analysed]:
    """``work`` and the value after each of ``rewrites`` in turn."""
    steps = [work]
    for rewrite in rewrites:
        steps.append(rewrite.apply(steps[-1]))
    return steps


def reshard_copies(graph: ProgramGraph, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh]) -> set[int]:
    """The placed ops that are ``autopar.reshard`` copies: an assign whose result the user
    annotated on the mesh the op is placed on."""
    return {
        index for index, mesh in op_meshes.items()
        if graph.ops[index].name == "pd_op.assign" and (index, 0) in user and user[(index, 0)].mesh == mesh
    }  # fmt: skip


def _onto_stages(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh]
) -> dict[ValueKey, DistAttr]:  # fmt: skip
    """A parameter annotated on the whole mesh of a pipeline (``["mp", None]`` on a pp x mp
    mesh, e.g. with ``PipelineConfig(stages=n)``, where the user does not place layers) lives
    on the stage that reads it: the annotation moves to that stage's sub-mesh by dim name. One
    that splits over the pipeline's own dim stays (and is refused where it cannot run)."""
    moved = dict(user)
    for key, attr in user.items():
        value = graph.values[key]
        if attr.mesh != mesh or 0 in attr.sharded_mesh_dims() or 0 in attr.partial_dims:
            continue
        if value.kind == "activation" and key[0] in op_meshes:  # made on one stage (Paddle: on every stage reading it)
            moved[key] = transplant(attr, stage_container(mesh, op_meshes[key[0]]))
            continue
        if value.kind != "parameter":
            continue
        stages = reader_meshes(graph, key, op_meshes)
        if stages:  # (read on a sub-mesh of a stage, by autopar.local_map's copies: held by the stage)
            moved[key] = transplant(attr, stage_container(mesh, stages[0]))
    return moved
