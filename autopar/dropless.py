"""Dropless dispatch buffers: found in the program, their over-sending said, their all_to_alls
sent uneven on request (stage: reshard planning and emission; issue 40, "Capacity").

A router with a worst-case capacity drops no token: each expert has a slot for every token of a
group (``C = S``; a token takes at most one slot of an expert). Its dispatch buffer
``[E, G, C, H]`` is mostly padding: the routed tokens fill ``k x G x S`` of its ``E x G x S``
rows, ``k / E`` of it. Found from the program's shapes only: a forward ``einsum`` whose routing
operand ``[.., S, E, C]`` sums over the token letter ``S``, keeps the expert and capacity letters
``E`` and ``C`` (in no other operand), and has ``C`` of the size of ``S``: GShard's
``"gsec,gsm->egcm"``, PaddleNLP's ``"sec,sm->ecm"``. The dispatch einsums of one layer with the
same shapes are ``local_map``'s copies of one (one per group of tokens), joined along the
capacity. ``k`` is the router's top-k: the ``k`` of the ``topk`` ops over ``E`` in the einsum's
layer (an ``argmax`` over ``E`` picks one), per router call (calls told apart by their layer path,
as ``local_map`` copies are).

An all_to_all of a value of the buffer's shape, or one copy's (the dispatch, the combine and
their gradients), says in its reason the bytes it sends and what the routed tokens need,
``tokens x top_k x hidden x bytes``, both priced from those shapes. With
``Strategy(uneven_all_to_all=True)`` reshard planning plans (and prices) it as the uneven
all_to_all instead (the table's ``sent_uneven_as``: ``all_to_all_v``, trimmed along the capacity
dim at emission, counts found at run time: :class:`autopar.collective_kinds.AllToAllV`), at the
routed bytes a uniform gate sends the other members (:func:`autopar.cost_model.moe.uneven_bytes`
of the padded pieces for them). Only where an all_to_all is planned: the CPU profiles plan these
moves as all_gathers and slices (no all_to_all kernel), which stay as they are.

A dispatch buffer of any capacity summed over ranks (a reduce_scatter or all_reduce of its
pending sum) belongs to a router whose groups span several ranks (the whole batch at once): its
reason says so and names the per-group routing that moves it as all_to_alls instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.collective import Collective
from autopar.collective_kinds import KINDS, uneven_form
from autopar.cost_model.cluster import Cluster, dtype_bytes
from autopar.cost_model.comm import collective_time
from autopar.cost_model.moe import uneven_bytes
from autopar.cost_model.planner import ReshardPlan
from autopar.graph import OpNode, ProgramGraph, Role, once_per_graph


@dataclass(frozen=True, slots=True)
class DroplessBuffer:
    """A dropless dispatch buffer: the einsum's output ``shape``, its capacity dim, the tokens it
    routes (``G x S``), the router's ``top_k`` (None: no ``topk`` op found) and the row width."""

    shape: tuple[int, ...]
    capacity_dim: int
    experts: int
    tokens: int
    top_k: int | None
    hidden: int
    layer: str
    copy_shape: tuple[int, ...] | None = None  # one copy's, when local_map copies are joined along the capacity

    def matches(self, shape: Sequence[int]) -> bool:
        """Whether a value of ``shape`` is this buffer (or one copy of it)."""
        return tuple(shape) in (self.shape, self.copy_shape)

    @property
    def needed_share(self) -> float | None:
        """The share of the buffer the routed tokens fill: ``k x tokens x hidden / size``."""
        if self.top_k is None:
            return None
        return self.top_k * self.tokens * self.hidden / math.prod(self.shape)

    def over_sending(self, nbytes: int) -> str:
        """What an all_to_all sending ``nbytes`` of this buffer per rank says about its padding."""
        capacity = f"capacity {self.shape[self.capacity_dim]}"
        if self.copy_shape is not None:  # (local_map's copies joined along the capacity)
            per_copy = self.copy_shape[self.capacity_dim]
            capacity = f"capacity {per_copy} x {self.shape[self.capacity_dim] // per_copy} groups"
        head = f"dropless buffer {list(self.shape)} ({capacity}: every token of a group in one expert): sends {nbytes} B per rank"
        if self.top_k is None:
            return f"{head}; the router's top-k is not found in the program, so the routed tokens' bytes are not known"
        need = round(nbytes * self.needed_share)
        return (
            f"{head}, the routed tokens need {need} B (tokens x top_k x hidden: {self.tokens} x {self.top_k} x "
            f"{self.hidden} of {math.prod(self.shape)} values): {nbytes - need} B of padding, {nbytes / max(need, 1):.1f}x"
        )


@once_per_graph
def dropless_buffers(graph: ProgramGraph) -> tuple[DroplessBuffer, ...]:
    """The program's dropless dispatch buffers (module docstring), in op order. The dispatch
    einsums of one layer with the same shapes are one buffer's copies (``local_map``'s, one per
    group of tokens), joined along the capacity dim: the buffer's shape is the joined one."""
    found: dict[tuple, tuple[DroplessBuffer, int]] = {}
    for op in graph.ops:
        buffer = _dispatch(graph, op)
        if buffer is not None:
            key = (buffer.layer, buffer.shape, buffer.capacity_dim)
            found[key] = (buffer, found[key][1] + 1 if key in found else 1)
    return tuple(_joined(buffer, copies) for buffer, copies in found.values())


def _joined(buffer: DroplessBuffer, copies: int) -> DroplessBuffer:
    if copies == 1:
        return buffer
    shape = list(buffer.shape)
    shape[buffer.capacity_dim] *= copies
    return dataclasses.replace(buffer, shape=tuple(shape), tokens=buffer.tokens * copies, copy_shape=buffer.shape)


def _routings(graph: ProgramGraph, op: OpNode) -> list[tuple[str, str, str, list[str], str, dict[str, int]]]:
    """A forward einsum's readings as a dispatch (module docstring): ``(mask, other, out, own,
    token, sizes)`` for each operand that can be the routing one: of its full rank, summing one
    ``token`` letter away that the other operand shares, keeping two letters of its ``own``
    (experts and capacity); ``sizes``: each letter's."""
    operands, _, out = str(op.attrs.get("equation", "")).replace(" ", "").partition("->")
    letters = operands.split(",")
    if op.name != "pd_op.einsum" or op.role is not Role.FORWARD or not out or len(letters) != 2 or op.outputs[0] is None:
        return []
    shapes = [graph.values[k].shape if k is not None else () for k in op.inputs[:2]]
    found = []
    for m in (0, 1):
        mask, other = letters[m], letters[1 - m]
        own = [c for c in mask if c not in other and c in out]
        tokens = [c for c in mask if c in other and c not in out]
        if len(own) == 2 and len(tokens) == 1 and len(shapes[m]) == len(mask):
            found.append((mask, other, out, own, tokens[0], dict(zip(mask, shapes[m])) | dict(zip(other, shapes[1 - m]))))
    return found


def _dispatch(graph: ProgramGraph, op: OpNode) -> DroplessBuffer | None:
    for mask, other, out, own, token, sizes in _routings(graph, op):
        capacity = [c for c in own if sizes[c] == sizes[token]]
        if not capacity:
            continue  # a static capacity below the worst case
        c = capacity[-1]
        e = next(x for x in own if x != c)
        routed = math.prod(sizes[x] for x in mask if x not in (e, c))
        hidden = math.prod(sizes[x] for x in other if x not in mask)
        layer = str(op.attrs.get("struct_name", ""))
        return DroplessBuffer(
            tuple(graph.values[op.outputs[0]].shape), out.index(c), sizes[e], routed, _top_k(graph, layer, sizes[e]), hidden, layer.strip("/")
        )  # fmt: skip
    return None


@once_per_graph
def routed_buffer_shapes(graph: ProgramGraph) -> frozenset[tuple[int, ...]]:
    """The output shapes of the program's dispatch einsums, whatever their capacity."""
    return frozenset(tuple(graph.values[op.outputs[0]].shape) for op in graph.ops if _routings(graph, op))


WHOLE_BATCH_ROUTER = (
    "a dispatch buffer of a router whose groups of tokens span several ranks (the whole batch at once: one "
    "capacity for every rank's tokens, which fill slots anywhere in it), so it is summed over the ranks (and "
    "gathered back for the combine); routing per group of each rank's tokens (GShard's groups lined up with the ranks splitting "
    "the batch, or autopar.local_map) moves it as all_to_alls, 1/ep of these bytes (docs/moe.md)"
)


def _top_k(graph: ProgramGraph, layer: str, experts: int) -> int | None:
    """The router's top-k in ``layer``: the ``k`` of its ``topk`` ops over the experts (an
    ``argmax`` over them picks one: PaddleNLP's top2gating), per call (calls told apart by their
    layer path)."""
    per_call: dict[str, int] = {}
    for op in graph.ops:
        if op.role is not Role.FORWARD or op.name not in ("pd_op.topk", "pd_op.argmax"):
            continue
        if not str(op.attrs.get("struct_name", "")).startswith(layer or "/"):
            continue
        source = graph.values[op.inputs[0]]
        k = op.attrs.get("k") if op.name == "pd_op.topk" else 1
        if k is None and len(op.inputs) > 1 and op.inputs[1] is not None:
            k = graph.values[op.inputs[1]].const
        if not source.shape or source.shape[-1] != experts or k is None:
            continue
        name = str(op.attrs["struct_name"])
        per_call[name] = per_call.get(name, 0) + int(k if not hasattr(k, "__len__") else list(k)[0])
    counts = set(per_call.values())
    return counts.pop() if len(counts) == 1 else None


def _buffer(graph: ProgramGraph, shape: tuple[int, ...]) -> DroplessBuffer | None:
    return next((b for b in dropless_buffers(graph) if b.matches(shape)), None)


def dropless_plan(graph: ProgramGraph, plan: ReshardPlan, cluster: Cluster) -> ReshardPlan:
    """``plan`` with its all_to_alls of a dropless buffer planned as the uneven all_to_all (the
    table's ``sent_uneven_as``), priced at the routed share of the pieces sent to the others;
    other plans as they are."""
    buffer = _buffer(graph, plan.shape)
    if buffer is None:
        return plan
    steps = []
    for step in plan.steps:
        form = KINDS[step.kind].sent_uneven_as
        if form is None or not step.groups:
            steps.append(step)
            continue
        p = len(step.groups[0])  # (all_to_all_v's bytes: what leaves the busiest member, its own piece stays)
        nbytes = uneven_bytes(round(step.bytes * (p - 1) / p), buffer.needed_share)
        steps.append(dataclasses.replace(step, kind=form, bytes=nbytes, time=collective_time(form, step.groups[0], nbytes, cluster)))
    return dataclasses.replace(plan, steps=tuple(steps))


def dropless_collective(graph: ProgramGraph, collective: Collective) -> Collective:
    """``collective`` as emitted: an all_to_all of a dropless buffer says its padding in its
    reason; one planned uneven (:func:`dropless_plan`) is trimmed along the capacity dim; a
    sum of a dispatch buffer's shape (a per-group router's is never pending one: each rank's
    slots are its own) says it is a whole-batch router's (:data:`WHOLE_BATCH_ROUTER`)."""
    entry = KINDS[collective.kind]
    uneven = uneven_form(collective.kind) and not collective.splits
    if entry.sent_uneven_as is None and not uneven:
        if collective.src.partial and collective.shape in routed_buffer_shapes(graph):  # summed over the ranks: say why
            return dataclasses.replace(collective, reason=f"{collective.reason}; {WHOLE_BATCH_ROUTER}")
        return collective
    buffer = _buffer(graph, collective.shape)
    if buffer is None:
        return collective
    padded = math.prod(collective.output_shape) * dtype_bytes(collective.dtype)  # (even pieces: the input's size)
    reason = f"{collective.reason}; {buffer.over_sending(padded)}"
    if not uneven:
        return dataclasses.replace(collective, reason=f"{reason}; Strategy(uneven_all_to_all=True) sends only the filled rows")
    return dataclasses.replace(
        collective, trim_axis=buffer.capacity_dim,
        reason=f"{reason}; sent uneven: each expert's rows up to its last filled one along dim {buffer.capacity_dim}, "
        f"counts first, priced at the routed {collective.bytes} B a uniform gate sends the other members",
    )  # fmt: skip
