"""All-reduce fusion: the gradient all-reduces of a step become one per bucket (stage:
comm-inserted -> comm-fused).

Data parallelism leaves one all-reduce per gradient in front of the optimizer (they fall out
of propagation). Each collective pays a launch latency, and on the host backend a program cut
and a Python round trip, so PyTorch DDP / Paddle fuse them into buckets. Here: all-reduces
placed after the last backward op (every gradient is complete there), over the same group
with the same reduction and dtype, are packed in program order into buckets of at most
``bucket_bytes``; each bucket becomes

    flatten each gradient -> concat -> one all_reduce -> split -> reshape back

inserted where the bucket's first all-reduce was. The bytes moved stay the same; the number
of collectives drops to one per bucket. Each fused collective is recorded once in
``comm_ops`` with the gradients it carries in its reason.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from autopar.cost_model.planner import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.graph import Role
from autopar.passes.base import CommOp, CompileState, Pass, RankProgram
from autopar.passes.reshard_insertion import REDUCE_CODES

DEFAULT_BUCKET_BYTES = 32 << 20


class AllreduceFusionPass(Pass):
    name: ClassVar[str] = "allreduce_fusion"
    requires_stage: ClassVar[str] = "comm-inserted"
    ensures_stage: ClassVar[str] = "comm-fused"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes

    def run(self, state: CompileState) -> None:
        import paddle

        for rp in state.ranks.values():
            with paddle.static.program_guard(rp.program):
                for number, bucket in enumerate(self._buckets(state, rp)):
                    _fuse(state, rp, bucket, number)
                paddle.pir.reset_insertion_point_to_end()
            position = {op.id(): i for i, op in enumerate(rp.program.global_block().ops)}
            rp.comm_ops.sort(key=lambda c: position[c.op_id])

    def _buckets(self, state: CompileState, rp: RankProgram) -> list[list[tuple[CommOp, Any]]]:
        """Fusable all-reduces in program order, grouped by (group, reduction, dtype), capped."""
        ops = list(rp.program.global_block().ops)
        position = {op.id(): i for i, op in enumerate(ops)}
        backward = [position[rp.ops[n.index].id()] for n in state.graph.ops if n.role is Role.BACKWARD and n.index not in rp.erased]
        start = max(backward, default=len(ops))
        open_buckets: dict[tuple, list[tuple[CommOp, Any]]] = {}
        done: list[list[tuple[CommOp, Any]]] = []
        for comm in sorted(rp.comm_ops, key=lambda c: position[c.op_id]):
            op = ops[position[comm.op_id]]
            if comm.kind != "all_reduce" or position[comm.op_id] < start:
                continue
            key = (comm.group, comm.reduce, str(op.result(0).dtype), tuple(sorted(_reduced(comm).items())))
            bucket = open_buckets.setdefault(key, [])
            if bucket and sum(c.bytes for c, _ in bucket) + comm.bytes > self.bucket_bytes:
                done.append(bucket)
                bucket = open_buckets[key] = []
            if bucket and not _defined_before(op.operand_source(0), position[bucket[0][0].op_id], position):
                continue  # its input is made after the bucket's insertion point: leave it alone
            bucket.append((comm, op))
        done.extend(open_buckets.values())
        return [b for b in sorted(done, key=lambda b: position[b[0][0].op_id]) if len(b) > 1]


def _reduced(comm: CommOp) -> dict[int, str]:
    """The mesh dims (and kinds) this all-reduce reduces."""
    return {d: k for d, k in comm.src.partial if d not in comm.dst.partial_dims}


def _defined_before(value: Any, index: int, position: dict[int, int]) -> bool:
    return position[value.get_defining_op().id()] < index


def _fuse(state: CompileState, rp: RankProgram, bucket: list[tuple[CommOp, Any]], number: int) -> None:
    import paddle

    first_comm, first_op = bucket[0]
    paddle.pir.set_insertion_point(first_op)
    inputs = [op.operand_source(0) for _, op in bucket]
    sizes = [math.prod(c.output_shape) for c, _ in bucket]
    flat = paddle._C_ops.concat([paddle._C_ops.reshape(x, [-1]) for x in inputs], 0)
    ring = state.rings[tuple(first_comm.group)]
    fused = paddle._C_ops.all_reduce(flat, ring, REDUCE_CODES[first_comm.reduce])
    pieces = paddle._C_ops.split(fused, sizes, 0)
    outs = [paddle._C_ops.reshape(piece, list(comm.output_shape)) for (comm, _), piece in zip(bucket, pieces)]
    paddle.pir.reset_insertion_point_to_end()  # the insertion point's op is erased next
    for (_, op), out in zip(bucket, outs):
        op.result(0).replace_all_uses_with(out)
        op.erase()
    total = sum(sizes)
    mesh = first_comm.src.mesh
    src = DistAttr.of(mesh, ((),), tuple(sorted(_reduced(first_comm).items())))
    plan = plan_reshard(src, DistAttr.of(mesh, ((),)), (total,), str(inputs[0].dtype).removeprefix("paddle."), state.cluster)
    names = ", ".join(c.value for c, _ in bucket)
    members = {id(c) for c, _ in bucket}
    rp.comm_ops[:] = [c for c in rp.comm_ops if id(c) not in members]
    rp.comm_ops.append(
        CommOp(
            kind="all_reduce", group=first_comm.group, value=f"bucket {number} ({len(bucket)} gradients)", src=src,
            dst=DistAttr.of(mesh, ((),)), reason=f"{len(bucket)} gradient all_reduces fused into one buffer: {names}",
            bytes=int(sum(c.bytes for c, _ in bucket)), time=plan.time, reduce=first_comm.reduce,
            op_id=fused.get_defining_op().id(), output_shape=(total,), shape=(total,), step_key=(-2, number),
        )
    )  # fmt: skip
