"""A loss averaged over the tokens a mask selects, made exact over micro-batches (stage:
rewrite, before micro-batching).

The Llama and GPT pretraining criteria of Paddle's ecosystem average the token losses that a
mask keeps::

    loss = paddle.mean(paddle.masked_select(token_loss, labels != ignore_index))   # or: token_loss > 0

Serially that is ``S / C``: the sum of the selected losses over their count. Both are sums over
rows; but the count of the whole batch is known only once every micro-batch has run its forward
(for ``token_loss > 0`` it is made from the model's output), while 1F1B runs the first
micro-batch's backward before the last one's forward. So the division is deferred to the step's
update, where every micro-batch's parts are in:

- each micro-batch computes ``s = sum(token_loss * mask)`` and ``c = sum(mask)`` (``mask`` cast
  to the loss's dtype), and its backward starts from ``d s / d token_loss = mask`` (the
  gradient of ``S``, not of ``S / C``);
- in the update phase (once per step, Paddle's ``op_role`` 2), ``s`` and ``c`` arrive summed over
  the micro-batches (the runtime accumulates what the update reads, as it does gradients),
  the loss is ``S / C``, and every gradient the optimizer reads is divided by ``C`` before any
  optimizer op (global-norm clipping included) sees it. ``C`` is copied once to each stage
  mesh that divides by it (one transfer per stage, not one per gradient).

``C`` has no gradient (the mask is a comparison), so this is the serial gradient
``(1 / C) d S / d theta``. The form must be the step's loss: a masked mean added to another term
(whose gradient must not be divided by ``C``) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError
from autopar.graph import UPDATE_ROLE, VECTOR_OPS, OpNode, ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh

if TYPE_CHECKING:
    from paddle.pir import Program


@dataclass(frozen=True)
class MaskedMean:
    """One ``mean(masked_select(x, mask))`` of the graph and its backward ops."""

    select: int
    mean: int
    mean_grad: int
    select_grad: int
    seed: int  # the loss-gradient seed (full_like of the loss)

    @property
    def ops(self) -> tuple[int, ...]:
        """The ops the deferred division replaces (their constants stay, unread)."""
        return (self.select, self.mean, self.seed, self.mean_grad, self.select_grad)


@dataclass(frozen=True)
class DeferredMeans:
    """The rewritten program and where its ops moved."""

    program: Program
    positions: tuple[int | None, ...]  # old op index -> new index (None: erased)
    meshes: Mapping[int, ProcessMesh]  # new index -> the mesh of the op it serves
    labels: tuple[str, ...]

    def __str__(self) -> str:
        return f"{', '.join(self.labels)}: divided by the selected count once per step, after every micro-batch"


def masked_means(graph: ProgramGraph) -> list[MaskedMean]:
    """The masked means of ``graph`` that are the step's loss (refused by name where one is not)."""
    found = []
    for op in graph.ops:
        if op.role is not Role.FORWARD or op.name != "pd_op.masked_select" or op.outputs[0] is None:
            continue
        users = [graph.ops[u] for u in graph.values[op.outputs[0]].users]
        means = [u for u in users if u.name == "pd_op.mean" and u.role is Role.FORWARD]
        if not means:
            continue
        mean = means[0]
        seeds = [graph.ops[u] for u in graph.values[mean.outputs[0]].users]
        if any(u.role is not Role.BACKWARD for u in seeds) or len(seeds) != 1:
            raise AutoparError(
                f"micro-batching: {mean} averages {graph.values[op.outputs[0]].label} (selected by {op}), and "
                "its result is read by other ops than the backward's seed: only a masked mean that is the step's loss "
                "is exact over micro-batches (its division is deferred to the update)"
            )
        mean_grad = _grad_reading(graph, graph.values[seeds[0].outputs[0]].users, "pd_op.mean_grad")
        select_grad = _grad_reading(graph, graph.values[mean_grad.outputs[0]].users, "pd_op.masked_select_grad")
        x, mask = (graph.values[k] for k in op.inputs)
        if x.shape != mask.shape:
            raise AutoparError(
                f"micro-batching: {op} selects from {x.label} {list(x.shape)} with a mask of shape {list(mask.shape)}"
            )
        found.append(MaskedMean(op.index, mean.index, mean_grad.index, select_grad.index, seeds[0].index))
    return found


def _grad_reading(graph: ProgramGraph, users: list[int], name: str) -> OpNode:
    for user in users:
        if graph.ops[user].name == name:
            return graph.ops[user]
    raise AutoparError(f"micro-batching: no {name} differentiates the masked mean (its backward is not Paddle's own)")


def deferred_means(program: Any, graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> DeferredMeans | None:
    """``program`` with each masked mean that is the loss divided once per step (module
    docstring); None when there is none."""
    import paddle

    found = masked_means(graph)
    if not found:
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    erased: set[int] = set()
    losses: dict[int, Any] = {}  # the mean's index -> the op dividing S by C
    placed: dict[int, ProcessMesh] = {}  # op id -> mesh
    first_update = next((op.index for op in graph.ops if op.role is Role.OPTIMIZER), None)
    if first_update is None:
        raise AutoparError(
            f"micro-batching: {graph.ops[found[0].mean]} averages a masked selection, but no optimizer updates from it"
        )
    with paddle.static.program_guard(work):
        for masked in found:
            select = raw[masked.select]
            x, mask = select.operand_source(0), select.operand_source(1)
            mesh = op_meshes.get(masked.mean, op_meshes.get(masked.select))
            paddle.pir.set_insertion_point(raw[masked.mean])
            weight = paddle._C_ops.cast(mask, x.dtype)
            total = paddle._C_ops.sum(paddle._C_ops.multiply(x, weight), [], None, False)
            count = paddle._C_ops.sum(weight, [], None, False)
            _place(placed, mesh, weight, total, count)
            raw[masked.select_grad].result(0).replace_all_uses_with(weight)  # d S / d x: the mask
            paddle.pir.set_insertion_point(raw[first_update])
            loss = paddle._C_ops.divide(total, count)
            _mark_update(loss)
            _place(placed, mesh, loss)
            raw[masked.mean].result(0).replace_all_uses_with(loss)
            losses[masked.mean] = loss.get_defining_op()
            _divide_gradients(graph, raw, count, mesh, op_meshes, placed)
            erased.update(masked.ops)
        paddle.pir.reset_insertion_point_to_end()
    for index in sorted(erased, reverse=True):
        raw[index].erase()
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    positions = tuple(
        where[losses[i].id()] if i in losses else None if i in erased else where[op.id()] for i, op in enumerate(raw)
    )  # the user's loss Value stands for the update's S / C
    labels = tuple(f"the loss {graph.values[graph.ops[m.mean].outputs[0]].label}" for m in found)
    return DeferredMeans(work, positions, {where[i]: m for i, m in placed.items()}, labels)


def _divide_gradients(
    graph: ProgramGraph, raw: list[Any], count: Any, mesh: ProcessMesh | None, op_meshes: Mapping[int, ProcessMesh],
    placed: dict[int, ProcessMesh],
) -> None:  # fmt: skip
    """Every gradient an optimizer op reads, divided by ``count`` (copied once to each other
    stage mesh dividing by it), at the insertion point; the optimizer ops read the quotients."""
    import paddle

    divided: dict[ValueKey, Any] = {}
    counts: dict[ProcessMesh | None, Any] = {mesh: count}
    for op in graph.ops:
        if op.role is not Role.OPTIMIZER or op.name in VECTOR_OPS:
            continue
        for slot, key in enumerate(op.inputs):
            if key is None or graph.ops[key[0]].role is not Role.BACKWARD:
                continue
            if key not in divided:
                producer = graph.ops[key[0]]
                where = (
                    op_meshes.get(producer.forward_op) if producer.forward_op is not None else op_meshes.get(op.index)
                )
                if where not in counts:
                    counts[where] = paddle._C_ops.assign(count)
                    _mark_update(counts[where])
                    _place(placed, where, counts[where])
                divided[key] = paddle._C_ops.divide(raw[key[0]].result(key[1]), counts[where])
                _mark_update(divided[key])
                _place(placed, where, divided[key])
            site, operand = op.sites[slot]
            raw[site].operand(operand).set_source(divided[key])


def _mark_update(value: Any) -> None:
    value.get_defining_op().set_int_attr("op_role", UPDATE_ROLE)


def _place(placed: dict[int, ProcessMesh], mesh: ProcessMesh | None, *values: Any) -> None:
    if mesh is not None:
        for value in values:
            placed[value.get_defining_op().id()] = mesh
