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
The all_gather plan's dK / dV were pending sums over the dim (each rank's contribution to every
block); the ring's are complete for one block, handed on as that block among zeros (a valid
pending sum), and a reduce_scatter the planner put after them whose pieces are exactly those
blocks becomes the local slice it is (:func:`_sliced_sums`). The gathers of K and V the core
read are erased with the ops no one reads any more.

Dropout: each rank draws the serial mask over the global shape with the op's seed (as
:mod:`.dropout_slicing` does) and keeps its rows. Refused by name: a core whose q is not split by
sequence over the dim, whose K / V are, a sequence not divisible by the dim's size, a middle that
is not affine in the scores (:func:`autopar.attention_cores.affine_middle`), pipelines,
micro-batching and recompute (not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from autopar.attention_cores import TRIANGLES, AffineMiddle, AttentionCore, affine_middle, attention_cores
from autopar.causes import in_layer, layer_of
from autopar.collective import CollectiveKey
from autopar.cost_model.planner import ReshardStep, group_at, plan_ring_shift
from autopar.dist_attr import DistAttr, shard_bounds
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.reshard_emission import emit_step, replace_uses
from autopar.propagation import SiteKind

NEGATIVE = -1e30  # the running max's start: finite, so exp(m - m') of a fully masked first block is 0, not nan


@dataclass(frozen=True, slots=True)
class BlockValue:
    """What a permute moves, as emit_step reads a serial value: a label, the global shape, the dtype."""

    label: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RingCore:
    """One core's ring, planned once: the core, its middle, the group size, the key length and
    the ring shifts (``[k|v]`` forward, ``[k|v|dk|dv]`` and ``[dk|dv]`` backward, ``[k|v]`` of a
    recomputation) with the values they move."""

    core: AttentionCore
    middle: AffineMiddle
    mesh_dim: int
    parts: int
    keys: int  # the global sequence length of K and V
    shifts: tuple[ReshardStep, ReshardStep, ReshardStep, ReshardStep]  # [k|v], [k|v|dk|dv], [dk|dv], recomputed [k|v]
    values: tuple[BlockValue, BlockValue, BlockValue]
    reason: str
    first_grad: int | None  # the matmul_grad ops of the core's backward (None: no backward)
    second_grad: int | None
    split_grads: frozenset[ValueKey] = frozenset()  # dK / dV reduce_scattered by sequence right after their grad op
    recomputed: tuple[int, int] | None = None  # recompute: the backward's clones of the two matmuls


@dataclass(frozen=True)
class RingPlan:
    """RingAttention's result: each attention core's ring, program order."""

    cores: tuple[RingCore, ...]


@dataclass(frozen=True)
class RingAttention(Pass):
    """Every attention core of the program as a ring over ``mesh_dim`` (module docstring)."""

    name: ClassVar[str] = "ring_attention"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    emit_requires: ClassVar[tuple[str, ...]] = ("partitioned", "comm-inserted")
    emit_ensures: ClassVar[str] = "ring-attention"
    mesh_dim: str = "sep"

    def plan(self, state: CompileState) -> RingPlan:
        if self.mesh_dim not in state.mesh.dim_names:
            raise AutoparError(f"ring attention over {self.mesh_dim!r}: {state.mesh} has no such dim")
        dim = state.mesh.dim_names.index(self.mesh_dim)
        if state.mesh.shape[dim] == 1:
            return RingPlan(())
        cores = attention_cores(state.graph)
        _refuse_unbuilt(state, cores, self.mesh_dim)
        return RingPlan(tuple(_plan_core(state, core, self.mesh_dim) for core in cores))

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        plan = state.result(RingPlan)
        with paddle.static.program_guard(rp.program):
            for ring in plan.cores if plan is not None else ():
                if rp.rank in state.propagation.op_meshes.get(ring.core.first, state.mesh).ranks:
                    RankRing(state, rp, ring).emit()
            paddle.pir.reset_insertion_point_to_end()


def _refuse_unbuilt(state: CompileState, cores: tuple[AttentionCore, ...], name: str) -> None:
    if not cores:
        return


def _plan_core(state: CompileState, core: AttentionCore, name: str) -> RingCore:
    graph, results = state.graph, state.propagation.op_results
    q_attr, k_attr = results[core.first].inputs[0], results[core.first].inputs[1]
    mesh = q_attr.mesh  # (a pipeline stage's sub-mesh keeps the dim names)
    if name not in mesh.dim_names:
        raise AutoparError(f"ring attention over {name}: {core} runs on {mesh}, which has no dim {name!r}")
    dim = mesh.dim_names.index(name)
    parts = mesh.shape[dim]
    v_attr = results[core.second].inputs[1]
    k_shape, v_shape = graph.values[core.k].shape, graph.values[core.v].shape
    seq = len(k_shape) - 2
    if q_attr.mapping[len(graph.values[core.q].shape) - 2] != (dim,):
        raise AutoparError(
            f"ring attention over {name}: {core} reads q {graph.values[core.q].label} as {q_attr}, not split by "
            f"sequence (dim -2) over {name}: split the feeds' sequence dim over {name}"
        )
    for what, attr in (("k", k_attr), ("v", v_attr)):
        if dim in attr.sharded_mesh_dims() or attr.partial:
            raise AutoparError(f"ring attention over {name}: {core} reads {what} as {attr}; the ring needs it whole over {name}")
    if k_attr.mapping[:-1] != v_attr.mapping[:-1] or k_shape[:-1] != v_shape[:-1]:
        raise AutoparError(f"ring attention over {name}: {core} reads k as {k_attr} {list(k_shape)} and v as {v_attr} {list(v_shape)}")
    keys = k_shape[seq]
    if keys % parts or graph.values[core.q].shape[-2] % parts:
        raise AutoparError(
            f"ring attention over {name}: {core} has a sequence of {keys} keys and "
            f"{graph.values[core.q].shape[-2]} queries, not divisible by {parts} ranks"
        )
    middle = affine_middle(graph, core)
    widths = (k_shape[-1] + v_shape[-1], 2 * (k_shape[-1] + v_shape[-1]), k_shape[-1] + v_shape[-1])
    dtype = graph.values[core.k].dtype
    values = tuple(BlockValue(f"{graph.values[core.k].label}.{what}", (*k_shape[:-1], w), dtype)
                   for what, w in zip(("kv", "kv_grads", "grads"), widths))  # fmt: skip
    grads = {state.graph.ops[i].forward_op: i for i in core.backward}
    clones = {state.graph.ops[i].recomputes: i for i in core.recomputed}
    # each ring moves K / V blocks split on the other dims as its matmuls read K: the forward, the
    # backward (which may split heads further), a recomputation
    reads = [k_attr, *(results[op].inputs[1] for op in (grads.get(core.first), clones.get(core.first)) if op is not None)]
    blocks = [DistAttr.of(mesh, tuple((dim,) if t == seq else dims for t, dims in enumerate(attr.mapping))) for attr in reads]
    backward = blocks[1] if core.first in grads else blocks[0]
    pairs = ((blocks[0], values[0]), (backward, values[1]), (backward, values[2]), (blocks[-1], values[0]))
    shifts = tuple(plan_ring_shift(block, dim, value.shape, dtype, state.cluster) for block, value in pairs)
    reason = in_layer("ring attention", layer_of(graph, core.first)) + (
        f": {core} passes its key / value blocks one rank on over {name} instead of gathering them"
    )
    first_grad, second_grad = grads.get(core.first), grads.get(core.second)
    _check_backward_placements(state, core, first_grad, second_grad, name)
    grad_keys = [graph.ops[i].outputs[1] for i in (first_grad, second_grad) if i is not None]
    return RingCore(
        core, middle, dim, parts, keys, shifts, values, reason,
        first_grad, second_grad,
        frozenset(k for k in grad_keys if k is not None and _scattered(state, k, dim)), _recomputed(state, core),
    )  # fmt: skip


def _recomputed(state: CompileState, core: AttentionCore) -> tuple[int, int] | None:
    """The backward's clones of the core's two matmuls (recompute)."""
    clones = {state.graph.ops[i].recomputes: i for i in core.recomputed}
    if not clones:
        return None
    if core.first not in clones or core.second not in clones:
        raise AutoparError(f"ring attention: recompute re-runs part of {core} only (ops {sorted(clones)})")
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
    """Whether ``key`` (a K / V gradient, a pending sum over ``dim``) is reduce_scattered by
    sequence over ``dim`` right after its producer, and by that one step only (the ring's
    block is then exactly what the step makes)."""
    seq = len(state.graph.values[key].shape) - 2
    for planned in state.reshards:
        need = planned.need
        if need.value == key and need.site.kind is SiteKind.AFTER_PRODUCER:
            steps = planned.plan.steps
            return (
                len(steps) == 1 and tuple(steps[0].mesh_dims) == (dim,) and dim in steps[0].src.partial_dims
                and steps[0].dst.mapping[seq] == (dim,) and not steps[0].dst.partial
            )  # fmt: skip
    return False


class RankRing:
    """One core's ring emitted into one rank's program (module docstring)."""

    def __init__(self, state: CompileState, rp: RankProgram, ring: RingCore) -> None:
        self.state, self.rp, self.ring, self.core = state, rp, ring, ring.core
        group = group_at(ring.shifts[0].src.mesh, rp.rank, (ring.mesh_dim,))
        self.position, self.parts = group.index(rp.rank), ring.parts
        self.block = ring.keys // ring.parts
        queries = state.graph.values[ring.core.q].shape[-2]
        self.first_row = shard_bounds(queries, ring.parts, self.position)[0]
        self.count = 0
        self.handed: set[ValueKey] = set()  # K / V gradients handed on in place of their reduce_scatter

    # ---- the whole core ------------------------------------------------------------------
    def emit(self) -> None:
        import paddle

        rp, core = self.rp, self.core
        second = rp.ops[core.second]
        self.q = rp.ops[core.first].operand_source(0)
        k, v = self._block(core.first, 1), self._block(core.second, 1)
        self.widths = (k.shape[-1], v.shape[-1])
        paddle.pir.set_insertion_point(second)
        self.drops = self._dropout_rows()
        out, lse = self._forward(self.q, paddle.concat([k, v], axis=-1))
        replace_uses(second.result(0), out)
        rp.replaced[core.output] = out
        if self.ring.recomputed is not None:  # recompute: the ring runs again where the backward re-runs the core
            out, lse = self._recomputed()
        grads = self._backward(out, lse) if self.ring.first_grad is not None else {}
        for key, new in grads.items():
            rp.replaced[key] = new
            if key not in self.handed:  # (a block handed on in place of its reduce_scatter: that one is erased)
                replace_uses(rp.ops[key[0]].result(key[1]), new)
        self._erase()

    def _recomputed(self) -> tuple[Any, Any]:
        """The forward ring again on the recomputed q, K, V, in place of the backward's clone of
        the core (its output replaced): its output and log-sum-exp, for the backward ring."""
        import paddle

        rp = self.rp
        first, second = self.ring.recomputed
        q, k, v = rp.ops[first].operand_source(0), self._block(first, 1), self._block(second, 1)
        paddle.pir.set_insertion_point(rp.ops[second])
        out, lse = self._forward(q, paddle.concat([k, v], axis=-1), 3)
        replace_uses(rp.ops[second].result(0), out)
        return out, lse

    def _block(self, op: int, slot: int) -> Any:
        """This rank's block of what ``op`` reads at ``slot`` (q, K or V), its sequence split over
        the ring's dim, the other dims as ``op`` reads them: cut from the value as its producer
        placed it (K and V are then never gathered; the reshards ``op``'s read planned die)."""
        key = self.state.graph.ops[op].inputs[slot]
        read = self.state.propagation.op_results[op].inputs[slot]
        seq = read.ndim - 2
        want = DistAttr.of(read.mesh, tuple((self.ring.mesh_dim,) if t == seq else d for t, d in enumerate(read.mapping)))
        shape = self.state.graph.values[key].shape
        return self._rebox(self.rp.current(key), self.state.propagation.dist(key), want, shape, f"input {slot} of {self.state.graph.ops[op]}", len(shape))

    def _columns(self, x: Any, j: int, what: str) -> Any:
        """Block ``j`` of ``x``'s last (key) dim; ``x`` as it is when it broadcasts over it."""
        import paddle

        if len(x.shape) == 0 or x.shape[-1] == 1:
            return x
        if x.shape[-1] != self.ring.keys:
            raise AutoparError(
                f"ring attention: {what} of {self.core} has {x.shape[-1]} columns, not the {self.ring.keys} keys (or 1)"
            )
        lo, hi = j * self.block, (j + 1) * self.block
        return paddle._C_ops.slice(x, [len(x.shape) - 1], [lo], [hi], [1], [])

    # ---- pieces of a step ------------------------------------------------------------------
    def _scores(self, q: Any, k: Any, j: int) -> tuple[Any, dict[ValueKey, Any]]:
        """``middle(q @ k^T)`` for key block ``j``: each middle op cloned on the block (its other
        operands cut to the block's columns); also every value the clones made."""
        import paddle

        made: dict[ValueKey, Any] = {self.core.scores: paddle._C_ops.matmul(q, k, False, True)}
        graph = self.state.graph
        for index in self.core.middle:
            node, op = graph.ops[index], self.rp.ops[index]
            mapping = paddle.pir.IrMapping()
            for slot, key in enumerate(node.inputs):
                operand = op.operand_source(slot)
                if key is None or mapping.has(operand):
                    continue
                what = f"operand {graph.values[key].label} of {node}"
                mapping.add(operand, made[key] if key in made else self._columns(operand, j, what))
            clone = op.clone(mapping, paddle.pir.CloneOptions(False, True, True))
            if node.name in TRIANGLES:  # the block's diagonal: counted from its corner at (first row, column j * n)
                diagonal = int(node.attrs.get("diagonal", 0)) + self.first_row - j * self.block
                clone.set_int_attr("diagonal", diagonal)
            # (every middle op is elementwise: its block's shape is its operands' broadcast)
            shape = list(np.broadcast_shapes(*(tuple(clone.operand_source(i).shape) for i in range(clone.num_operands()))))
            for r, key in enumerate(node.outputs):
                if key is None:
                    continue
                result = clone.result(r)
                result.set_type(paddle.pir.create_shaped_type(op.result(r).type(), shape))
                made[key] = result
        return made[graph.ops[self.core.softmax].inputs[0]], made

    def _dropout_rows(self) -> Any:
        """The rank's rows of the serial dropout multiplier (mask / (1 - p)), all key columns; None
        without dropout. Under micro-batching the mask is drawn over the whole step and this
        micro-batch's block cut out (:mod:`.dropout_slicing`, whose scheme this follows)."""
        import paddle

        index = self.core.dropout
        if index is None:
            return None
        node, op, micro = self.state.graph.ops[index], self.rp.ops[index], self.state.micro
        value = self.state.graph.values[node.inputs[0]]
        shape = list(value.shape)  # one micro-batch's
        dim = micro.split_dim(node.inputs[0]) if micro is not None and node.inputs[0] in micro.placements else None
        x, seed, p = (op.operand_source(i) for i in range(3))
        ones = paddle._C_ops.full(list(value.program_shape) if dim is not None else shape, 1.0, x.dtype, paddle.CPUPlace())
        attrs = node.attrs
        whole = paddle._C_ops.dropout(
            ones, seed if seed.initialized() else None, p, bool(attrs.get("is_test", False)), attrs["mode"], attrs["seed"], attrs["fix_seed"]
        )
        if dim is not None:
            whole = self._micro_batch_block(whole, dim, shape)
        box = self.state.propagation.op_results[index].inputs[0].local_slices(shape, self.rp.rank)
        axes = [t for t, s in enumerate(box) if (s.start, s.stop) != (0, shape[t])]
        if len(shape) - 1 in axes:
            raise AutoparError(f"ring attention: the dropout of {self.core} is split by key columns")
        if not axes:
            return whole
        return paddle._C_ops.slice(whole, axes, [box[t].start for t in axes], [box[t].stop for t in axes], [1] * len(axes), [])

    def _micro_batch_block(self, whole: Any, dim: int, shape: list[int]) -> Any:
        """Rows ``[k * n, (k + 1) * n)`` of ``whole`` along ``dim`` for micro-batch ``k`` (fed)."""
        import paddle

        from autopar.feed_names import MICRO_BATCH_FEED

        if whole.shape[dim] != shape[dim] * self.state.micro.count:
            raise AutoparError(f"ring attention: the dropout of {self.core} is not {self.state.micro.count} micro-batches along dim {dim}")
        fed = next((o.result(0) for o in self.rp.program.global_block().ops
                    if o.name() == "pd_op.data" and o.attrs().get("name") == MICRO_BATCH_FEED), None)  # fmt: skip
        if fed is None:  # made first in the program: dropout slicing, after this pass, reads it before this core too
            paddle.pir.set_insertion_point(self.rp.program.global_block().ops[0])
            fed = paddle._pir_ops.data(MICRO_BATCH_FEED, [1], paddle.int64, paddle.CPUPlace())
            paddle.pir.set_insertion_point(self.rp.ops[self.core.second])
        rows = float(shape[dim])
        start, stop = paddle._C_ops.scale(fed, rows, 0.0, True), paddle._C_ops.scale(fed, rows, rows, True)
        block = paddle._C_ops.slice(whole, [dim], start, stop, [-1], [])
        block.set_type(paddle.pir.create_shaped_type(block.type(), shape))
        return block

    def _shift(self, x: Any, which: int) -> Any:
        """``x`` one rank on around the ring (a recorded permute)."""
        key = CollectiveKey("ring", self.core.first, self.count)
        self.count += 1
        step = self.ring.shifts[which]
        return emit_step(self.state, self.rp, step, x, self.ring.values[which % 3], self.ring.reason, key)

    def _split(self, x: Any, widths: tuple[int, ...]) -> list[Any]:
        import paddle

        out, start = [], 0
        for w in widths:
            out.append(paddle._C_ops.slice(x, [len(x.shape) - 1], [start], [start + w], [1], []))
            start += w
        return out

    # ---- forward -------------------------------------------------------------------------
    def _forward(self, q: Any, kv: Any, shift: int = 0) -> tuple[Any, Any]:
        """The ring's forward from this rank's q and ``[k | v]`` blocks: the output and log-sum-exp
        (``shift``: which planned ring shift moves the blocks)."""
        import paddle

        C = paddle._C_ops
        rows = [*q.shape[:-1], 1]
        m = C.full(rows, NEGATIVE, q.dtype, paddle.CPUPlace())
        total = C.full(rows, 0.0, q.dtype, paddle.CPUPlace())
        acc = C.full([*q.shape[:-1], self.widths[1]], 0.0, q.dtype, paddle.CPUPlace())
        for s in range(self.parts):
            j = (self.position - s) % self.parts
            k, v = self._split(kv, self.widths)
            scores, _ = self._scores(q, k, j)
            new_m = C.maximum(m, C.max(scores, [-1], True))
            alpha = C.exp(C.subtract(m, new_m))
            p = C.exp(C.subtract(scores, new_m))
            total = C.add(C.multiply(total, alpha), C.sum(p, [-1], None, True))
            if self.drops is not None:
                p = C.multiply(p, self._columns(self.drops, j, "the dropout"))
            acc = C.add(C.multiply(acc, alpha), C.matmul(p, v, False, False))
            m = new_m
            if s < self.parts - 1:
                kv = self._shift(kv, shift)
        return C.divide(acc, total), C.add(m, C.log(total))

    # ---- backward ------------------------------------------------------------------------
    def _backward(self, out: Any, lse: Any) -> dict[ValueKey, Any]:
        import paddle

        C, graph, rp = paddle._C_ops, self.state.graph, self.rp
        first, second = graph.ops[self.ring.first_grad], graph.ops[self.ring.second_grad]
        grad_out = rp.ops[second.index].operand_source(2)
        # q, K, V as the grads read them: the forward's, or under recompute their recomputed copies
        q, k, v = self._block(first.index, 0), self._block(first.index, 1), self._block(second.index, 1)
        paddle.pir.set_insertion_point(rp.ops[min(self.core.backward)])  # its outputs have readers among the chain's grads
        # the backward may split batch / heads further than the forward (heads over mp): cut what it keeps to match
        results, want = self.state.propagation.op_results, self.state.propagation.op_results[second.index].inputs[2]
        made = results[self.ring.recomputed[1] if self.ring.recomputed is not None else self.core.second].outputs[0]
        shape = graph.values[self.core.output].shape
        out, lse = (self._rebox(x, made, want, shape, what) for x, what in ((out, "output"), (lse, "log-sum-exp")))
        drops = self.drops
        if drops is not None:
            drop_shape = graph.values[graph.ops[self.core.dropout].inputs[0]].shape
            drops = self._rebox(drops, results[self.core.dropout].inputs[0], want, drop_shape, "dropout mask")
        drow = C.sum(C.multiply(grad_out, out), [-1], None, True)
        dq = C.full(list(q.shape), 0.0, q.dtype, paddle.CPUPlace())
        zeros = C.full([*k.shape[:-1], sum(self.widths)], 0.0, q.dtype, paddle.CPUPlace())
        bundle = C.concat([k, v, zeros], -1)
        widths = (*self.widths, *self.widths)
        for s in range(self.parts):
            j = (self.position - s) % self.parts
            k, v, dk, dv = self._split(bundle, widths)
            scores, made = self._scores(q, k, j)
            p = C.exp(C.subtract(scores, lse))
            dp = C.matmul(grad_out, v, False, True)
            kept = p
            if drops is not None:
                block = self._columns(drops, j, "the dropout")
                kept, dp = C.multiply(p, block), C.multiply(dp, block)
            ds = self._through_middle(C.multiply(p, C.subtract(dp, drow)), made, j)
            dq = C.add(dq, C.matmul(ds, k, False, False))
            dk = C.add(dk, C.matmul(ds, q, True, False))
            dv = C.add(dv, C.matmul(kept, grad_out, True, False))
            if s < self.parts - 1:
                bundle = self._shift(C.concat([k, v, dk, dv], -1), 1)
        dk, dv = self._split(self._shift(C.concat([dk, dv], -1), 2), self.widths)
        grads = {}
        for key, new in ((first.outputs[0], dq), (first.outputs[1], dk), (second.outputs[1], dv)):
            if key is not None:
                grads[key] = new if key == first.outputs[0] else self._gradient(key, new)
        return grads

    def _gradient(self, key: ValueKey, block: Any) -> Any:
        """The ring's block of a K / V gradient as the program's readers take it: in place of the
        reduce_scatter after the grad op (which made exactly this block), or else as the pending
        sum the grad op made (:meth:`_pending`)."""
        if key in self.ring.split_grads and key in self.rp.final:
            replace_uses(self.rp.final[key], block)
            self.rp.final[key] = block
            self.handed.add(key)
            return block
        return self._pending(block)

    def _rebox(self, x: Any, have: DistAttr, want: DistAttr, shape: tuple[int, ...], what: str, dims: int = -2) -> Any:
        """``x`` (this rank's piece of a value of global ``shape`` placed as ``have``) cut to its
        piece as ``want`` on its first ``dims`` dims (default: the leading batch / head dims, the
        last two being the ring's); refused where ``want`` is no sub-piece of ``have``."""
        import paddle

        if have.partial:
            raise AutoparError(f"ring attention: {what} of {self.core} is a pending sum {have}")
        held, wanted = have.local_slices(shape, self.rp.rank), want.local_slices(shape, self.rp.rank)
        axes, starts, ends = [], [], []
        for t in range(len(shape))[:dims]:
            h, w = held[t], wanted[t]
            if (h.start, h.stop) == (w.start, w.stop):
                continue
            if not h.start <= w.start <= w.stop <= h.stop:
                raise AutoparError(f"ring attention: the backward of {self.core} reads its {what} as {want}, the forward makes it {have}")
            axes.append(t)
            starts.append(w.start - h.start)
            ends.append(w.stop - h.start)
        return paddle._C_ops.slice(x, axes, starts, ends, [1] * len(axes), []) if axes else x

    def _through_middle(self, ds: Any, made: dict[ValueKey, Any], j: int) -> Any:
        """The softmax input's gradient taken back through the middle to the scores: its scalar,
        and 0 where a ``where`` selected something else."""
        import paddle

        C = paddle._C_ops
        for index, scores_are_x in self.ring.middle.wheres:
            cond_key = self.state.graph.ops[index].inputs[0]
            cond = made.get(cond_key)
            if cond is None:
                cond = self._columns(self.rp.ops[index].operand_source(0), j, f"the condition of {self.state.graph.ops[index]}")
            zero = C.full_like(ds, 0.0, ds.dtype, paddle.CPUPlace())
            ds = C.where(cond, ds, zero) if scores_are_x else C.where(cond, zero, ds)
        return C.scale(ds, self.ring.middle.coefficient, 0.0, True)

    def _pending(self, block: Any) -> Any:
        """This rank's block of a K / V gradient among zeros: the pending sum over the ring's dim
        the all_gather plan's readers expect (each rank's piece is its own block)."""
        import paddle

        seq = len(block.shape) - 2
        lo, hi = shard_bounds(self.ring.keys, self.parts, self.position)
        pieces = []
        for size in (lo, self.ring.keys - hi):
            shape = list(block.shape)
            shape[seq] = size
            pieces.append(paddle._C_ops.full(shape, 0.0, block.dtype, paddle.CPUPlace()) if size else None)
        return paddle._C_ops.concat([x for x in (pieces[0], block, pieces[1]) if x is not None], seq)

    # ---- the serial core's ops, and the gathers no one reads any more ---------------------
    def _erase(self) -> None:
        rp = self.rp
        serial = {op.id() for op in rp.ops if op is not None}
        dropped: list[Any] = []
        for index in sorted((*self.core.backward, *self.core.recomputed, *self.core.ops), reverse=True):
            op = rp.ops[index]
            if op is None:
                continue
            for result in op.results():
                self._erase_readers(result, serial)
                if not result.use_empty():
                    users = ", ".join(user.name() for user in result.all_used_ops())
                    raise AutoparError(f"ring attention: {self.state.graph.ops[index]} of {self.core} is still read by {users}")
            dropped.extend(op.operands_source())
            op.erase()
            rp.ops[index] = None
        while dropped:
            value = dropped.pop()
            if not value.initialized() or not value.use_empty():
                continue
            producer = value.get_defining_op()
            if producer is None or producer.id() in serial or any(not r.use_empty() for r in producer.results()):
                continue
            dropped.extend(producer.operands_source())
            self._forget(producer)
            producer.erase()

    def _erase_readers(self, value: Any, serial: set[int]) -> None:
        """Erase the inserted ops (reshards of the core's values) that read ``value`` and whose
        results no one reads any more, readers of readers first."""
        for user in list(value.all_used_ops()):
            if user.id() in serial:
                continue
            for result in user.results():
                self._erase_readers(result, serial)
            if all(result.use_empty() for result in user.results()):
                self._forget(user)
                user.erase()

    def _forget(self, op: Any) -> None:
        """Drop the records of an inserted op about to be erased (its collective, its result)."""
        rp, ident = self.rp, op.id()
        rp.collectives[:] = [(c, i) for c, i in rp.collectives if i != ident]
        for table in (rp.resharded, rp.final, rp.replaced):
            for key in [k for k, v in table.items() if any(v.is_same(r) for r in op.results())]:
                del table[key]


