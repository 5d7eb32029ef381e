"""All-reduce fusion: the gradient all-reduces of a step become one per bucket (stage:
reshard-planned -> buckets-planned at compile; comm-inserted -> comm-fused per rank).

Data parallelism leaves one all-reduce per gradient in front of the optimizer (they fall out
of propagation). Each collective pays a launch latency, and on the host backend a program cut
and a Python round trip, so PyTorch DDP / Paddle fuse them into buckets.

Planning, from the planned reshards (values, the same on every rank): single-step
all-reduces read after the last grad op (every gradient is complete there), along the
same mesh dims with the same reduction and dtype, are packed in program order into buckets of
at most ``bucket_bytes``; each bucket is priced as one all-reduce of its total size. A
gradient read twice made complete (global-norm clipping: the norm, then the scaling before
the optimizer) is one reshard whose result the later read shares: the bucket serves both
reads, so a bucket's ``members`` are its gradients' reshards followed by the reads sharing
them (those move nothing of their own).

Emission, per rank: each bucket becomes

    flatten each gradient -> concat -> one all_reduce -> split -> reshape back

right before the first member's reader; a read sharing a member's reshard reads that
member's piece. The bytes moved stay the same; the number of collectives drops to one per
bucket, recorded once with the gradients it carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.cost_model.planner import group_at, plan_reshard
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import Role
from autopar.passes.base import CompileState, GradientBucket, Pass, PlannedReshard, RankProgram
from autopar.passes.reshard_emission import REDUCE_CODES, read_site
from autopar.propagation import SiteKind

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class AllreduceFusion(Pass):
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    name: ClassVar[str] = "allreduce_fusion"
    plan_requires: ClassVar[tuple[str, ...]] = ("reshard-planned",)
    plan_ensures: ClassVar[str] = "buckets-planned"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted", "buckets-planned")
    emit_ensures: ClassVar[str] = "comm-fused"

    def __post_init__(self) -> None:
        check_bucket_bytes(self.name, self.bucket_bytes)

    def plan(self, state: CompileState) -> None:
        open_buckets: dict[tuple, list[PlannedReshard]] = {}
        done: list[list[PlannedReshard]] = []
        for planned in _candidates(state):
            (step,) = planned.plan.steps
            key = (planned.need.have.mesh, step.mesh_dims, step.reduce or "sum", planned.plan.dtype)  # one bucket per stage
            bucket = open_buckets.setdefault(key, [])
            if bucket and sum(m.plan.steps[0].bytes for m in bucket) + step.bytes > self.bucket_bytes:
                done.append(bucket)
                bucket = open_buckets[key] = []
            if bucket and planned.need.value[0] >= bucket[0].need.op:
                continue  # made after the bucket's insertion point: leave it alone
            bucket.append(planned)
        done.extend(open_buckets.values())
        done = sorted((b for b in done if len(b) > 1), key=lambda b: b[0].need.op)
        sharing: dict[int, list[PlannedReshard]] = {}
        for planned in state.reshards:
            if planned.shared_with is not None:
                sharing.setdefault(planned.shared_with, []).append(planned)
        state.buckets = [
            _bucket(state, number, members, [s for m in members for s in sharing.get(m.index, ())])
            for number, members in enumerate(done)
        ]

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        by_index = {p.index: p for p in state.reshards}
        with paddle.static.program_guard(rp.program):
            for bucket in state.buckets:
                if rp.rank not in bucket.src.mesh.ranks:
                    continue  # another pipeline stage's gradients
                _emit_bucket(state, rp, bucket, [by_index[i] for i in bucket.members])
            paddle.pir.reset_insertion_point_to_end()


def check_bucket_bytes(pass_name: str, bucket_bytes: object) -> None:
    """A fusion pass's bucket size must be a positive int (bool refused)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise AutoparError(f"{pass_name}: bucket_bytes must be a positive int, got {bucket_bytes!r}")


def _candidates(state: CompileState) -> list[PlannedReshard]:
    """Single all-reduce reshards read after the last grad op, in reader order (reads sharing
    an earlier reshard's result are not candidates: they follow it)."""
    # every gradient is complete once the last grad op has run; what follows (accumulation,
    # clipping, the optimizer) only reads gradients. Not the last op of backward role: ops
    # reading gradients count as backward, so clipping's reads would fall before it
    grad_ops = [op.index for op in state.graph.ops if op.role is Role.BACKWARD and op.short_name.endswith("_grad")]
    start = max(grad_ops, default=len(state.graph.ops))
    out = []
    for planned in state.reshards:
        steps = planned.plan.steps
        if (
            planned.need.site.kind is SiteKind.BEFORE_READ
            and planned.shared_with is None
            and planned.need.op > start
            and len(steps) == 1
            and steps[0].kind is CollectiveKind.ALL_REDUCE
        ):
            out.append(planned)
    return sorted(out, key=lambda p: (p.need.op, p.index))


def _reduced(planned: PlannedReshard) -> dict[int, str]:
    return {d: k for d, k in planned.need.have.partial if d not in planned.need.need.partial_dims}


def _bucket(
    state: CompileState, number: int, members: list[PlannedReshard], sharing: list[PlannedReshard]
) -> GradientBucket:
    """The bucket of ``members`` (the reshards it moves); ``sharing``: later reads of their results."""
    first = members[0]
    (step,) = first.plan.steps
    numel = sum(math.prod(m.need.need.local_shape(m.plan.shape, m.need.need.mesh.ranks[0])) for m in members)
    mesh = first.need.have.mesh
    src = DistAttr.of(mesh, ((),), tuple(sorted(_reduced(first).items())))
    plan = plan_reshard(src, DistAttr.of(mesh, ((),)), (numel,), first.plan.dtype, state.cluster)
    names = ", ".join(state.label(m.need.value) for m in members)
    return GradientBucket(
        index=number, members=tuple(m.index for m in members + sharing), mesh_dims=tuple(step.mesh_dims),
        reduce=step.reduce or "sum", src=src, dtype=first.plan.dtype, numel=numel,
        bytes=int(sum(m.plan.steps[0].bytes for m in members)), time=plan.time,
        reason=f"{len(members)} gradient all_reduces fused into one buffer: {names}",
    )  # fmt: skip


def _emit_bucket(state: CompileState, rp: RankProgram, bucket: GradientBucket, planned: list[PlannedReshard]) -> None:
    import paddle

    members = [p for p in planned if p.shared_with is None]
    first_reader, _ = read_site(state, rp, members[0])
    paddle.pir.set_insertion_point(first_reader)
    inputs = [rp.current(m.need.value) for m in members]
    shapes = [m.need.need.local_shape(m.plan.shape, rp.rank) for m in members]
    flat = paddle._C_ops.concat([x if len(s) == 1 else paddle._C_ops.reshape(x, [-1]) for x, s in zip(inputs, shapes)], 0)
    group = group_at(bucket.src.mesh, rp.rank, bucket.mesh_dims)  # (a stage's sub-mesh under a pipeline)
    ring = rp.rings.setdefault(group, state.ring_of(bucket.mesh_dims, group))
    fused = paddle._C_ops.all_reduce(flat, ring, REDUCE_CODES[bucket.reduce])
    pieces = paddle._C_ops.split(fused, [math.prod(s) for s in shapes], 0)
    for member, piece, shape in zip(members, pieces, shapes):
        out = piece if len(shape) == 1 else paddle._C_ops.reshape(piece, list(shape))
        consumer, slot = read_site(state, rp, member)
        consumer.operand(slot).set_source(out)
        rp.resharded[member.index] = out
    for read in planned:
        if read.shared_with is not None:
            consumer, slot = read_site(state, rp, read)
            consumer.operand(slot).set_source(rp.resharded[read.shared_with])
    total = sum(math.prod(s) for s in shapes)
    collective = Collective(
        kind=CollectiveKind.ALL_REDUCE, group=group, key=CollectiveKey("bucket", bucket.index),
        value=f"bucket {bucket.index} ({len(members)} gradients)", src=bucket.src, dst=DistAttr.of(state.mesh, ((),)),
        shape=(total,), output_shape=(total,), bytes=bucket.bytes, time=bucket.time,
        reason=bucket.reason, reduce=bucket.reduce,
    )  # fmt: skip
    rp.collectives.append((collective, fused.get_defining_op().id()))
