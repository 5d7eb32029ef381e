"""Zig-zag balance for context parallelism: the sequence reordered so that a contiguous split
gives rank i chunks i and 2cp-1-i (stage: rewrites, the first one, so that pipeline stages
and micro-batches see the reordered program as the user's).

With a causal mask, row r of the attention reads keys 0..r: split the sequence in cp
contiguous pieces and the last rank does most of the work. Cut it in 2cp chunks and hand rank
i chunks i and 2cp-1-i, and every rank gets the same number of (query, key) pairs. autopar
states that as a reordering of the sequence inside the program, so that the usual contiguous
split over the dim does the rest:

* each feed the split carries (tokens, labels: dim 1) is read through ``index_select`` with
  the zig-zag order — every rank is fed the whole (integer) sequence, and keeps its chunks;
* the values the program builds from positions follow the same order: a position ``arange``
  of the sequence length (start 0, step 1: GPT-2's position ids, Llama's rotary angles) is
  reordered, and a causal mask made by ``triu`` / ``tril`` (square, at least the sequence
  long, as GPT-2 slices its ``block_size`` buffer) is reordered on both of its last dims.

Position-wise ops, attention with its mask and positions reordered alike, and a loss summed or
averaged over the tokens are unchanged by a reordering, so the step — loss and gradients —
is the serial one. A value built in the graph from constants alone with a dim of the
sequence length that is neither of those (nor made from one) cannot be made to follow: it is
refused by name, and so is a random draw other than dropout (it would draw in the zig-zag
order, not serial's) and an op working along a reordered dim (a shift, a flip, a cumsum:
:func:`refuse_work_along_the_sequence`). A training dropout draws the serial mask and reorders it like its input
(passes/dropout_slicing.py, the ring's blocks: passes/ring_blocks.py). Which values carry the
sequence in zig-zag order, and along which dims, is found on the compiled graph
(:mod:`autopar.zigzag_values`): the rank plans carry it, fetches are put back in serial order
and ``autopar.check`` compares in serial order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.spmd import ops_where
from autopar.zigzag_values import along_sequence, zigzag_order

if TYPE_CHECKING:
    from paddle.pir import Program

RANDOM = ops_where("random", short=True) | {"dropout"}  # forward ops that draw random numbers


@dataclass(frozen=True)
class Zigzag:
    """The rewritten program (every reader of a reordered value reads its reordered copy):
    ``positions`` (old op index -> new), ``meshes`` (each inserted op -> the sub-mesh of the op
    it serves, where one is placed) and what was reordered."""

    program: Program
    positions: tuple[int, ...]
    meshes: Mapping[int, ProcessMesh]
    labels: tuple[str, ...]

    def __str__(self) -> str:
        return f"zig-zag order (rank i: chunks i and 2cp-1-i) on {', '.join(self.labels)}"


def zigzag(
    program: Any, graph: ProgramGraph, length: int, cp: int, feeds: Sequence[ValueKey], op_meshes: Mapping[int, ProcessMesh], dim: str,
) -> Zigzag:  # fmt: skip
    """Reorder ``feeds`` (dim 1), the position aranges and causal masks of ``graph``'s program
    (module docstring); refused by name where the order cannot be followed."""
    import numpy as np
    import paddle

    if length % (2 * cp):
        raise AutoparError(
            f"ContextParallel(balance='zigzag') over {dim!r} ({cp} ranks) cuts the sequence in {2 * cp} chunks: "
            f"its length {length} is not divisible by {2 * cp}"
        )
    _refuse_other_sequence_dims(graph, length, dim)
    targets = _targets(graph, length, feeds)
    _refuse_unfollowed(graph, length, targets, dim)
    _refuse_random(graph, dim)
    order = zigzag_order(length, cp)
    work = program.clone()
    raw = list(work.global_block().ops)
    inserted: dict[Any, ProcessMesh] = {}
    with paddle.static.program_guard(work):
        for key, dims in targets.items():
            result = raw[key[0]].result(key[1])
            served = min(graph.values[key].users) if graph.values[key].kind == "feed" else key[0]
            if served != key[0]:  # a feed: before its first reader (a pipeline's labels are read on the last stage)
                paddle.pir.set_insertion_point(raw[served])
            else:
                paddle.pir.set_insertion_point_after(raw[key[0]])
            value, ops = result, []
            for axis in dims:
                size = graph.values[key].shape[axis]
                index = paddle.assign(np.array([*order, *range(length, size)], dtype="int64"))
                value = paddle.index_select(value, index, axis=axis)
                ops += [index.get_defining_op(), value.get_defining_op()]
            result.replace_all_uses_with(value)
            ops[1].operand(0).set_source(result)  # (the first select reads the value itself)
            if served in op_meshes:
                inserted.update(dict.fromkeys(ops, op_meshes[served]))
        paddle.pir.reset_insertion_point_to_end()
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    positions = tuple(where[op.id()] for op in raw)
    labels = tuple(f"{graph.values[k].label} (dims {list(d)})" if graph.values[k].kind == "feed" else f"{graph.ops[k[0]]} (dims {list(d)})"
                   for k, d in targets.items())  # fmt: skip
    return Zigzag(work, positions, {where[op.id()]: m for op, m in inserted.items()}, labels)


def refuse_work_along_the_sequence(graph: ProgramGraph, length: int, cp: int, dim: str) -> None:
    """``graph``, the reordered program: an op working along a dim that carries the sequence in
    zig-zag order (a shift of the labels ``x[:, 1:]``, a flip, a cumulative sum, a concat or a
    gather along it: :func:`autopar.zigzag_values.along_sequence`) computes over the reordered
    sequence what serial computes over the serial one — not the same values: refused by name."""
    found = along_sequence(graph, zigzag_order(length, cp))
    if found:
        raise AutoparError(
            f"ContextParallel(balance='zigzag') over {dim!r}: {found[0][1]}; over the reordered sequence it would not "
            "compute what it computes over yours; use balance=None"
        )


def reordered_feeds(graph: ProgramGraph, length: int) -> dict[ValueKey, ValueKey]:
    """Each feed carrying the sequence that is read through its zig-zag copy (the one
    ``index_select`` along dim 1 :func:`zigzag` put after it) -> that copy."""
    found = {}
    for key, value in graph.values.items():
        if value.kind != "feed" or len(value.shape) < 2 or value.shape[1] != length:
            continue
        readers = sorted({u for u in value.users if graph.ops[u].role is Role.FORWARD})
        if len(readers) == 1:
            reader = graph.ops[readers[0]]
            if reader.short_name == "index_select" and reader.attrs.get("axis") == 1 and reader.inputs[0] == key:
                found[key] = reader.outputs[0]
    return found


def _targets(graph: ProgramGraph, length: int, feeds: Sequence[ValueKey]) -> dict[ValueKey, tuple[int, ...]]:
    """The values to reorder and the dims of each: the feeds (dim 1), the position aranges
    (dim 0), the causal masks (their last two dims)."""
    found = {key: (1,) for key in feeds}
    for op in graph.ops:
        if op.role is not Role.FORWARD or not op.outputs or op.outputs[0] is None:
            continue
        shape = graph.values[op.outputs[0]].shape
        if op.short_name == "arange" and shape == (length,) and op.attrs.get("start") == 0 and op.attrs.get("step") == 1:
            found[op.outputs[0]] = (0,)
        elif op.short_name in ("triu", "tril") and len(shape) >= 2 and shape[-1] == shape[-2] >= length:
            found[op.outputs[0]] = (len(shape) - 2, len(shape) - 1)
    return found


def _refuse_unfollowed(graph: ProgramGraph, length: int, targets: Mapping[ValueKey, tuple[int, ...]], dim: str) -> None:
    """A value built from constants alone, with a dim of the sequence length, read beside a
    value made from the feeds or parameters, and neither reordered nor made from a reordered
    value: the zig-zag order cannot reach it (a mask or a position table built another way)."""
    built = _constant_built(graph)
    following = _made_from(graph, set(targets))
    for op in graph.ops:
        if op.role is not Role.FORWARD:
            continue
        inputs = [k for k in op.inputs if k is not None]
        if all(k in built for k in inputs):
            continue
        for key in inputs:
            value = graph.values[key]
            if key in built and key not in following and value.kind != "constant" and length in value.shape:
                raise AutoparError(
                    f"ContextParallel(balance='zigzag') over {dim!r}: {value.label} {list(value.shape)}, made by "
                    f"{graph.ops[key[0]]} from constants and read by {op}, has a dim of the sequence length {length} that "
                    "the zig-zag order cannot follow (it follows position aranges of the sequence length and causal "
                    "masks from triu / tril); use balance=None"
                )


def _refuse_other_sequence_dims(graph: ProgramGraph, length: int, dim: str) -> None:
    """A feed with a dim of the sequence length other than dim 1 (an attention mask fed
    ``[batch, 1, seq, seq]`` or ``[seq, seq]``): which of its dims to reorder is not known."""
    for value in graph.values.values():
        if value.kind == "feed" and value.users and length in (value.shape[:1] + value.shape[2:]):
            raise AutoparError(
                f"ContextParallel(balance='zigzag') over {dim!r}: feed {value.label!r} {list(value.shape)} has a dim of the "
                f"sequence length {length} besides dim 1; the zig-zag order reorders dim 1 of the feeds only (an attention "
                "mask or position table fed whole is not followed); use balance=None"
            )


def _refuse_random(graph: ProgramGraph, dim: str) -> None:
    """A random draw other than dropout's mask over the reordered sequence draws in the zig-zag
    order: not the serial numbers. (A training dropout is lowered to the serial mask reordered
    like its input: passes/dropout_slicing.py, passes/ring_blocks.py.)"""
    for op in graph.ops:
        if op.role is Role.FORWARD and op.short_name in RANDOM and op.short_name != "dropout":
            raise AutoparError(
                f"ContextParallel(balance='zigzag') over {dim!r}: {op} draws random numbers, which over the reordered "
                "sequence would not be the serial run's (only dropout's mask is drawn serially and reordered); "
                "use balance=None"
            )


def _constant_built(graph: ProgramGraph) -> set[ValueKey]:
    """The forward values made from constants alone (no feed, parameter or state upstream)."""
    built: set[ValueKey] = set()
    for op in graph.ops:
        if op.role is not Role.FORWARD:
            continue
        inputs = [k for k in op.inputs if k is not None]
        if all(k in built or graph.values[k].kind == "constant" for k in inputs) and not any(
            graph.values[k].kind in ("feed", "parameter", "state") for k in op.outputs if k is not None
        ):
            built.update(k for k in op.outputs if k is not None)
    return built


def _made_from(graph: ProgramGraph, sources: set[ValueKey]) -> set[ValueKey]:
    """``sources`` and every forward value made from one of them."""
    reached = set(sources)
    for op in graph.ops:
        if op.role is Role.FORWARD and any(k in reached for k in op.inputs if k is not None):
            reached.update(k for k in op.outputs if k is not None)
    return reached
