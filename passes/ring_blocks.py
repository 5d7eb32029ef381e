"""Ring attention's emission: one attention core's ring, forward and backward, in one rank's
program (stage: comm-inserted -> ring-attention; planned by :mod:`.ring_attention`, whose
docstring gives the math). Each block's scores are the core's own middle ops cloned on the block;
K / V blocks move by recorded ``permute`` collectives; the serial core, its backward and the
reshards only they read are erased.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autopar.attention_cores import TRIANGLES
from autopar.collective import CollectiveKey
from autopar.cost_model.planner import group_at
from autopar.dist_attr import DistAttr, shard_bounds
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.passes.base import CompileState, RankProgram
from autopar.passes.dropout_slicing import in_zigzag_order
from autopar.passes.lowered_ops import op_site
from autopar.passes.reshard_emission import emit_step, replace_uses
from autopar.passes.results import RingCore
from autopar.spmd.dropout import sliced_dropout

NEGATIVE = -1e30  # the running max's start: finite, so exp(m - m') of a fully masked first block is 0, not nan


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
        unrepeated, rep = self.ring.unrepeated, 1
        if unrepeated is not None:  # grouped-query attention: K, V blocks before repeat_kv, repeated where they arrive
            k, v = (self._piece(key, self.state.propagation.dist(key), 1, f"the un-repeated {key}") for key in unrepeated[:2])
            rep = unrepeated[2]
        else:
            k, v = self._block(core.first, 1), self._block(core.second, 1)
        self.widths = (k.shape[-1], v.shape[-1])
        paddle.pir.set_insertion_point(second)
        self.drops = self._dropout_rows()
        out, lse = self._forward(self.q, paddle.concat([k, v], axis=-1), 0, rep)
        replace_uses(second.result(0), out)
        rp.replaced[core.output] = out
        if self.ring.recomputed is not None:  # recompute: the ring runs again where the backward re-runs the core
            out, lse = self._recomputed()
        else:  # a part re-run (its output among it): the same value as the forward's
            for index in core.recomputed:
                if self.state.graph.ops[index].recomputes == core.second:
                    replace_uses(rp.ops[index].result(0), out)
        grads = self._backward(out, lse) if self.ring.first_grad is not None else {}
        for key, new in grads.items():
            if key in self.handed:  # a block in place of the reshard after the grad op (rp.final): that one is erased
                continue
            rp.replaced[key] = new  # as the grad op made it (autopar.check reads it in that placement)
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
        return self._piece(key, read, read.ndim - 2, f"input {slot} of {self.state.graph.ops[op]}")

    def _piece(self, key: ValueKey, placed: DistAttr, seq: int, what: str) -> Any:
        """This rank's piece of ``key`` placed as ``placed`` with its dim ``seq`` split over the ring's
        dim, cut from the value as its producer placed it."""
        want = DistAttr.of(placed.mesh, tuple((self.ring.mesh_dim,) if t == seq else d for t, d in enumerate(placed.mapping)))
        shape = self.state.graph.values[key].shape
        if self.rp.ops[key[0]] is None and key not in self.rp.replaced:
            raise AutoparError(f"ring attention: {what} in {self.core} is made on another pipeline stage")
        return self._rebox(self.rp.current(key), self.state.propagation.dist(key), want, shape, what, len(shape))

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
        sliced = sliced_dropout(op_site(self.state, node))  # zig-zag: the serial mask reordered like the probabilities
        if sliced is not None and sliced.order is not None:
            whole = in_zigzag_order(whole, sliced.order, list(value.program_shape) if dim is not None else shape, str(node))
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
        return emit_step(self.state, self.rp, step, x, self.ring.values[which], self.ring.reason, key)

    def _repeated(self, x: Any, rep: int) -> Any:
        """``repeat_kv`` of a block ``[b, n, hkv, d]`` as the model writes it, then heads before the
        sequence: ``[b, hkv * rep, n, d]``."""
        import paddle

        C = paddle._C_ops
        b, n, heads, d = x.shape
        y = C.expand(C.unsqueeze(x, [3]), [b, n, heads, rep, d])
        return C.transpose(C.reshape(y, [b, n, heads * rep, d]), [0, 2, 1, 3])

    def _split(self, x: Any, widths: tuple[int, ...]) -> list[Any]:
        import paddle

        out, start = [], 0
        for w in widths:
            out.append(paddle._C_ops.slice(x, [len(x.shape) - 1], [start], [start + w], [1], []))
            start += w
        return out

    # ---- forward -------------------------------------------------------------------------
    def _forward(self, q: Any, kv: Any, shift: int = 0, rep: int = 1) -> tuple[Any, Any]:
        """The ring's forward from this rank's q and ``[k | v]`` blocks: the output and log-sum-exp
        (``shift``: which planned ring shift moves the blocks; ``rep`` > 1: they are grouped-query
        attention's K, V before repeat_kv, ``[B, n, Hkv, D]``, repeated here)."""
        import paddle

        C = paddle._C_ops
        rows = [*q.shape[:-1], 1]
        m = C.full(rows, NEGATIVE, q.dtype, paddle.CPUPlace())
        total = C.full(rows, 0.0, q.dtype, paddle.CPUPlace())
        acc = C.full([*q.shape[:-1], self.widths[1]], 0.0, q.dtype, paddle.CPUPlace())
        for s in range(self.parts):
            j = (self.position - s) % self.parts
            # the next block is sent on before this one is used (a runtime may overlap the two)
            following = self._shift(kv, shift) if s < self.parts - 1 else None
            k, v = self._split(kv, self.widths)
            if rep > 1:
                k, v = self._repeated(k, rep), self._repeated(v, rep)
            scores, _ = self._scores(q, k, j)
            new_m = C.maximum(m, C.max(scores, [-1], True))
            alpha = C.exp(C.subtract(m, new_m))
            p = C.exp(C.subtract(scores, new_m))
            total = C.add(C.multiply(total, alpha), C.sum(p, [-1], None, True))
            if self.drops is not None:
                p = C.multiply(p, self._columns(self.drops, j, "the dropout"))
            acc = C.add(C.multiply(acc, alpha), C.matmul(p, v, False, False))
            m, kv = new_m, following
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
        """Erase the core's ops, then the producers only they read. Producers are held as (id,
        op) taken while alive, and an erased op is never touched again: a Value or op of an
        erased op points to freed memory (reading it failed at random)."""
        rp = self.rp
        serial = {op.id() for op in rp.ops if op is not None}
        self._erased: set[int] = set()
        dropped: list[tuple[int, Any]] = []
        for index in sorted((*self.core.backward, *self.core.recomputed, *self.core.ops), reverse=True):
            op = rp.ops[index]
            if op is None:
                continue
            for result in op.results():
                self._erase_readers(result, serial)
                if not result.use_empty():
                    users = ", ".join(user.name() for user in result.all_used_ops())
                    raise AutoparError(f"ring attention: {self.state.graph.ops[index]} of {self.core} is still read by {users}")
            dropped.extend(_producers(op))
            op.erase()
            rp.ops[index] = None
        while dropped:
            ident, producer = dropped.pop()
            if ident in serial or ident in self._erased or any(not r.use_empty() for r in producer.results()):
                continue
            dropped.extend(_producers(producer))
            self._forget(producer)
            producer.erase()

    def _erase_readers(self, value: Any, serial: set[int]) -> None:
        """Erase the inserted ops (reshards of the core's values) that read ``value`` and whose
        results no one reads any more, readers of readers first."""
        for ident, user in [(user.id(), user) for user in value.all_used_ops()]:  # (ids read while alive)
            if ident in serial or ident in self._erased:
                continue
            for result in user.results():
                self._erase_readers(result, serial)
            if all(result.use_empty() for result in user.results()):
                self._forget(user)
                user.erase()

    def _forget(self, op: Any) -> None:
        """Drop the records of an inserted op about to be erased (its collective, its result)."""
        rp, ident = self.rp, op.id()
        self._erased.add(ident)
        rp.collectives[:] = [(c, i) for c, i in rp.collectives if i != ident]
        for table in (rp.resharded, rp.final, rp.replaced):
            for key in [k for k, v in table.items() if any(v.is_same(r) for r in op.results())]:
                del table[key]


def _producers(op: Any) -> list[tuple[int, Any]]:
    """The ops making ``op``'s operands, as (id, op), read while they are alive."""
    found = []
    for value in op.operands_source():
        producer = value.get_defining_op() if value.initialized() else None
        if producer is not None:
            found.append((producer.id(), producer))
    return found
