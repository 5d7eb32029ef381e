"""Which values carry the sequence in zig-zag order, and along which dims (stage: after
compile, for the rank plans' value table: what a fetch un-permutes).

:mod:`.zigzag` reorders the feeds, position aranges and causal masks in the program through
``index_select`` with the zig-zag index; every value made from them carries the sequence in
that order along some of its dims. Returning such a value as it is would hand the user
logits whose tokens are permuted, so each value gets an :class:`~autopar.rank_plan.SequenceOrder`:
the dims to put back in serial order, or why that is not known (then a fetch of it is
refused by name). Found by walking the final graph in program order:

* the reordering selects (the index an ``assign_value_`` of the zig-zag order): their input's
  dims and their axis;
* an op whose rule is an equation (``abcd->acbd``, ``abmk,abnk->abmn``: autopar/spmd/): the
  dim's letter, wherever the result has it (a transpose moves it, a matmul keeps q's rows and
  K's columns, an embedding its ids' dims); a letter the result lacks is summed over
  (reordered in every operand alike, as attention's keys: the same sum); a dim the equation
  keeps whole (``1``: an axis the op works along, a concat's, an index_select's) is followed
  only through a ``slice`` keeping its first positions (GPT-2 cuts its mask buffer);
* a reshape (``reshape``, ``flatten``, ``squeeze``, ``unsqueeze``): the output dim of the same
  size with as many elements before it, or the dim the reordered block lands in whole when
  merged with its neighbours (logits flattened to ``[batch * seq, vocab]``: the sequence a block
  of the merged dim, :class:`SequenceOrder`'s ``(dim, extent, inner)``); ``expand`` and the few
  rules without an equation that keep dims in place (``POSITIONAL``): right-aligned;
* a dim that maps nowhere: dropped where the op reduces it (a ``sum``/``mean``/``max``/``min``
  over it, a scalar result: the loss), else the order is unknown;
* a gradient op's results are the gradients of its forward op's operands, in their order
  (or the one operand of the result's shape: ``embedding_grad`` makes the weight's only)
  (``transpose_grad``, linked to no forward op, moves its input's dims back by its perm); a
  recompute clone's results are its op's.

Values no reordered value reaches are in serial order (parameters, their gradients: sums over
the tokens, which a reordering leaves alone).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence

from autopar.graph import OpNode, ProgramGraph, Role, ValueKey
from autopar.rank_plan import SequenceOrder
from autopar.recompute_clones import remade as clones_remake
from autopar.spmd import get_rule, trait_values
from autopar.spmd.base import TensorSpec

CONTRACTED = -1  # a dim its op sums over (its letter not in the result)
ALONG = -2  # a dim its op works along (its rule keeps it whole: ``1``)
ALONG_TEXT = "works along"
_PASSES = trait_values("zigzag_passes")  # op (short name) -> how the order passes it (declared beside the rules)
RESHAPES = frozenset(op for op, how in _PASSES.items() if how == "reshape")
POSITIONAL = frozenset(op for op, how in _PASSES.items() if how == "in_place")  # rules without an equation, dims kept in place
REDUCTIONS = frozenset(op for op, how in _PASSES.items() if how == "reduces")


Dim = tuple[int, int, int]  # (dim, extent, inner): SequenceOrder.dims
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {order: zigzag_values}


def sequence_orders(graph: ProgramGraph, order: tuple[int, ...] | None) -> dict[ValueKey, SequenceOrder]:
    """:func:`zigzag_values` of ``graph`` whose sequence the zig-zag rewrite reordered to
    ``order`` (None: no zig-zag, nothing), computed once per graph."""
    if order is None:
        return {}
    cached = _FOUND.setdefault(graph, {})
    if order not in cached:
        cached[order] = zigzag_values(graph, order)
    return cached[order]


def zigzag_order(length: int, cp: int) -> tuple[int, ...]:
    """The positions in zig-zag order: 2cp chunks, rank i's two (i and 2cp-1-i) side by side."""
    chunk = length // (2 * cp)
    order: list[int] = []
    for rank in range(cp):
        for piece in (rank, 2 * cp - 1 - rank):
            order += range(piece * chunk, (piece + 1) * chunk)
    return tuple(order)


def zigzag_values(graph: ProgramGraph, order: Sequence[int]) -> dict[ValueKey, SequenceOrder]:
    """Each value carrying the sequence (``order``: the zig-zag positions) in zig-zag order ->
    its :class:`SequenceOrder` (module docstring); values in serial order are absent."""
    length = len(order)
    remade = clones_remake(graph)
    found: dict[ValueKey, SequenceOrder] = {}
    for op in graph.ops:
        if not any(k is not None for k in op.outputs):
            continue
        if op.recomputes is not None and all(k is None or k in remade for k in op.outputs):
            # a recompute clone re-makes its op's results, paired as the rewrite pairs them (a
            # dropout's clone x * cast(mask) / (1 - p) by its last op; its cast and product
            # follow their inputs like any op)
            for mine in op.outputs:
                if mine is not None and remade[mine] in found:
                    found[mine] = found[remade[mine]]
            continue
        inputs = [k for k in op.inputs if k is not None]
        reordering = _reordering_axis(graph, op, order)
        if reordering is None and not any(k in found for k in inputs):
            continue
        unknown = next((found[k] for k in inputs if k in found and found[k].unknown), None)
        for position, key in enumerate(op.outputs):
            if key is None:
                continue
            if unknown is not None:
                found[key] = unknown
                continue
            dims = _dims(graph, op, position, key, found, reordering, length)
            if isinstance(dims, str):
                found[key] = SequenceOrder(tuple(order), (), f"{op} {dims}" if dims.startswith(ALONG_TEXT) else f"{dims} (made by {op})")
            elif dims:
                found[key] = SequenceOrder(tuple(order), tuple(sorted(dims)))
    return found


def _reordering_axis(graph: ProgramGraph, op: OpNode, order: Sequence[int]) -> int | None:
    """The axis a reordering ``index_select`` of :mod:`.zigzag` reorders (None: not one)."""
    if op.short_name != "index_select" or len(op.inputs) < 2 or op.inputs[1] is None:
        return None
    index = graph.ops[op.inputs[1][0]]
    values = index.attrs.get("values") if index.short_name == "assign_value_" else None
    if values is None or [int(v) for v in list(values)[: len(order)]] != list(order):
        return None
    return int(op.attrs.get("axis", 0)) % len(graph.values[op.inputs[0]].shape)


def _dims(graph: ProgramGraph, op: OpNode, position: int, key: ValueKey, found: Mapping[ValueKey, SequenceOrder], reordering: int | None, length: int) -> set[Dim] | str:  # fmt: skip
    """The reordered dims of ``op``'s result ``key`` (at ``position``), or why they are not known."""
    out = graph.values[key].shape
    if reordering is not None:
        source = op.inputs[0]
        return set(found[source].dims if source in found else ()) | {(reordering, out[reordering], 1)}
    if op.role is not Role.FORWARD and op.name.endswith("_grad"):
        return _gradient_dims(graph, op, position, key, found)
    dims: set[Dim] = set()
    for index, source in enumerate(op.inputs):
        if source is None or source not in found:
            continue
        shape = graph.values[source].shape
        for dim in found[source].dims:
            mapped = _mapped(graph, op, index, shape, dim, out, position)
            if mapped == CONTRACTED:
                continue
            if mapped in (None, ALONG):
                if _reduces(graph, op, shape, dim[0], out):
                    continue
                where = f"dim {dim[0]} of {graph.values[source].label} {list(shape)}, in zig-zag order"
                return f"{ALONG_TEXT} {where}" if mapped == ALONG else f"{where}, has no place in {list(out)}"
            if mapped[1] < length:
                return f"{ALONG_TEXT} dim {mapped[0]}: it keeps {mapped[1]} of the {length} reordered positions"
            dims.add(mapped)
    return dims


def along_sequence(graph: ProgramGraph, order: Sequence[int]) -> list[tuple[OpNode, str]]:
    """The forward ops working along a dim that carries the sequence in zig-zag order (a shift, a
    flip, a cumulative sum, a concat or a gather along it): what they compute over the reordered
    sequence is not serial's. (An op whose rule says nothing of its dims is not among them: the
    values it makes are refused at fetch instead.)"""
    found = zigzag_values(graph, order)
    return [(graph.ops[key[0]], order_.unknown) for key, order_ in found.items()
            if order_.unknown.startswith(f"{graph.ops[key[0]]} {ALONG_TEXT}") and graph.ops[key[0]].role is Role.FORWARD
            and graph.ops[key[0]].recomputes is None]  # fmt: skip


def _gradient_dims(graph: ProgramGraph, op: OpNode, position: int, key: ValueKey, found: Mapping[ValueKey, SequenceOrder]) -> set[Dim] | str:  # fmt: skip
    """A grad op's result ``position``: the gradient of its forward op's operand there."""
    if op.short_name == "transpose_grad" and op.inputs and op.inputs[0] in found:  # (read alone: no forward op linked)
        perm = [p % len(graph.values[key].shape) for p in op.attrs.get("perm", ())]
        return {(perm[d], extent, inner) for d, extent, inner in found[op.inputs[0]].dims}
    forward = graph.ops[op.forward_op] if op.forward_op is not None else None
    shape = graph.values[key].shape
    operand = forward.inputs[position] if forward is not None and position < len(forward.inputs) else None
    if forward is not None and (operand is None or graph.values[operand].shape != shape):  # (embedding_grad: the weight's only)
        alike = {k for k in forward.inputs if k is not None and graph.values[k].shape == shape}
        operand = alike.pop() if len(alike) == 1 else None
    if operand is None:
        return "a gradient whose forward operand is not known"
    return set(found[operand].dims) if operand in found else set()


def _mapped(graph: ProgramGraph, op: OpNode, index: int, shape: tuple[int, ...], dim: Dim, out: tuple[int, ...], position: int) -> Dim | int | None:  # fmt: skip
    """What input ``index``'s reordered ``dim`` becomes in result ``position`` (None: nothing known;
    CONTRACTED: summed over)."""
    d, extent, inner = dim
    letters = _letters(graph, op, index, position)
    if letters is not None:  # the op's rule equation: the dim's letter, where the result has it
        ins, result = letters
        letter = ins[d] if d < len(ins) else "1"
        if letter != "1":
            return (result.index(letter), extent, inner) if letter in result else CONTRACTED
        if inner == 1 and shape[d] == extent and len(shape) == len(out) and _keeps_first(graph, op, d):
            return (d, out[d], 1)
        return ALONG  # a dim the rule keeps whole: an axis the op works along
    if op.short_name in RESHAPES:
        return _reshaped(shape, dim, out)
    if op.short_name in POSITIONAL and len(shape) <= len(out):  # broadcast into the result, right-aligned
        offset = len(out) - len(shape)
        if out[d + offset] == shape[d]:
            return (d + offset, extent, inner)
    return None


def _letters(graph: ProgramGraph, op: OpNode, index: int, position: int) -> tuple[str, str] | None:
    """Input ``index``'s and result ``position``'s letters in ``op``'s rule equation (None: its
    rule has none, or does not describe them)."""
    equation = getattr(get_rule(op.name), "equation", None)
    if not callable(equation):
        return None
    specs = [TensorSpec(graph.values[k].shape) if k is not None and graph.values[k].kind != "vector" else None for k in op.inputs]
    try:
        text = equation(specs, op.attrs)
    except (AttributeError, TypeError, IndexError, KeyError, ValueError):
        return None
    ins, _, outs = text.partition("->")
    present = [i for i in range(len(specs)) if specs[i] is not None]
    operands, results = ins.split(","), outs.split(",")
    if index not in present or present.index(index) >= len(operands) or position >= len(results):
        return None
    return operands[present.index(index)], results[position]


def _reshaped(shape: tuple[int, ...], dim: Dim, out: tuple[int, ...]) -> Dim | None:
    """A reshape's: the output dim of the same size with as many elements before it, else the
    dim the reordered block of elements lands in whole (merged with its neighbours)."""
    d, extent, inner = dim
    before = math.prod(shape[:d])
    for e, size in enumerate(out):
        if size == shape[d] and math.prod(out[:e]) == before:
            return (e, extent, inner)
    stride = inner * math.prod(shape[d + 1 :])
    for e, size in enumerate(out):
        tail = math.prod(out[e + 1 :])
        if stride % tail == 0 and (tail * size) % (stride * extent) == 0:
            return (e, extent, stride // tail)
    return None


def _keeps_first(graph: ProgramGraph, op: OpNode, d: int) -> bool:
    """A ``slice`` of dim ``d`` from position 0 (GPT-2 cuts its mask buffer to the sequence)."""
    if op.name != "pd_op.slice" or len(op.inputs) < 2 or op.inputs[1] is None:
        return False
    axes = [int(a) for a in op.attrs.get("axes", ())]
    starts = graph.values[op.inputs[1]].const
    if d not in axes or starts is None:
        return False
    starts = list(starts) if isinstance(starts, (list, tuple)) else [starts]
    return len(starts) == len(axes) and int(starts[axes.index(d)]) == 0


def _reduces(graph: ProgramGraph, op: OpNode, shape: tuple[int, ...], d: int, out: tuple[int, ...]) -> bool:
    """Whether ``op`` sums / averages its input's dim ``d`` away (a scalar result: the loss)."""
    if math.prod(out) == 1:
        return True
    if op.short_name not in REDUCTIONS:
        return False
    axis = op.attrs.get("axis")
    if axis is None and len(op.inputs) > 1 and op.inputs[1] is not None:
        axis = graph.values[op.inputs[1]].const
    if axis is None or axis == [] or axis == ():
        return True
    axes = [int(a) % len(shape) for a in (axis if isinstance(axis, (list, tuple)) else [axis])]
    return d in axes
