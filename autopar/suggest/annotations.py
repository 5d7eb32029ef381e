"""The annotations a suggested plan applies, found from an unannotated program (stage: annotate,
made by autopar instead of the user; issue 25's ``autopar.suggest`` reads them).

Tensor parallelism is Megatron's, read off the forward ops:

    A_1..A_k  x[.., in] @ W[in, out] (+ b[out])   column-parallel  W -> [None, mp], b -> [mp]
    ... ops that keep the split: elementwise, reshape / transpose to heads, attention's
        activation x activation matmuls, softmax, split / unbind of q, k, v, rotary ...
    B         x[.., in] @ W[in, out]                row-parallel     W -> [mp, None]  (output P(sum))

B pairs with the parameter matmuls A_i met walking back from its activation input when every
path ends at such a matmul (or at constants, feeds of masks and positions, 1-D parameters); a
path through a normalization or a reduction over the hidden dim (layer_norm, rms_norm, the
``mean`` of a hand-written RMSNorm), an embedding, a convolution or an op this module does not
know leaves B whole. An embedding table ``[V, h]`` read with token ids is split by vocabulary
rows; a head tied to it (``h @ table^T``) then gives logits split by vocabulary. An untied
output head ``h @ W[h, V]`` whose logits reach a cross-entropy (Llama's ``lm_head``, a GPT's
output layer) is split by columns, ``W -> [None, mp]``: Megatron's vocabulary-parallel output
layer, its cross-entropy computed on split logits (one value per row moved, not the logits).

Being right beats splitting much: every candidate is checked by propagating its placements
(:func:`autopar.propagation.propagate` on a 1-D ``mp`` mesh). A split the program loses on the
way (a fused qkv laid out ``[3, heads, head_dim]`` or cut three ways by columns, heads not
divisible by mp) or a row-parallel input that does not arrive split leaves the pair whole, and
``TensorParallel.notes`` says where and why in the user's terms (layer path, shapes).

Data parallelism splits the feeds that carry the batch (:func:`batch_feeds`); context
parallelism splits the feeds that carry the sequence on dim 1, by compile's rule
(:func:`sequence_feeds`), and is searched only where the sequence is long (:func:`long_sequence`). Expert parallelism
splits the stacked experts by expert (:func:`expert_parameters`: ``[E, in, out]`` weights an
einsum or matmul batches over their dim 0) and the batch feeds over data x expert, as GSPMD's
MoE and the zoo's stacked MoE (``autopar/testing/zoo/moe.py``) annotate them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.annotate import to_dist_attr
from autopar.dist_attr import DistAttr
from autopar.graph import OpNode, ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.rewrites.context_parallel import SEQ_DIM, not_the_sequence
from autopar.rewrites.context_parallel import sequence_feeds as read_feeds
from autopar.rewrites.context_parallel import sequence_length as context_sequence_length
from autopar.spmd import ops_where

# what the search reads of ops, declared beside their rules (autopar.spmd.registry.TRAIT_MEANINGS):
KEEPS_SPLIT = ops_where("keeps_split")  # a column split passes them on its way to the row-parallel matmul
NEUTRAL_SOURCES = ops_where("neutral_source")  # constants, tables and masks made in the graph: they decide no split
NORMALIZING = ops_where("normalizing")  # they see the whole hidden dim at once: the split cannot pass them
TO_LOSS = ops_where("to_loss")  # between a head and its loss (see _feeds_loss)
ID_OPS = ops_where("passes_ids")  # what token ids may pass on their way from a feed to an embedding


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """The tensor-parallel split of a program's parameters (Megatron's), and what was left whole."""

    column: tuple[ValueKey, ...] = ()  # weights [in, out] split on their output dim (and untied heads) -> [None, mp]
    column_bias: tuple[ValueKey, ...] = ()  # biases of column linears and of a vocabulary-parallel head -> [mp]
    row: tuple[ValueKey, ...] = ()  # weights [in, out] split on their input dim    -> [mp, None]
    vocab: tuple[ValueKey, ...] = ()  # embedding tables [V, h] split by rows       -> [mp, None]
    heads: tuple[ValueKey, ...] = ()  # of ``column``: the untied output heads' weights
    notes: tuple[str, ...] = ()  # what was left whole and why (layer path, shapes)

    def __bool__(self) -> bool:
        return bool(self.column or self.row or self.vocab)

    def specs(self, mp: str | int) -> dict[ValueKey, list[Any]]:
        """Each split parameter's dims_mapping with ``mp`` the mesh dim it is split over."""
        out: dict[ValueKey, list[Any]] = {key: [None, mp] for key in self.column}
        out.update({key: [mp] for key in self.column_bias})
        out.update({key: [mp, None] for key in (*self.row, *self.vocab)})
        return out


@dataclass(frozen=True, slots=True)
class _Linear:
    """A forward parameter matmul ``x @ W`` (W [in, out] not transposed) and its bias add."""

    op: int
    weight: ValueKey
    bias: ValueKey | None
    bias_op: int | None


@dataclass(frozen=True, slots=True)
class _Pair:
    """Column linears ``feeders`` and the row linear ``row`` they feed; ``region``: the ops between."""

    feeders: tuple[_Linear, ...]
    row: _Linear
    region: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Vocab:
    """An embedding table split by rows, the ops reading it and the ops after its tied heads."""

    table: ValueKey
    head_biases: tuple[ValueKey, ...]
    region: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Head:
    """An untied output head split by columns (vocabulary), and the ops from it to the loss."""

    linear: _Linear
    region: frozenset[int]


_Item = _Pair | _Vocab | _Head


# ---- public ---------------------------------------------------------------------------------
def tensor_parallel(graph: ProgramGraph, mp: int) -> TensorParallel:
    """The parameters to split over an ``mp``-way tensor-parallel mesh dim: column / row pairs
    of linears (attention's q, k, v and out-projection, MLPs), vocabulary-parallel embeddings
    with their tied heads, untied output heads; each checked by propagation (see the module
    docstring)."""
    if mp < 2:
        return TensorParallel(notes=(f"mp={mp}: nothing to split",))
    linears = {lin.op: lin for lin in _linears(graph)}
    pairs, notes = _pairs(graph, linears, mp)
    vocabs, vocab_notes = _vocabs(graph, mp)
    paired = {lin.op for pair in pairs for lin in (*pair.feeders, pair.row)}
    heads, head_notes = _heads(graph, [lin for index, lin in linears.items() if index not in paired], mp)
    items, lost = _checked(graph, mp, [*pairs, *vocabs, *heads])
    notes += vocab_notes + head_notes + lost
    if not items and not notes:
        notes.append(
            "no pair of linears (a column-parallel one feeding a row-parallel one) and no vocabulary embedding found"
        )
    return dataclasses.replace(_as_tp(items), notes=tuple(notes))


def batch_feeds(graph: ProgramGraph) -> tuple[ValueKey, ...]:
    """The feeds to split on dim 0 for data parallelism: those whose dim 0 is the batch size,
    the dim 0 most feeds share (ties: the larger). Feeds without a dim, or with another dim 0
    (a position table), stay whole."""
    feeds = [key for key, value in graph.values.items() if value.kind == "feed" and value.program_shape]
    sizes = Counter(graph.values[key].program_shape[0] for key in feeds)
    if not sizes:
        return ()
    batch = max(sizes, key=lambda size: (sizes[size], size))
    return tuple(sorted(key for key in feeds if graph.values[key].program_shape[0] == batch))


def sequence_feeds(graph: ProgramGraph) -> tuple[ValueKey, ...]:
    """The feeds that carry the sequence on dim 1 (token ids, labels, masks per token), by the
    rule compile's context-parallel split applies (:mod:`autopar.rewrites.context_parallel`):
    the read feeds of two dims or more whose dim 1 is the longest among them and no other dim
    is as long."""
    feeds = read_feeds(graph)
    if not feeds:
        return ()
    length = context_sequence_length(graph, "sep")  # (the dim is named only in its refusal, for no feed: not here)
    return tuple(sorted(value.key for value in feeds if not_the_sequence(value, length) is None))


def sequence_length(graph: ProgramGraph) -> int:
    """The tokens of a sequence (dim 1 of :func:`sequence_feeds`; 0: no feed carries one)."""
    feeds = sequence_feeds(graph)
    return int(graph.values[feeds[0]].shape[SEQ_DIM]) if feeds else 0


LONG = 0.5  # the share of the saved activations attention's [.., S, S] values must reach for the sequence to count as long


def attention_share(graph: ProgramGraph) -> float:
    """The share of the activations the backward keeps (bytes, whole: one device) that are
    attention's ``[.., S, S]`` values — scores and probabilities over the sequence, the memory
    that grows with its square (0 without a sequence)."""
    from autopar.inspect.cost_report import saved_activations

    seq = sequence_length(graph)
    if seq < 2:
        return 0.0
    from autopar.cost_model import tensor_bytes

    values = [graph.values[key] for key in saved_activations(graph)]
    sizes = {value.key: tensor_bytes(value.shape, value.dtype, None, 0) for value in values}
    square = sum(n for key, n in sizes.items() if tuple(graph.values[key].shape[-2:]) == (seq, seq))
    return square / sum(sizes.values()) if sizes else 0.0


def long_sequence(graph: ProgramGraph) -> bool:
    """Whether the memory of attention's activations decides (their share is at least
    :data:`LONG`): the search then adds context parallelism, which splits them by the sequence."""
    return attention_share(graph) >= LONG


def expert_parameters(graph: ProgramGraph) -> tuple[ValueKey, ...]:
    """The stacked experts' weights: parameters of 3 dims or more that a forward einsum (or
    batched matmul) reads with their dim 0 a batch dim — kept in every operand and the output
    (``"ecm,emh->ech"``: each expert ``e`` applied to its own rows) — all of one expert count.
    Empty: no experts, or weights of several counts (left whole: which to split is unclear)."""
    found = []
    for key, value in graph.values.items():
        if value.kind != "parameter" or len(value.shape) < 3 or value.shape[0] < 2:
            continue
        readers = [graph.ops[u] for u in value.users if graph.ops[u].role is Role.FORWARD]
        if any(_batched_over_dim_0(graph, op, key) for op in readers):
            found.append(key)
    counts = {graph.values[key].shape[0] for key in found}
    return tuple(found) if len(counts) == 1 else ()


def expert_count(graph: ProgramGraph) -> int:
    """The routed experts the stacked weights hold (0: none found)."""
    found = expert_parameters(graph)
    return int(graph.values[found[0]].shape[0]) if found else 0


def _batched_over_dim_0(graph: ProgramGraph, op: OpNode, key: ValueKey) -> bool:
    inputs = [k for k in op.inputs if k is not None]
    if op.name == "pd_op.einsum" and isinstance(op.attrs.get("equation"), str) and "->" in op.attrs["equation"]:
        operands, output = op.attrs["equation"].replace(" ", "").split("->")
        terms = operands.split(",")
        if len(terms) != len(inputs) or key not in inputs or not terms[inputs.index(key)]:
            return False
        letter = terms[inputs.index(key)][0]
        return letter != "." and letter in output and all(letter in term for term in terms)
    if op.name in ("pd_op.matmul", "pd_op.bmm") and len(inputs) == 2 and key in inputs:
        other = graph.values[inputs[1 - inputs.index(key)]].shape
        return len(other) == len(graph.values[key].shape) and other[0] == graph.values[key].shape[0]
    return False


def placements(
    graph: ProgramGraph, mesh: ProcessMesh, tp: TensorParallel | None, dp: str | None, mp: str | None, sep: str | None = None,
    ep: str | None = None,
) -> dict[ValueKey, DistAttr]:  # fmt: skip
    """The DistAttr of every value the plan annotates: ``tp``'s parameters split over mesh dim
    ``mp``, the batch feeds over ``dp`` (and ``ep``), the sequence feeds' dim 1 over ``sep``,
    the stacked experts' dim 0 over ``ep`` (None: that kind of parallelism is not used)."""
    specs: dict[ValueKey, list[Any]] = {}
    batch = tuple(d for d in (dp, ep) if d is not None)
    if batch:
        for key in batch_feeds(graph):
            specs[key] = [batch if len(batch) > 1 else batch[0]] + [None] * (len(graph.values[key].shape) - 1)
    if ep is not None:
        for key in expert_parameters(graph):
            specs[key] = [ep] + [None] * (len(graph.values[key].shape) - 1)
    if sep is not None:
        for key in sequence_feeds(graph):
            spec = specs.get(key, [None] * len(graph.values[key].shape))
            specs[key] = [spec[0], sep, *spec[2:]]
    if tp is not None and mp is not None:
        specs.update(tp.specs(mp))
    return {
        key: to_dist_attr(spec, mesh, len(graph.values[key].shape), graph.values[key].label)
        for key, spec in specs.items()
    }


def shard(graph: ProgramGraph, attrs: Mapping[ValueKey, DistAttr]) -> None:
    """Annotate ``graph``'s program with ``attrs`` (:func:`autopar.shard_tensor` on each value)."""
    import paddle

    from autopar.annotate import shard_tensor

    block = graph.program.global_block()
    ops = list(block.ops)
    with paddle.static.program_guard(graph.program):
        for key, attr in attrs.items():
            shard_tensor(ops[key[0]].result(key[1]), attr.mesh, attr)


# ---- linears and their pairs ----------------------------------------------------------------
def _linears(graph: ProgramGraph) -> Iterable[_Linear]:
    for op in graph.ops:
        weight = _linear_weight(graph, op)
        if weight is None:
            continue
        bias, bias_op = _bias_of(graph, op, graph.values[weight].shape[1])
        yield _Linear(op.index, weight, bias, bias_op)


def _linear_weight(graph: ProgramGraph, op: OpNode) -> ValueKey | None:
    """The weight of a forward ``x @ W`` with W a 2-D parameter, neither transposed."""
    if op.role is not Role.FORWARD or op.name != "pd_op.matmul" or len(op.inputs) != 2 or None in op.inputs:
        return None
    x, w = op.inputs
    if op.attrs.get("transpose_x") or op.attrs.get("transpose_y") or graph.values[x].kind == "parameter":
        return None
    value = graph.values[w]
    return w if value.kind == "parameter" and len(value.shape) == 2 else None


def _bias_of(graph: ProgramGraph, op: OpNode, out: int) -> tuple[ValueKey | None, int | None]:
    """A 1-D parameter of ``out`` elements added to the matmul's result (its only reader)."""
    result = op.outputs[0]
    users = [u for u in graph.values[result].users if graph.ops[u].role is Role.FORWARD] if result is not None else []
    if len(users) != 1 or graph.ops[users[0]].name != "pd_op.add":
        return None, None
    add = graph.ops[users[0]]
    other = [k for k in add.inputs if k is not None and k != result]
    if len(other) == 1 and graph.values[other[0]].kind == "parameter" and graph.values[other[0]].shape == (out,):
        return other[0], add.index
    return None, None


def _pairs(graph: ProgramGraph, linears: dict[int, _Linear], mp: int) -> tuple[list[_Pair], list[str]]:
    """Row linears with their column feeders, in program order; a linear is one or the other."""
    role: dict[int, str] = {}
    pairs, notes = [], []
    for index, lin in linears.items():
        feeders, region, blocked = _walk_back(graph, graph.ops[index].inputs[0], linears)
        if blocked is not None or not feeders:
            continue  # its input is not made by column linears: not row-parallel (it may be a column one)
        if _feeds_loss(graph, lin):
            notes.append(f"{_describe(graph, lin)}: left whole with its column partners, its output feeds the loss")
            continue
        whole = [f for f in feeders if role.get(f) == "row"] + ([index] if role.get(index) == "column" else [])
        if whole:
            continue  # chained linears (fc1 -> fc2 -> fc3): a linear is column or row, not both
        uneven = [f for f in feeders if graph.values[linears[f].weight].shape[1] % mp]
        if uneven or graph.values[lin.weight].shape[0] % mp:
            shapes = ", ".join(_describe(graph, linears[f]) for f in (*uneven, index))
            notes.append(
                f"{_path(graph, index)}: left whole with its column partners, {shapes} not divisible by mp={mp}"
            )
            continue
        role.update({f: "column" for f in feeders} | {index: "row"})
        extra = {i for f in feeders for i in (f, linears[f].bias_op) if i is not None}
        region = frozenset(region | extra | {index} | ({lin.bias_op} if lin.bias_op is not None else set()))
        pairs.append(_Pair(tuple(linears[f] for f in sorted(feeders)), lin, region))
    return pairs, notes


def _walk_back(
    graph: ProgramGraph, start: ValueKey | None, linears: dict[int, _Linear]
) -> tuple[set[int], set[int], str | None]:
    """From ``start`` back to the parameter matmuls that make it: (their op indices, the ops
    passed, what blocked the way or None). Breadth first, so a nearby normalization is met
    before a walk down the residual stream."""
    feeders: set[int] = set()
    region: set[int] = set()
    seen: set[ValueKey] = set()
    queue = deque([start] if start is not None else [])
    while queue:
        key = queue.popleft()
        if key in seen:
            continue
        seen.add(key)
        op = graph.ops[key[0]]
        value = graph.values[key]
        if op.index in linears:
            feeders.add(op.index)
        elif op.name in NEUTRAL_SOURCES or value.dtype.startswith(("int", "uint", "bool")):
            continue
        elif op.name == "builtin.parameter":
            if len(value.shape) > 1:
                return feeders, region, f"the parameter {value.label} {list(value.shape)}"
        elif op.name in NORMALIZING or op.name not in KEEPS_SPLIT:
            return feeders, region, f"{op.name} in {_path(graph, op.index)}"
        else:
            region.add(op.index)
            queue.extend(k for k in op.inputs if k is not None)
    return feeders, region, None


def _feeds_loss(graph: ProgramGraph, lin: _Linear) -> bool:
    """Whether the linear's output reaches a loss (a cross-entropy, or a reduction to a scalar)
    through elementwise and shape ops only: a classifier or regression head, not a layer."""
    return _loss_reached(graph, lin) is not None


def _loss_reached(graph: ProgramGraph, lin: _Linear) -> str | None:
    """The op name of the loss the linear's output reaches through elementwise and shape ops
    (:func:`_feeds_loss`), or None."""
    start = lin.bias_op if lin.bias_op is not None else lin.op
    todo, seen = [start], set()
    while todo:
        op = graph.ops[todo.pop()]
        if op.index in seen or op.role is not Role.FORWARD:
            continue
        seen.add(op.index)
        if "cross_entropy" in op.name or (
            op.name in NORMALIZING and all(graph.values[k].shape in ((), (1,)) for k in op.outputs if k)
        ):
            return op.name
        if op.index == start or (op.name in TO_LOSS):
            todo.extend(u for k in op.outputs if k is not None for u in graph.values[k].users)
    return None


def _heads(graph: ProgramGraph, linears: list[_Linear], mp: int) -> tuple[list[_Head], list[str]]:
    """Untied output heads (see the module docstring): linears not in a pair whose output
    reaches a cross-entropy, at least as wide as their input (a narrow classifier saves little
    split), their width divisible by mp."""
    found, notes = [], []
    for lin in linears:
        loss = _loss_reached(graph, lin)
        if loss is None or "cross_entropy" not in loss:
            continue
        inputs, width = graph.values[lin.weight].shape
        if width < inputs:
            continue
        if width % mp:
            notes.append(f"{_describe(graph, lin)}: the output head left whole, {width} classes not divisible by mp={mp}")
            continue
        found.append(_Head(lin, frozenset(_descendants(graph, lin.op))))
    return found, notes


# ---- vocabulary -----------------------------------------------------------------------------
def _vocabs(graph: ProgramGraph, mp: int) -> tuple[list[_Vocab], list[str]]:
    """Embedding tables read with token ids (from a feed), with at least as many rows as the
    hidden size, and V % mp == 0; their tied heads (``h @ table^T``) come with them."""
    found, notes = [], []
    tables = _unique(
        op.inputs[1]
        for op in graph.ops
        if op.role is Role.FORWARD and op.name == "pd_op.embedding" and len(op.inputs) > 1
    )
    for table in tables:
        value = graph.values[table]
        if value.kind != "parameter" or len(value.shape) != 2:
            continue
        readers = [graph.ops[u] for u in value.users if graph.ops[u].role is Role.FORWARD]
        embeddings = [op for op in readers if op.name == "pd_op.embedding"]
        heads = [
            op for op in readers if op.name == "pd_op.matmul" and op.attrs.get("transpose_y") and op.inputs[1] == table
        ]
        rows, width = value.shape
        where = f"{_path(graph, embeddings[0].index)} (table {value.label} {list(value.shape)})"
        if not all(_from_feed(graph, op.inputs[0]) for op in embeddings):
            continue  # positions made in the graph (arange): a table of positions, not a vocabulary
        others = sorted({op.name for op in readers if op not in embeddings and op not in heads})
        if others:
            notes.append(f"{where}: left whole, the table is also read by {', '.join(others)}")
        elif rows < width:
            notes.append(f"{where}: left whole, {rows} rows (fewer than its {width}-wide rows) save nothing split")
        elif rows % mp:
            notes.append(f"{where}: left whole, {rows} rows not divisible by mp={mp}")
        else:
            region = {op.index for op in embeddings} | {i for head in heads for i in _descendants(graph, head.index)}
            biases = [b for head in heads if (b := _bias_of(graph, head, rows)[0]) is not None]
            found.append(_Vocab(table, tuple(biases), frozenset(region)))
    return found, notes


def _from_feed(graph: ProgramGraph, key: ValueKey | None) -> bool:
    while key is not None:
        op = graph.ops[key[0]]
        if op.name == "pd_op.data":
            return graph.values[key].kind == "feed"
        if op.name not in ID_OPS or not op.inputs:
            return False
        key = op.inputs[0]
    return False


def _descendants(graph: ProgramGraph, index: int) -> set[int]:
    out, todo = set(), [index]
    while todo:
        i = todo.pop()
        if i in out or graph.ops[i].role is not Role.FORWARD:
            continue
        out.add(i)
        todo.extend(u for k in graph.ops[i].outputs if k is not None for u in graph.values[k].users)
    return out


# ---- the check by propagation ---------------------------------------------------------------
def _checked(graph: ProgramGraph, mp: int, items: list[_Item]) -> tuple[list[_Item], list[str]]:
    """``items`` whose splits propagation keeps, and a note for each one left whole: a split
    gathered back on the way, or a row-parallel linear whose input does not come split."""
    mesh = ProcessMesh(list(range(mp)), ["mp"])
    notes: list[str] = []
    kept = list(items)
    while kept:
        failures = _failures(graph, mesh, kept)
        if not failures:
            break
        culprits: dict[int, str] = {}
        for item, why in failures:
            if item is not None:
                culprits.setdefault(id(item), why)
        if not culprits:  # a lost split no item's region explains: who loses it alone
            for item in kept:
                alone = _failures(graph, mesh, [item])
                if alone:
                    culprits[id(item)] = alone[0][1]
        if not culprits:  # each keeps its split alone, not together
            culprits = {id(item): f"together with the others {failures[0][1]}" for item in kept}
        notes += [f"{_name(graph, item)}: left whole, {culprits[id(item)]}" for item in kept if id(item) in culprits]
        kept = [item for item in kept if id(item) not in culprits]
    return kept, notes


def _failures(graph: ProgramGraph, mesh: ProcessMesh, items: list[_Item]) -> list[tuple[_Item | None, str]]:
    from autopar.propagation import propagate

    user = {}
    for item in items:
        user.update(placements(graph, mesh, _as_tp([item]), None, "mp"))
    result = propagate(graph, mesh, user)
    out: list[tuple[_Item | None, str]] = []
    for need in result.reshards:
        lost = [d for d, dims in enumerate(need.have.mapping) if 0 in dims and 0 not in need.need.mapping[d]]
        if not lost:
            continue
        op = graph.ops[need.op]
        at = graph.ops[op.forward_op] if op.forward_op is not None else op
        value = graph.values[need.value]
        why = f"its split is lost at {at.name} in {_path(graph, at.index)} ({list(value.shape)} {need.have} -> {need.need}{_hint(at, mesh)})"
        out.append((next((item for item in items if at.index in item.region), None), why))
    for item in items:
        if isinstance(item, _Pair):
            x = graph.ops[item.row.op].inputs[0]
            made = result.made(x) if x is not None else None
            if made is not None and 0 not in made.mapping[-1]:
                out.append((item, f"the input of {_path(graph, item.row.op)} does not come split by columns ({made})"))
    return out


def _hint(op: OpNode, mesh: ProcessMesh) -> str:
    """Why a column split is commonly lost at ``op``."""
    mp = mesh.size
    if op.name == "pd_op.reshape":
        return f": the heads it makes do not line up with {mp} column pieces (heads not divisible by {mp}, or laid out [3, heads, head_dim])"
    if op.name in ("pd_op.split", "pd_op.split_with_num", "pd_op.unbind"):
        return f": it cuts the columns into parts (q | k | v) that {mp} column pieces do not line up with"
    return ""


def _as_tp(items: Iterable[_Item]) -> TensorParallel:
    items = list(items)
    pairs = [i for i in items if isinstance(i, _Pair)]
    vocabs = [i for i in items if isinstance(i, _Vocab)]
    heads = [i.linear for i in items if isinstance(i, _Head)]
    return TensorParallel(
        column=_unique([*(f.weight for p in pairs for f in p.feeders), *(h.weight for h in heads)]),
        column_bias=_unique([*(f.bias for p in pairs for f in p.feeders if f.bias is not None), *(b for v in vocabs for b in v.head_biases),
                             *(h.bias for h in heads)]),
        row=_unique(p.row.weight for p in pairs), vocab=_unique(v.table for v in vocabs), heads=_unique(h.weight for h in heads),
    )  # fmt: skip


# ---- words ----------------------------------------------------------------------------------
def _path(graph: ProgramGraph, index: int) -> str:
    op = graph.ops[index]
    return str(op.attrs.get("struct_name") or "").strip("/") or str(op)


def _describe(graph: ProgramGraph, lin: _Linear) -> str:
    value = graph.values[lin.weight]
    return f"{_path(graph, lin.op)} ({value.label} {list(value.shape)})"


def _name(graph: ProgramGraph, item: _Item) -> str:
    if isinstance(item, _Vocab):
        value = graph.values[item.table]
        return f"vocabulary embedding {value.label} {list(value.shape)}"
    if isinstance(item, _Head):
        return f"output head {_describe(graph, item.linear)}"
    linears = ", ".join(_describe(graph, f) for f in item.feeders)
    return f"column {linears} with row {_describe(graph, item.row)}"


def _unique(keys: Iterable[ValueKey | None]) -> tuple[ValueKey, ...]:
    return tuple(dict.fromkeys(k for k in keys if k is not None))
