"""Context parallelism: the sequence of the activations split over a mesh dim of its own
(stage: rewrites — feed annotations, then propagation; Ulysses adds head annotations from a
first propagation, as sequence parallelism does).

``Strategy(context_parallel=ContextParallel(dim="sep", method=...))``. Nothing is lowered
here: the split is stated as annotations and propagation and the reshard planner do the rest.

**The split.** Batch-first programs carry the sequence in dim 1 of their token / label /
position feeds (``[batch, seq]``, ``[batch, seq, hidden]``). The sequence length is the
longest dim 1 among the feeds of two dims or more; every such feed whose dim 1 is that length
is split there over ``dim`` (after the mesh dims the feed's annotation already splits dim 1
with); a feed whose dim 1 is shorter (a ``[batch, 1]`` label), or with another dim of that
length too (a ``[seq, seq]`` bias: which dim is the queries' is not known), is kept as
annotated and named in the report. A feed the user annotated gets ``dim`` added when the annotation leaves ``dim``
unused (``[Shard(0), Replicate()]`` on ``[dp, sep]`` becomes dp on the batch, sep on the
sequence); one that already uses ``dim`` is kept as the user wrote it. A sequence length the
dim's size does not divide is refused by name (feed, length, mesh dim). Values built in the
graph — causal masks, rotary tables from ``arange``, position ids — follow by propagation.
In a pipeline, the hidden state the user reshards onto the next stage (``autopar.reshard``,
placed on the stage's sub-mesh, typically ``[Shard(0), Replicate()]``) carries the sequence
too: the same rule adds ``dim`` to it, else every stage after the first would run whole.

**method="all_gather"**: the split alone. Propagation keeps q split by sequence through the
projections and gathers K and V whole for the score matmul each layer (memory O(seq) per
rank for K / V and the scores' rows of this rank).

**method="all_to_all"** (DeepSpeed-Ulysses): at each attention core
(:mod:`autopar.attention_cores`), q, k and v as they enter the score matmul (``[B, H, S, D]``),
the probabilities and the core's output are annotated split on heads (dim 1) over ``dim``
at strategy priority (the user's annotations win), the sequence whole: the planner then moves
sequence -> heads before the core and heads -> sequence after it (one all_to_all each on a GPU
profile; the cheapest plan of the profile elsewhere), forward, and the mirror backward. A head
count the split does not divide (heads per rank of the other mesh dims splitting them, e.g.
tensor parallelism's) is refused by name (op, tensor, heads, cp). Where the layer transposes
the core's output back to ``[B, S, H, D]`` before its output projection, that value is split
on the sequence: the heads -> sequence move is then one all_to_all right after the core (left
alone, the planner kept the heads split into the projection and reduce-scattered its result).

Ring attention (``method="ring"``) is a per-op lowering of the cores (passes/ring_attention.py)
over the same split. ``balance="zigzag"`` reorders the sequence in the program first
(:mod:`.zigzag`), so that the same contiguous split gives rank i chunks i and 2cp-1-i.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from autopar.attention_cores import AttentionCore
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, ValueKey, ValueNode
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult

ZIGZAG = "zigzag"
ULYSSES = "all_to_all"  # the ContextParallel method (a method's name, not the collective kind it happens to be named after)
SEQ_DIM = 1  # batch-first feeds: [batch, seq, ...]
HEAD_DIM = 1  # attention cores' operands: [batch, heads, seq, head_dim]


@dataclass(frozen=True, slots=True)
class Carrier:
    """One value the split reads (``what``: a feed, or a stage copy — an activation the user
    resharded onto a pipeline stage): split on ``SEQ_DIM`` over the dim (``split``) or kept, and why."""

    key: ValueKey
    label: str
    shape: tuple[int, ...]
    what: str
    split: bool
    why: str

    def __str__(self) -> str:
        named = self.label if self.what == "feed" else f"{self.what} {self.label}"
        return f"{named} {list(self.shape)}" if self.split else f"{named} kept ({self.why})"


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """One attention-core value Ulysses splits on heads: the core's score matmul, the value's
    role there (q, k, v, probabilities, output) and its head count."""

    key: ValueKey
    label: str
    core: str
    role: str
    heads: int


@dataclass(frozen=True, slots=True)
class ContextSplit:
    """What context parallelism decided: the mesh dim and its size, the method, the sequence
    length, the values carrying it split (and kept), and Ulysses' head-split values."""

    dim: str
    size: int
    method: str
    length: int
    carriers: tuple[Carrier, ...]
    heads: tuple[HeadSplit, ...] = ()

    def __str__(self) -> str:
        split = [c for c in self.carriers if c.split]
        text = f"sequence ({self.length}) split over {self.dim!r} ({self.size} ranks, {self.method}): dim 1 of "
        text += ", ".join(map(str, split))
        kept = [c for c in self.carriers if not c.split]
        if kept:
            text += "; " + ", ".join(map(str, kept))
        if self.heads:
            cores = len({h.core for h in self.heads})
            text += f"; q, k, v, probabilities and output of {cores} attention core(s) split on heads ({len(self.heads)} values)"
        return text


def sequence_feeds(graph: ProgramGraph) -> list[ValueNode]:
    """The read feeds of two dims or more: those that may carry the sequence (module docstring)."""
    return [v for v in graph.values.values() if v.kind == "feed" and len(v.shape) >= 2 and v.users]


def sequence_length(graph: ProgramGraph, dim: str) -> int:
    """The longest dim 1 among :func:`sequence_feeds` (module docstring)."""
    lengths = [v.shape[SEQ_DIM] for v in sequence_feeds(graph)]
    if not lengths:
        raise AutoparError(
            f"Strategy.context_parallel over {dim!r}: the program has no feed of two dims or more ([batch, seq, ...]) "
            "whose sequence could be split"
        )
    return max(lengths)


def not_the_sequence(value: ValueNode, length: int) -> str | None:
    """Why ``value`` (of two dims or more) does not carry a sequence of ``length`` on dim 1 for
    the split (None: it does; module docstring)."""
    if value.shape[SEQ_DIM] != length:
        return f"dim 1 is {value.shape[SEQ_DIM]}, not the sequence"
    others = [d for d, size in enumerate(value.shape) if size == length and d != SEQ_DIM]
    if others:  # a [seq, seq] mask or bias: which dim is the queries' is not known (propagation slices it)
        return f"dim {others[0]} is {length} long too: which dim is the sequence is not known"
    return None


def sequence_carriers(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh], dim: str,
    stage_copies: Iterable[ValueKey] = (), stand_ins: Mapping[ValueKey, ValueKey] | None = None,
) -> tuple[int, tuple[Carrier, ...], dict[ValueKey, DistAttr]]:  # fmt: skip
    """The sequence length, the values carrying it that the split places (the feeds, and
    ``stage_copies``: the activations the user resharded onto a pipeline stage) or keeps, and
    their placements (module docstring). ``stand_ins``: a feed read through a reordered copy
    of it (:mod:`.zigzag`) -> that copy, which is placed instead of the feed."""
    length = sequence_length(graph, dim)
    feeds = sequence_feeds(graph)
    copies = [graph.values[key] for key in sorted(stage_copies) if len(graph.values[key].shape) >= 2]
    stand_ins = stand_ins or {}
    found, placed = [], {}
    for value, what in [*((v, "feed") for v in sorted(feeds, key=lambda v: v.key)), *((v, "stage copy") for v in copies)]:
        carrier = functools.partial(Carrier, value.key, value.label, value.shape, what)
        why = not_the_sequence(value, length)
        if why is not None:
            found.append(carrier(False, why))
            continue
        base = user.get(value.key)
        if base is not None and _uses(base, dim) and value.key not in stand_ins:
            found.append(carrier(False, f"annotated over {dim!r} by you: {base}"))
            continue
        if base is not None and _uses(base, dim):  # (read through its reordered copy: placed like the feed, dim moved)
            base = DistAttr(base.mesh, mapping=[tuple(d for d in dims if base.mesh.dim_names[d] != dim) for dims in base.mapping])
        on = base.mesh if base is not None else _reader_mesh(graph, value.key, op_meshes, mesh)
        size = on.dim_size(dim)
        if length % size:
            raise AutoparError(
                f"context parallelism over {dim!r} ({size} ranks) cannot split {what} {value.label!r} {list(value.shape)}: "
                f"its sequence length {length} (dim 1) is not divisible by {size}"
            )
        placed[stand_ins.get(value.key, value.key)] = _with_dim(base or DistAttr.replicated(on, len(value.shape)), SEQ_DIM, dim)
        found.append(carrier(True, "carries the sequence"))
    return length, tuple(found), placed


def head_splits(graph: ProgramGraph, first: PropagationResult, cores: Sequence[AttentionCore], dim: str) -> dict[ValueKey, HeadSplit]:
    """Ulysses: each core's q, k, v, probabilities and output (``[B, H, S, *]``) split on heads
    over ``dim`` and whole along the sequence; refused by name where the heads per rank of the
    other dims splitting them do not divide by the dim's size."""
    if not cores:
        raise AutoparError(
            f"ContextParallel(method='all_to_all') over {dim!r}: the program has no attention core to split on heads "
            "(matmul(q, k, transpose_y=True) -> scale / mask -> softmax -> dropout -> matmul(p, v), as "
            "autopar/attention_cores.py finds them; fused attention ops are not among them); use method='all_gather'"
        )
    found: dict[ValueKey, HeadSplit] = {}
    for core in cores:
        name = str(graph.ops[core.first])
        if len(graph.values[core.q].shape) != 4:
            raise AutoparError(
                f"ContextParallel(method='all_to_all') over {dim!r}: attention core {name} reads q "
                f"{graph.values[core.q].label!r} {list(graph.values[core.q].shape)}; Ulysses splits the heads of "
                "[batch, heads, seq, head_dim] operands only; use method='all_gather'"
            )
        roles = {"q": core.q, "k": core.k, "v": core.v, "probabilities": core.probabilities, "output": core.output}
        for role, key in roles.items():
            value, dist = graph.values[key], first.dist(key)
            heads = value.shape[HEAD_DIM]
            others = [d for d in dist.mapping[HEAD_DIM] if dist.mesh.dim_names[d] != dim]
            per_rank = heads // math.prod(dist.mesh.shape[d] for d in others)
            size = dist.mesh.dim_size(dim)
            if per_rank % size:
                where = f"{per_rank} heads per rank of {[dist.mesh.dim_names[d] for d in others]}" if others else f"{heads} heads"
                raise AutoparError(
                    f"context parallelism all_to_all over {dim!r} ({size} ranks) splits the heads of attention core {name}: "
                    f"{role} {value.label!r} {list(value.shape)} has {where}, not divisible by {size}; "
                    "use method='all_gather' (or 'ring'), or a cp size dividing the heads"
                )
            found[key] = HeadSplit(key, value.label, name, role, heads)
    return found


def head_placements(first: PropagationResult, splits: Mapping[ValueKey, HeadSplit], dim: str) -> dict[ValueKey, DistAttr]:
    """The head-split values' placements: as the first propagation placed them, with ``dim``
    moved from the sequence to the heads (after the dims already splitting the heads)."""
    return {key: _with_dim(first.dist(key), HEAD_DIM, dim) for key in splits}


def sequence_after(graph: ProgramGraph, first: PropagationResult, splits: Mapping[ValueKey, HeadSplit], dim: str) -> dict[ValueKey, DistAttr]:
    """Where a core's output is transposed back to ``[B, S, H, D]`` (as attention layers write
    it before the output projection), the transposed value split on the sequence over ``dim``:
    the heads -> sequence move happens right after the core, as in Ulysses (left to itself,
    the planner keeps the heads split into the output projection and sums its result there)."""
    found = {}
    for key, split in splits.items():
        if split.role != "output":
            continue
        for index in graph.values[key].users:
            reader = graph.ops[index]
            if reader.short_name == "transpose" and list(reader.attrs.get("perm", ())) == [0, 2, 1, 3] and reader.outputs[0] is not None:
                found[reader.outputs[0]] = _with_dim(first.dist(reader.outputs[0]), SEQ_DIM, dim)
    return found


def _with_dim(attr: DistAttr, tensor_dim: int, dim: str) -> DistAttr:
    """``attr`` with mesh dim ``dim`` splitting ``tensor_dim`` (last) and no other tensor dim."""
    index = attr.mesh.dim_names.index(dim)
    mapping = [tuple(d for d in dims if d != index) for dims in attr.mapping]
    mapping[tensor_dim] = (*mapping[tensor_dim], index)
    return DistAttr(attr.mesh, mapping=mapping, partial=attr.partial)


def _uses(attr: DistAttr, dim: str) -> bool:
    index = attr.mesh.dim_names.index(dim) if dim in attr.mesh.dim_names else None
    return index is not None and (index in attr.sharded_mesh_dims() or index in attr.partial_dims)


def _reader_mesh(graph: ProgramGraph, key: ValueKey, op_meshes: Mapping[int, ProcessMesh], mesh: ProcessMesh) -> ProcessMesh:
    """The mesh of the first op reading ``key`` that has one (a pipeline stage), else the mesh."""
    for user in graph.values[key].users:
        if user in op_meshes:
            return op_meshes[user]
    return mesh
