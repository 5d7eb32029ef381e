"""Selective recompute: activations the backward reads are recomputed there, not kept from the
forward (stage: serial rewrite, before analysis).

``Strategy(recompute=...)`` selects forward ops:

- by op type: ``"softmax"`` selects ``pd_op.softmax`` and its in-place form ``pd_op.softmax_``;
- by layer path: the ``struct_name`` Paddle 3.3 records on every op an ``nn.Layer`` call makes
  is the path of layer classes from the outermost call (``/Model/Decoder/DecoderLayer_1/Attention/``;
  the n-th call of a class under one parent is ``Class_n``, counted over the process, so a second
  program built in it continues the count; attribute names are not recorded; ops written outside
  any layer carry none; :mod:`autopar.layer_paths`). A path selects the ops whose path contains
  it, component by component, starting at any depth (``"DecoderLayer"`` selects
  ``Model/Decoder/DecoderLayer_3``; a leading ``/`` anchors it at the top), each component a
  shell pattern matching a call's class (every call: ``"DecoderLayer"``) or its counted name
  (``"DecoderLayer_1"``): ``"DecoderLayer/Attention"``. A path ending in an op type selects the
  ops of that type the layer's own forward makes (not its sublayers'):
  ``"TransformerLayer/matmul"`` is attention's q·kᵀ and probs·v, not the Linear layers' matmuls;
- ``True``: Megatron's "full" recompute, each call of the repeated layers (the shallowest depth
  at which one layer class is called twice or more, however deep: ``DecoderLayer_k`` under
  ``Model/Decoder``; embeddings and the head are not recomputed), each recomputed from its
  input, the only activation of it kept; without repeated layers, every top-level layer call.

The rewrite works on a clone of the user's program (never on the program itself):

- each selected op whose results a backward op reads is cloned just before the first backward
  op that needs it (its own readers, or a later clone). A clone reads the clones of the selected
  ops before it, so chains are recomputed in order, and the kept originals otherwise. Between
  the calls of two selected layers the chain is cut: the later layer's clones read the earlier
  layer's output as kept (its input is its checkpoint), so one layer's recomputation lives only
  through that layer's backward;
- every backward read of a recomputed result moves to its clone: the original dies in the
  forward. A result the backward reads only for its shape (Paddle's no-need-buffer operands,
  e.g. add_grad's x and y) keeps nothing alive and is not recomputed for that read; a value a
  pipeline stage sends to another stays kept (the receiver keeps its copy anyway);
- a training dropout is recomputed from its kept mask, ``x * cast(mask) / (1 - p)``
  (``upscale_in_train``; ``downgrade_in_infer``: ``x * cast(mask)``), the same float operations
  as Paddle's kernel: the same elements dropped, nothing drawn again. Other random ops are
  refused by name. An in-place op (``batch_norm_`` updating its running statistics: a second
  run would update them again) and an op reading or making a value an in-place op overwrites are left as they are (``kept``
  says why).

Forward ops keep their indices (clones go into the backward), so the labels the report uses
(``pd_op.softmax#69``, ``%69.0``) are those of the compiled graph and its dumps. Every later
stage sees one serial program in which the clones are backward ops (roles,
micro-batching, pipeline stages and phases, saved activations) whose SPMD rules are their
forward op's; the reshard planner plans their reads like any other, so a tensor-parallel
collective inside a recomputed layer runs again in the backward. The user's Values,
annotations and ``shard_op`` placements resolve through :meth:`Recomputation.graph`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.errors import AutoparError
from autopar.graph import VECTOR_OPS, OpNode, ProgramGraph, Role, ValueKey
from autopar.layer_paths import call_class, match_end, path_of, repeated_depth
from autopar.op_kinds import SOURCE_OPS
from autopar.recompute_clones import is_training_dropout
from autopar.spmd import ops_where
from autopar.units import format_bytes

if TYPE_CHECKING:
    from paddle.pir import Program

# ops that draw random numbers: a clone would draw again (dropout is recomputed from its mask)
RANDOM_OPS = ops_where("random", short=True)


@dataclass(frozen=True, slots=True)
class RecomputedValue:
    """A forward value whose backward readers now read a clone: no longer kept (``kept`` False),
    or an input a clone reads that was not kept before (``kept`` True: the recomputation's
    checkpoint). Shape and bytes are serial (whole)."""

    label: str
    op: str  # the op that makes it, e.g. "pd_op.softmax#150"
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kept: bool = False

    def __str__(self) -> str:
        return f"{self.label} {list(self.shape)} {self.dtype} ({format_bytes(self.bytes)}) from {self.op}"


@dataclass(frozen=True)
class Recomputation:
    """The rewritten program and what the rewrite did (``str()`` is a report)."""

    selection: bool | tuple[str, ...]
    source: Program  # the user's program (read only)
    program: Program  # the rewritten clone
    clones: Mapping[int, int]  # op position of each clone -> position of the op it recomputes
    copies: Mapping[int, int]  # position of each inserted op -> position of the op it copies (dropout's mask ops: none)
    positions: tuple[int, ...]  # the user's op index -> its position in ``program``
    dropped: tuple[RecomputedValue, ...]  # no longer kept for the backward
    checkpoints: tuple[RecomputedValue, ...]  # kept now because a clone reads them
    kept: tuple[str, ...]  # selected ops a clone cannot stand for, and why
    idle: tuple[str, ...] = ()  # selected ops not cloned: no backward op reads data of theirs that is not kept anyway

    @property
    def dropped_bytes(self) -> int:
        return sum(v.bytes for v in self.dropped)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(v.bytes for v in self.checkpoints)

    def graph(self) -> ProgramGraph:
        """The graph of the rewritten program, clones marked; the user's Values and op ids
        stand for their rewritten counterparts (fetch lists, annotations, shard_op)."""
        graph = ProgramGraph(self.program, recomputes=self.clones)
        values, ops = {}, {}
        for index, op in enumerate(self.source.global_block().ops):
            position = self.positions[index]
            ops[op.id()] = position
            for j, result in enumerate(op.results()):
                if result.initialized():
                    values[result.id] = (position, j)
        graph.alias(values, ops)
        return graph

    def value(self, user_value: Any) -> Any:
        """The rewritten program's Value for a Value of the user's program."""
        for index, op in enumerate(self.source.global_block().ops):
            for j, result in enumerate(op.results()):
                if result.initialized() and result.id == user_value.id:
                    return list(self.program.global_block().ops)[self.positions[index]].result(j)
        raise AutoparError("not a Value of the program given to recompute")

    def __str__(self) -> str:
        lines = [
            f"recompute {self.selection!r}: {len(self.clones)} op(s) cloned into the backward; "
            f"{len(self.dropped)} value(s) no longer kept ({format_bytes(self.dropped_bytes)}), "
            f"{len(self.checkpoints)} kept for the recomputation ({format_bytes(self.checkpoint_bytes)}), serial sizes"
        ]
        lines += [f"  - {v}" for v in self.dropped]
        lines += [f"  + {v}" for v in self.checkpoints]
        lines += [f"  kept: {why}" for why in self.kept]
        if self.idle:
            shown = ", ".join(self.idle[:8]) + (f" and {len(self.idle) - 8} more" if len(self.idle) > 8 else "")
            lines.append(
                f"  not cloned ({len(self.idle)}): {shown}: the backward reads no data of theirs, or only values kept "
                "anyway (another layer's input, a value sent to another stage)"
            )
        return "\n".join(lines)


def regathered(rewrite: Recomputation | None, graph: ProgramGraph, pipelined: bool) -> frozenset[ValueKey]:
    """Forward values the clones read: a reshard they need is done again in the backward rather
    than kept from the forward read (as Megatron re-gathers inside a recomputed layer). Not under
    a pipeline, where a reshard across stages is a send of the forward's schedule."""
    if rewrite is None or pipelined:
        return frozenset()
    reads = set()
    for op in graph.ops:
        if op.recomputes is None:
            continue
        for key in op.inputs:
            if key is not None and graph.values[key].kind != "constant" and graph.ops[key[0]].role is Role.FORWARD:
                reads.add(key)
    return frozenset(reads)


def recompute(
    program: Any, selection: bool | tuple[str, ...], meshes: Mapping[int, Any] | None = None, graph: ProgramGraph | None = None
) -> Recomputation:
    """Rewrite a clone of ``program`` so the ops ``selection`` names are recomputed in the
    backward (see the module docstring). ``meshes``: the sub-mesh (pipeline stage) of the
    program's ops by index, where placed: a value one stage sends to another stays kept (the
    receiver keeps its copy for its backward; recomputing it would send it again). ``graph``:
    the graph of ``program`` when known (the clone has the same ops in the same order; the
    rewrite reads indices, roles, shapes and labels from it)."""
    work = program.clone()
    graph = ProgramGraph(work) if graph is None else graph
    first = next((op.index for op in graph.ops if op.role is Role.BACKWARD), None)
    if first is None:
        raise AutoparError("Strategy.recompute: the program has no backward (build it with optimizer.minimize(loss))")
    chosen = select(graph, selection, first)
    raw = list(work.global_block().ops)
    plan = _Plan(graph, raw, first, dict(meshes or {}))
    kept = plan.exclude(chosen)
    plan.decide(chosen)
    clone_ops, copied = _rewrite(work, graph, raw, plan)
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    clones = {where[c.id()]: where[raw[origin].id()] for c, origin in clone_ops}
    copies = {where[c.id()]: where[raw[origin].id()] for c, origin in copied}
    return Recomputation(
        selection, program, work, clones, copies, tuple(where[op.id()] for op in raw),
        tuple(_value(graph, k) for k in sorted(plan.rewired)),
        tuple(_value(graph, k, kept=True) for k in sorted(plan.checkpoints())), tuple(kept),
        tuple(str(graph.ops[i]) for i in sorted(chosen) if i not in plan.position),
    )  # fmt: skip


# ---- selection -------------------------------------------------------------------------------


def _candidates(graph: ProgramGraph, first: int) -> list[OpNode]:
    """Forward ops that compute something from inputs (not feeds, parameters, constants)."""
    return [
        op for op in graph.ops[:first]
        if op.role is Role.FORWARD and op.name not in SOURCE_OPS and op.name not in VECTOR_OPS
        and any(k is not None for k in op.inputs) and any(k is not None for k in op.outputs)
    ]  # fmt: skip


def _base(op: OpNode) -> str:
    short = op.short_name
    return short[:-1] if short.endswith("_") else short


def _path(op: OpNode) -> list[str]:
    return list(path_of(op))


def select(graph: ProgramGraph, selection: bool | tuple[str, ...], first: int) -> dict[int, str | None]:
    """Selected op index -> its recompute group: the layer call it is recomputed with (a chain
    of clones is cut between groups), None for ops selected by type only."""
    candidates = _candidates(graph, first)
    if selection is True:
        return _every_layer(candidates)
    chosen: dict[int, str | None] = {}
    unmatched = []
    for entry in selection:
        name = entry.removeprefix("pd_op.")
        by_type = [op for op in candidates if _base(op) == name]
        for op in by_type:
            chosen.setdefault(op.index, None)
        pattern = entry.rstrip("/").split("/")
        found = False
        for op in candidates:
            path = path_of(op)
            end = match_end(path, pattern)
            if end is None and len(pattern) > 1 and _base(op) == pattern[-1]:
                # "Layer*/softmax": ops of that type the layer's own forward makes (not its sublayers')
                end = match_end(path, pattern[:-1])
                end = end if end == len(path) else None
            if end is not None:
                chosen[op.index] = "/".join(path[:end])
                found = True
        if not by_type and not found:
            unmatched.append(entry)
    if unmatched:
        layers = sorted({"/".join(_path(op)) for op in candidates if _path(op)})
        shown = ", ".join(layers[:12]) + (f" and {len(layers) - 12} more" if len(layers) > 12 else "")
        raise AutoparError(
            f"Strategy.recompute: {', '.join(map(repr, unmatched))} match(es) no forward op type or layer path of the "
            f"program; op types: {_types(candidates)}; layer paths: {shown or 'none (no op was made by an nn.Layer call)'}"
        )
    return chosen


def _every_layer(candidates: list[OpNode]) -> dict[int, str | None]:
    """``recompute=True``: each call of the repeated layers (the shallowest depth at which one
    layer class is called twice or more: ``Model/Decoder/DecoderLayer_k``), else every
    top-level layer call."""
    paths = [path_of(op) for op in candidates]
    if not any(paths):
        raise AutoparError(
            "Strategy.recompute=True recomputes every layer call (the ops Paddle records a struct_name on), but no "
            f"op of the program was made by an nn.Layer call; name op types instead: {_types(candidates)}"
        )
    depth = repeated_depth([p for p in paths if p])
    if depth is None:
        return {op.index: path[0] for op, path in zip(candidates, paths) if path}
    calls = Counter(call_class(call[-1]) for call in {p[:depth] for p in paths if len(p) >= depth})
    repeated = {name for name, count in calls.items() if count >= 2}
    return {
        op.index: "/".join(path[:depth]) for op, path in zip(candidates, paths)
        if len(path) >= depth and call_class(path[depth - 1]) in repeated
    }  # fmt: skip


def _types(ops: list[OpNode]) -> str:
    return ", ".join(sorted({_base(op) for op in ops}))


# ---- planning ---------------------------------------------------------------------------------


class _Plan:
    """Which selected ops are cloned, where, and which backward reads move to the clones."""

    def __init__(self, graph: ProgramGraph, raw: list[Any], first: int, meshes: dict[int, Any]) -> None:
        self.graph, self.raw, self.first, self.meshes = graph, raw, first, meshes
        self.groups: dict[int, str | None] = {}
        self.position: dict[int, int] = {}  # cloned op -> index of the op its clone goes before
        self.recomputed: set[ValueKey] = set()  # values whose later readers read the clone
        self.rewired: dict[ValueKey, list[tuple[int, int]]] = {}  # value -> backward read sites moved

    def exclude(self, chosen: dict[int, str | None]) -> list[str]:
        """Drop (and say why) the selected ops a clone cannot stand for; refuse random ops."""
        graph, kept = self.graph, []
        overwritten = {
            k: op for op in graph.ops[: self.first]
            if op.role is Role.FORWARD and op.short_name.endswith("_") for k in op.inputs if k is not None
        }  # fmt: skip
        for index in sorted(chosen):
            op = graph.ops[index]
            if _base(op) in RANDOM_OPS or (_base(op) == "dropout" and op.short_name.endswith("_")):
                raise AutoparError(
                    f"Strategy.recompute selects {op}, which draws random numbers: a recomputation would draw "
                    "different ones (dropout is recomputed from its kept mask); leave it out of the selection"
                )
            why = None
            if op.short_name.endswith("_"):
                why = "writes into an input in place: a recomputation would write it again"
            elif any(k in overwritten for k in op.inputs + op.outputs if k is not None):
                k = next(k for k in op.inputs + op.outputs if k in overwritten)
                why = f"{'reads' if k in op.inputs else 'makes'} {graph.values[k].label}, which {overwritten[k]} overwrites in place"
            elif is_training_dropout(op) and not isinstance(op.attrs.get("p"), (int, float)):
                why = "its drop probability p is not a constant"
            if why is not None:
                kept.append(f"{op}: {why}")
                del chosen[index]
        return kept

    def _maker(self, key: ValueKey) -> int:
        """The op that computes ``key`` (a vector member: the op whose vector builtin.split splits)."""
        op = self.graph.ops[key[0]]
        if op.name == "builtin.split" and op.inputs and op.inputs[0] is not None:
            return op.inputs[0][0]
        return key[0]

    def _cut(self, producer: int, reader: int) -> bool:
        """A read between two selected layer calls: the reader's clone reads the kept original."""
        a, b = self.groups.get(producer), self.groups.get(reader)
        return a is not None and b is not None and a != b

    def _sent(self, maker: int, key: ValueKey) -> bool:
        """Whether a forward op on another sub-mesh (pipeline stage) than its maker reads ``key``."""
        mesh = self.meshes.get(maker)
        readers = (self.meshes.get(u) for u in self.graph.values[key].users if u < self.first)
        return mesh is not None and any(m is not None and m != mesh for m in readers)

    def _backward_readers(self, key: ValueKey) -> list[OpNode]:
        graph = self.graph
        users = (graph.ops[u] for u in sorted(set(graph.values[key].users)) if u >= self.first)
        return [op for op in users if op.name not in VECTOR_OPS and op.role is not Role.OPTIMIZER]

    def _data_read(self, key: ValueKey) -> bool:
        """Whether a backward op reads the data of ``key``, not only its shape (Paddle's
        no-need-buffer operands, e.g. add_grad's x and y, do not keep a buffer alive)."""
        value = self.raw[key[0]].result(key[1])
        return any(not self.raw[op.index].is_no_need_buffer(value) for op in self._backward_readers(key))

    def _sites(self, key: ValueKey) -> list[tuple[int, int]] | None:
        """Where backward ops read ``key`` (None: a read that cannot be moved)."""
        sites = []
        for op in self._backward_readers(key):
            for slot, k in enumerate(op.inputs):
                if k == key:
                    site = op.sites[slot]
                    if site[1] < 0 or site[0] < self.first:
                        return None
                    sites.append(site)
        return sites

    def decide(self, chosen: dict[int, str | None]) -> None:
        """Latest op first: an op is cloned when a backward op or a later clone reads a result
        of it that is recomputed (not an input another layer's clones read as kept)."""
        graph = self.graph
        self.groups = dict(chosen)
        for index in sorted(chosen, reverse=True):
            op = graph.ops[index]
            before = []
            for slot, key in enumerate(op.outputs):
                if key is None or (slot == 1 and is_training_dropout(op)):  # the mask is kept, never redrawn
                    continue
                readers = [x for x in self.position if key in graph.ops[x].inputs]
                if any(self._cut(index, x) for x in readers) or self._sent(index, key):
                    continue  # another layer's input (kept as its checkpoint), or sent to another stage
                sites = self._sites(key)
                chained = [x for x in readers if not self._cut(index, x)]
                if sites is None or (sites and not chained and not self._data_read(key)):
                    continue  # a read that cannot move, or the backward reads only its shape: nothing to save
                self.recomputed.add(key)
                if sites:
                    self.rewired[key] = sites
                before += [site[0] for site in sites] + [self.position[x] for x in chained]
            if before:
                self.position[index] = min(before)

    def reads_clone(self, reader: int, key: ValueKey) -> bool:
        """Whether the clone of ``reader`` reads the clone of ``key`` (else the kept original)."""
        maker = self._maker(key)
        return key in self.recomputed and maker in self.position and not self._cut(maker, reader)

    def checkpoints(self) -> set[ValueKey]:
        """Values clones read as originals that no backward op read before."""
        graph, out = self.graph, set()
        for index in self.position:
            for key in graph.ops[index].inputs:
                if key is None or self.reads_clone(index, key) or graph.values[key].kind not in ("activation", "feed"):
                    continue
                if graph.ops[key[0]].role is Role.FORWARD and self._sites(key) == []:
                    out.add(key)
        return out


def _value(graph: ProgramGraph, key: ValueKey, kept: bool = False) -> RecomputedValue:
    from autopar.cost_model import tensor_bytes

    value = graph.values[key]
    shape = value.program_shape  # (whole: the graph may be one micro-batch's view)
    size = tensor_bytes([max(s, 1) for s in shape], value.dtype, None, 0)
    return RecomputedValue(value.label, str(graph.ops[key[0]]), tuple(shape), value.dtype, size, kept)


# ---- rewriting ----------------------------------------------------------------------------------


def _rewrite(work: Any, graph: ProgramGraph, raw: list[Any], plan: _Plan) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
    """Insert the clones (ascending op index before each insertion point) and move the backward
    reads; returns (inserted op, index of the op it recomputes) for every inserted op, and
    (inserted op, index of the op it is a copy of) for every copy (a vector's combine or split
    copies its own op; dropout's mask ops copy none)."""
    import paddle

    ids = {
        result.id: (i, j) for i, op in enumerate(raw) for j, result in enumerate(op.results()) if result.initialized()
    }
    made: dict[ValueKey, Any] = {}  # recomputed value -> its clone's result
    inserted: list[tuple[Any, int]] = []
    copied: list[tuple[Any, int]] = []
    with paddle.static.program_guard(work):
        for index in sorted(plan.position, key=lambda i: (plan.position[i], i)):
            paddle.pir.set_insertion_point(raw[plan.position[index]])
            op = graph.ops[index]
            if is_training_dropout(op):
                x = _source(plan, ids, made, index, raw[index].operand_source(0))
                ops = _dropout_clone(op, raw[index], x)
                made[op.outputs[0]] = ops[-1].result(0)
            else:
                copies = _clone_unit(plan, raw, ids, made, index)
                copied += copies
                ops = [o for o, _ in copies]
            inserted += [(o, index) for o in ops]
        paddle.pir.reset_insertion_point_to_end()
    for key, sites in plan.rewired.items():
        for site_op, slot in sites:
            raw[site_op].operand(slot).set_source(made[key])
    return inserted, copied


def _source(plan: _Plan, ids: dict[str, ValueKey], made: dict[ValueKey, Any], reader: int, value: Any) -> Any:
    """What the clone of ``reader`` reads for ``value``: the clone's result or the original."""
    key = ids.get(value.id) if value.initialized() else None
    return made[key] if key is not None and key in made and plan.reads_clone(reader, key) else value


def _clone(original: Any, sources: list[Any]) -> Any:
    """A copy of ``original`` at the insertion point reading ``sources`` (one per operand)."""
    import paddle

    mapping = paddle.pir.IrMapping()
    for operand, source in zip(original.operands_source(), sources):
        if operand.initialized() and not mapping.has(operand):
            mapping.add(operand, source)
    return original.clone(mapping, paddle.pir.CloneOptions(False, True, True))


def clone_reading(original: Any, source_of: Callable[[Any], Any]) -> list[Any]:
    """A copy of ``original`` at the insertion point reading ``source_of`` of each of its
    operands; a vector operand gets a copy of the builtin.combine building it, its members
    mapped alike. Returns the inserted ops, the copy last (recompute's clones, a stage's copy of
    a constant-built value, a whole-batch copy of a count)."""
    out, sources = [], []
    for source in original.operands_source():
        producer = source.get_defining_op() if source.initialized() else None
        if producer is not None and producer.name() == "builtin.combine":
            out.append(_clone(producer, [source_of(m) for m in producer.operands_source()]))
            sources.append(out[-1].result(0))
        else:
            sources.append(source_of(source))
    out.append(_clone(original, sources))
    return out


def _clone_unit(plan: _Plan, raw: list[Any], ids: dict, made: dict, index: int) -> list[tuple[Any, int]]:
    """Clone op ``index`` with the builtin.combine ops building its vector operands and the
    builtin.split ops taking its vector results apart; returns each inserted op with the index
    of the op it copies."""
    op = raw[index]
    out = clone_reading(op, lambda value: _source(plan, ids, made, index, value))
    copy = out[-1]
    sources = [ids[source.id][0] for source in op.operands_source() if _combined(source)]  # (a combine's result is its op's)
    pairs = list(zip(out, [*sources, index]))
    for j, result in enumerate(op.results()):
        if not result.initialized():
            continue
        made[(index, j)] = copy.result(j)
        for user in result.all_used_ops():
            if user.name() == "builtin.split":
                split = _clone(user, [copy.result(j)])
                at = ids[user.result(0).id][0]
                pairs.append((split, at))
                made.update({(at, m): split.result(m) for m in range(split.num_results())})
    return pairs


def _combined(source: Any) -> bool:
    producer = source.get_defining_op() if source.initialized() else None
    return producer is not None and producer.name() == "builtin.combine"


def _dropout_clone(op: OpNode, original: Any, x: Any) -> list[Any]:
    """``x * cast(mask) / (1 - p)`` from the forward dropout's kept mask, the float operations of
    Paddle's CPU kernel (``x / static_cast<T>(1.0f - p)`` for a kept element; a dropped one is
    0); ``downgrade_in_infer`` trains as ``x * mask``. Returns the ops, the result's last."""
    import paddle

    mask = paddle._C_ops.cast(original.result(1), x.dtype)
    out = paddle._C_ops.multiply(x, mask)
    made = [mask, out]
    if op.attrs.get("mode", "upscale_in_train") == "upscale_in_train":
        keep = float(np.float32(1.0) - np.float32(op.attrs["p"]))
        if keep == 0.0:  # p == 1: the kernel gives zeros
            made.append(paddle._C_ops.scale(out, 0.0, 0.0, True))
        else:
            made.append(paddle._C_ops.full([1], keep, x.dtype, paddle.CPUPlace()))
            made.append(paddle._C_ops.divide(out, made[-1]))
    return [v.get_defining_op() for v in made]
