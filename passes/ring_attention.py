"""Ring attention: each attention core of a context-parallel program becomes, in every rank's
program, a ring over the context-parallel mesh dim (stage: comm-inserted -> ring-attention;
``Strategy(context_parallel=ContextParallel(method="ring"))``, issue 39).

Propagation keeps q split by sequence (rows) over the dim and reads K and V whole (the
"all_gather" plan: an all_gather of K and of V before the core, a reduce_scatter of dK and dV
after its backward). That is the same math as the ring with other communication, so planning
and propagation stay as they are; here, after reshard emission, each rank's core (found by
:mod:`autopar.attention_cores`) is replaced by the ring, forward and backward. On rank ``i`` of
the group of size ``c`` (sequence blocks of ``n = S / c`` keys), step ``s = 0 .. c-1`` holds
block ``j = (i - s) mod c`` of K and V::

    S_j  = middle(q @ k_j^T)                  # the scale / mask ops, the mask's columns of block j
    m'   = max(m, rowmax S_j);   p = exp(S_j - m')
    l    = l * exp(m - m') + rowsum p
    acc  = acc * exp(m - m') + (p * D_j) @ v_j   # D_j: block (rows i, cols j) of the serial dropout
    out  = acc / l;              lse = m + log l  # (m starts finite: a fully masked block adds 0)

and between steps ``[k_j | v_j]`` moves one rank on (a ``permute``, shift 1): c - 1 permutes a
core. The backward recomputes each block's probabilities from ``lse``::

    Drow = rowsum(dO * out);     P_j = exp(S_j - lse)
    dS_j = a * P_j * ((dO @ v_j^T) * D_j - Drow)  # a: the middle's derivative (its scalar, its wheres)
    dq  += dS_j @ k_j;   dk_j += dS_j^T @ q;   dv_j += (P_j * D_j)^T @ dO

with ``[k_j | v_j | dk_j | dv_j]`` moving on after each step but the last, and ``[dk | dv]`` once
more after it (c permutes): each rank ends with the whole gradient of its own K and V block.
The rewrite :mod:`autopar.rewrites.ring_gradients` placed dK and dV split by sequence, so the
planner reduce_scatters their pending sums right after the grad ops: the ring's blocks are what
those reduce_scatters make, and take their place (:meth:`~autopar.passes.ring_blocks.RankRing._gradient`); where the planner
reduces them elsewhere, each block is handed on among zeros (a valid pending sum). Each rank's
q / K / V block is cut from the value as its producer placed it (:meth:`~autopar.passes.ring_blocks.RankRing._block`), so
the gathers of K and V the plan had die and are erased with every op no one reads any more.

Grouped-query attention: the forward ring moves K and V before ``repeat_kv`` and repeats each
block where it arrives (n_heads / n_kv_heads times fewer bytes). Each ring moves blocks split on
the other dims as its matmuls read them: the backward may split
heads further than the forward (then the forward's output, log-sum-exp and dropout rows are cut
to match). Recompute re-runs the core in the backward: the ring runs again there, and the
backward ring reads the recomputed output and log-sum-exp (a recompute that re-runs only part of
the core, selected by op type, reads kept forward values: the forward ring's output stands in). Pipelines: each stage rings its own
cores, per micro-batch. Dropout: each rank draws the serial mask over the global shape with the
op's seed (under micro-batching the whole step's, then the micro-batch's block), as
:mod:`.dropout_slicing` does, and keeps its rows. Refused by name: a core whose q is not split by
sequence over the dim, whose K / V are split over it, a sequence not divisible by the dim's
size, a middle that is not affine in the scores (:func:`autopar.attention_cores.affine_middle`),
a backward splitting batch / heads differently from one of its values to the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from autopar.attention_cores import AttentionCore, affine_middle, attention_cores, repeated_from
from autopar.causes import in_layer, layer_of
from autopar.cost_model.planner import ReshardStep, plan_ring_shift
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.results import BlockValue, RingCore, RingPlan
from autopar.passes.ring_blocks import RankRing
from autopar.propagation import SiteKind


@dataclass(frozen=True)
class RingAttention(Pass):
    """Every attention core of the program as a ring over ``mesh_dim`` (module docstring)."""

    name: ClassVar[str] = "ring_attention"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    emit_requires: ClassVar[tuple[str, ...]] = ("partitioned", "comm-inserted")
    emit_ensures: ClassVar[str] = "ring-attention"
    mesh_dim: str = "sep"

    def plan(self, state: CompileState) -> RingPlan:
        dim = state.mesh.dim_names.index(self.mesh_dim)
        if state.mesh.shape[dim] == 1:
            return RingPlan(())
        return RingPlan(tuple(_plan_core(state, core, self.mesh_dim) for core in attention_cores(state.graph)))

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        plan = state.result(RingPlan)
        with paddle.static.program_guard(rp.program):
            for ring in plan.cores if plan is not None else ():
                if rp.rank in state.propagation.op_meshes.get(ring.core.first, state.mesh).ranks:
                    RankRing(state, rp, ring).emit()
            paddle.pir.reset_insertion_point_to_end()


def _plan_core(state: CompileState, core: AttentionCore, name: str) -> RingCore:
    graph, results = state.graph, state.propagation.op_results
    mesh = results[core.first].inputs[0].mesh  # (a pipeline stage's sub-mesh keeps the dim names)
    if name not in mesh.dim_names:
        raise AutoparError(f"ring attention over {name}: {core} runs on {mesh}, which has no dim {name!r}")
    dim = mesh.dim_names.index(name)
    parts, keys = mesh.shape[dim], graph.values[core.k].shape[-2]
    _check_reads(state, core, dim, name)
    middle = affine_middle(graph, core)
    grads = {graph.ops[i].forward_op: i for i in core.backward}
    first_grad, second_grad = grads.get(core.first), grads.get(core.second)
    _check_backward_placements(state, core, first_grad, second_grad, name)
    unrepeated = _unrepeated(state, core, dim)
    shifts, values = _ring_shifts(state, core, dim, first_grad, unrepeated)
    reason = in_layer("ring attention", layer_of(graph, core.first)) + (
        f": {core} passes its key / value blocks one rank on over {name} instead of gathering them"
    )
    grad_keys = [graph.ops[i].outputs[1] for i in (first_grad, second_grad) if i is not None]
    return RingCore(
        core, middle, dim, parts, keys, shifts, values, reason,
        first_grad, second_grad,
        frozenset(k for k in grad_keys if k is not None and _scattered(state, k, dim)), _recomputed(state, core),
        unrepeated,
    )  # fmt: skip


def _check_reads(state: CompileState, core: AttentionCore, dim: int, name: str) -> None:
    """q split by sequence over ``dim``, K and V whole over it and split alike elsewhere, a
    sequence the ring's ranks divide: else refused by name."""
    graph, results = state.graph, state.propagation.op_results
    q_attr, k_attr, v_attr = results[core.first].inputs[0], results[core.first].inputs[1], results[core.second].inputs[1]
    q_shape, k_shape, v_shape = (graph.values[key].shape for key in (core.q, core.k, core.v))
    parts = q_attr.mesh.shape[dim]
    if q_attr.mapping[len(q_shape) - 2] != (dim,):
        raise AutoparError(
            f"ring attention over {name}: {core} reads q {graph.values[core.q].label} as {q_attr}, not split by "
            f"sequence (dim -2) over {name}: split the feeds' sequence dim over {name}"
        )
    for what, attr in (("k", k_attr), ("v", v_attr)):
        if dim in attr.sharded_mesh_dims() or attr.partial:
            raise AutoparError(f"ring attention over {name}: {core} reads {what} as {attr}; the ring needs it whole over {name}")
    if k_attr.mapping[:-1] != v_attr.mapping[:-1] or k_shape[:-1] != v_shape[:-1]:
        raise AutoparError(f"ring attention over {name}: {core} reads k as {k_attr} {list(k_shape)} and v as {v_attr} {list(v_shape)}")
    if k_shape[-2] % parts or q_shape[-2] % parts:
        raise AutoparError(
            f"ring attention over {name}: {core} has a sequence of {k_shape[-2]} keys and "
            f"{q_shape[-2]} queries, not divisible by {parts} ranks"
        )


def _ring_shifts(
    state: CompileState, core: AttentionCore, dim: int, first_grad: int | None, unrepeated: tuple | None
) -> tuple[tuple[ReshardStep, ...], tuple[BlockValue, ...]]:  # fmt: skip
    """The planned shifts of the core's rings and the values they move: ``[k|v]`` forward (before
    ``repeat_kv`` when ``unrepeated``), ``[k|v|dk|dv]`` and ``[dk|dv]`` backward, ``[k|v]`` of a
    recomputation; each split on the other dims as its matmuls read K (the backward may split
    heads further than the forward)."""
    graph, results = state.graph, state.propagation.op_results
    k_shape, v_shape = graph.values[core.k].shape, graph.values[core.v].shape
    width, dtype, seq, label = k_shape[-1] + v_shape[-1], graph.values[core.k].dtype, len(k_shape) - 2, graph.values[core.k].label
    clone = next((i for i in core.recomputed if graph.ops[i].recomputes == core.first), None)
    reads = [results[op].inputs[1] if op is not None else None for op in (core.first, first_grad, clone)]
    blocks = [_split_over(attr, seq, dim) if attr else None for attr in reads]
    forward, backward, recomputed = blocks[0], blocks[1] or blocks[0], blocks[2] or blocks[0]
    kv = BlockValue(f"{label}.kv", (*k_shape[:-1], width), dtype)
    if unrepeated is not None:  # [B, S, Hkv, Dk + Dv], split as the un-repeated K is, its sequence (dim 1) over the ring
        k0 = graph.values[unrepeated[0]]
        kv = BlockValue(f"{k0.label}.kv", (*k0.shape[:-1], width), dtype)
        forward = _split_over(state.propagation.dist(unrepeated[0]), 1, dim)
    values = (kv, BlockValue(f"{label}.kv_grads", (*k_shape[:-1], 2 * width), dtype),
              BlockValue(f"{label}.grads", (*k_shape[:-1], width), dtype), BlockValue(f"{label}.kv", (*k_shape[:-1], width), dtype))  # fmt: skip
    pairs = zip((forward, backward, backward, recomputed), values)
    return tuple(plan_ring_shift(block, dim, value.shape, dtype, state.cluster) for block, value in pairs), values


def _split_over(attr: DistAttr, seq: int, dim: int) -> DistAttr:
    """``attr`` with its tensor dim ``seq`` split over mesh dim ``dim`` (a ring's block)."""
    return DistAttr.of(attr.mesh, tuple((dim,) if t == seq else d for t, d in enumerate(attr.mapping)))


def _unrepeated(state: CompileState, core: AttentionCore, dim: int) -> tuple[ValueKey, ValueKey, int] | None:
    """Grouped-query attention: K and V before their ``repeat_kv`` and the repeat count, when both
    are repeated alike and placed so each rank repeats its own block into the heads its matmul
    reads (batch and heads split as the read K, the sequence whole or over the ring); else None."""
    graph, prop = state.graph, state.propagation
    found = [repeated_from(graph, key) for key in (core.k, core.v)]
    if None in found or found[0][1] != found[1][1]:
        return None
    (k0, rep), (v0, _) = found
    read = prop.op_results[core.first].inputs[1]  # [B, H, S, D]
    heads = math.prod(read.mesh.shape[d] for d in read.mapping[1])
    for key in (k0, v0):
        attr = prop.dist(key)  # [B, S, Hkv, D]
        if attr.partial or attr.mapping[1] not in ((), (dim,)) or graph.values[key].shape[2] % heads:
            return None
        if (attr.mapping[0], attr.mapping[2], attr.mapping[3]) != (read.mapping[0], read.mapping[1], ()):
            return None
    return k0, v0, rep


def _recomputed(state: CompileState, core: AttentionCore) -> tuple[int, int] | None:
    """The backward's clones of the core's two matmuls, when recompute re-runs the whole core."""
    clones = {state.graph.ops[i].recomputes: i for i in core.recomputed}
    if core.first not in clones or core.second not in clones:
        return None  # (a part of the core re-run: its clones read kept forward values; the forward's output stands in)
    return clones[core.first], clones[core.second]


def _check_backward_placements(state: CompileState, core: AttentionCore, first: int | None, second: int | None, name: str) -> None:
    """The backward ring runs every block on one batch / head split: the grads of the two matmuls
    must read and make their values split alike on those dims (the rank holds one piece of each)."""
    if first is None or second is None:
        return
    results = state.propagation.op_results
    attrs = [*results[first].inputs, *results[second].inputs, *results[first].outputs, results[second].outputs[1]]
    leading = {tuple(attr.mapping[:-2]) for attr in attrs if attr is not None}
    if len(leading) > 1:
        splits = ", ".join(sorted(str(attr) for attr in {a for a in attrs if a is not None}))
        raise AutoparError(
            f"ring attention over {name}: the backward of {core} splits batch / heads differently from one value to "
            f"the next ({splits}); the ring needs one split for them all"
        )


def _scattered(state: CompileState, key: ValueKey, dim: int) -> bool:
    """Whether ``key`` (a K / V gradient, a pending sum over ``dim``) is reduced to its sequence
    blocks over ``dim`` right after its producer, and only that (a reduce_scatter, or on small
    tensors an all_reduce and a slice): the ring's block is then exactly what the reshard makes."""
    seq = len(state.graph.values[key].shape) - 2
    for planned in state.reshards:
        need = planned.need
        if need.value == key and need.site.kind is SiteKind.AFTER_PRODUCER and planned.plan.steps:
            src, dst = planned.plan.steps[0].src, planned.plan.steps[-1].dst
            others = [t for t in range(len(src.mapping)) if t != seq]
            return (
                set(src.partial_dims) == {dim} and not dst.partial and not src.mapping[seq] and dst.mapping[seq] == (dim,)
                and all(src.mapping[t] == dst.mapping[t] for t in others)
            )  # fmt: skip
    return False
