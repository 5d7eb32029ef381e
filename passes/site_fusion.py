"""Site fusion: the all_gathers (or all_reduces) one op needs of several values become one
collective (stage: reshard-planned -> sites-planned at compile; comm-inserted -> sites-fused
per rank).

Reshard planning plans each value's move on its own. Where one op reads several values that
must be gathered the same way before it runs, each would pay its own launch (and on the host
backend a program cut): the backward of a fused q/k/v projection split by columns
(``split_with_num``'s gradient is a ``concat`` of the three gradients, each split by heads,
read whole) gathered three times per layer in GPT-2, where one all_gather of the three carries
the same bytes; a loss averaged over the valid tokens (``sum(loss * valid) / sum(valid)``)
under data parallelism all-reduced its numerator and its denominator one by one before the
divide.

Planning, from the planned reshards (values, the same on every rank): reshards read before the
same site (an op, or the ``builtin.combine`` packing its operands) whose plan is one all_gather
over the same mesh dims, of pieces that are equal blocks in group order on every rank (even
splits: the gathered dim's innermost split is the one gathered), are packed into one bucket,
priced as the all_gather of their flat buffer; those whose plan is one all_reduce over the same
mesh dims and reduction likewise (read before the gradients are complete: gradients read after
go to :mod:`.allreduce_fusion`'s buckets). Emission, per rank, right before the site:

    flatten each piece -> concat -> one all_gather -> [ranks, buffer] -> split per value ->
    [ranks, *piece] -> ranks moved next to the gathered dim -> reshape to the whole value
    flatten each piece -> concat -> one all_reduce -> split per value -> reshape

The bytes moved stay the same; the collectives drop to one per site, recorded once with the
values it carries (why, bytes, predicted time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from autopar.collective import Collective, CollectiveKey
from autopar.collective_kinds import kind_of
from autopar.cost_model.planner import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.passes.allreduce_fusion import gradients_complete
from autopar.passes.base import CompileState, Pass, PlannedReshard, RankProgram
from autopar.passes.reshard_emission import emit_collective, read_site
from autopar.passes.results import SiteBucket, SiteBuckets
from autopar.propagation import SiteKind


@dataclass(frozen=True)
class SiteFusion(Pass):
    name: ClassVar[str] = "site_fusion"
    plan_requires: ClassVar[tuple[str, ...]] = ("reshard-planned",)
    plan_ensures: ClassVar[str] = "sites-planned"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted", "sites-planned")
    emit_ensures: ClassVar[str] = "sites-fused"

    def plan(self, state: CompileState) -> SiteBuckets:
        groups: dict[tuple, list[PlannedReshard]] = {}
        complete = gradients_complete(state)  # (all_reduces read after it are gradient buckets' candidates)
        for planned in state.reshards:
            reduces = _reduces(planned) and planned.need.op <= complete
            if planned.shared_with is None and (_gathers_in_blocks(planned) or reduces):
                step = planned.plan.steps[0]
                site = state.graph.ops[planned.need.op].sites[planned.need.site.slot][0]
                key = (site, step.kind, step.reduce, step.src.mesh, step.mesh_dims, planned.plan.dtype)
                groups.setdefault(key, []).append(planned)
        members = [m for m in groups.values() if len(m) > 1]
        return SiteBuckets(tuple(_bucket(state, number, m) for number, m in enumerate(members)))

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        by_index = {p.index: p for p in state.reshards}
        with paddle.static.program_guard(rp.program):
            for bucket in state.site_buckets:
                members = [by_index[i] for i in bucket.members]
                if members[0].plan.steps[0].group_of(rp.rank) is not None:
                    _emit(state, rp, bucket, members)
            fused = {m for bucket in state.site_buckets for m in bucket.members}
            for read in state.reshards:  # later reads sharing a member's result (reshard emission left them)
                if read.shared_with in fused and read.shared_with in rp.resharded:
                    consumer, slot = read_site(state, rp, read)
                    consumer.operand(slot).set_source(rp.resharded[read.shared_with])
            paddle.pir.reset_insertion_point_to_end()


def _gathers_in_blocks(planned: PlannedReshard) -> bool:
    """A before-read reshard of one all_gather over one mesh dim, the innermost split of the
    gathered tensor dim, whose pieces are equal on every rank of each group (even: one
    reshape lays the gathered rows out)."""
    steps = planned.plan.steps
    if planned.need.site.kind is not SiteKind.BEFORE_READ or len(steps) != 1 or not kind_of(steps[0].kind).gathers:
        return False
    step, have, need = steps[0], planned.need.have, planned.need.need
    if len(step.mesh_dims) != 1 or len(step.tensor_dims) != 1 or have.partial:
        return False
    axis = step.tensor_dims[0]
    if have.mapping[axis] != need.mapping[axis] + tuple(step.mesh_dims):
        return False
    shape = planned.plan.shape
    return all(len({have.local_shape(shape, r) for r in group}) == 1 for group in step.groups)


def _reduces(planned: PlannedReshard) -> bool:
    """A before-read reshard of one all_reduce (the pieces keep their shape)."""
    steps = planned.plan.steps
    if planned.need.site.kind is not SiteKind.BEFORE_READ or len(steps) != 1:
        return False
    return kind_of(steps[0].kind).makes_whole and kind_of(steps[0].kind).reduces


def _bucket(state: CompileState, number: int, members: list[PlannedReshard]) -> SiteBucket:
    step = members[0].plan.steps[0]
    mesh, ranks, kind = step.src.mesh, len(step.groups[0]), step.kind
    numel = sum(math.prod(m.need.have.local_shape(m.plan.shape, step.groups[0][0])) for m in members)
    if kind_of(kind).gathers:
        src, dst, numel = DistAttr.of(mesh, (tuple(step.mesh_dims),)), DistAttr.of(mesh, ((),)), numel * ranks
    else:
        src, dst = DistAttr.of(mesh, ((),), tuple((d, step.reduce or "sum") for d in step.mesh_dims)), DistAttr.of(mesh, ((),))
    flat = plan_reshard(src, dst, (numel,), members[0].plan.dtype, state.cluster)
    (moved,) = flat.steps
    reader = state.graph.ops[members[0].need.op]
    cause = members[0].reason.split(": ", 1)[0]
    labels = ", ".join(state.label(m.need.value) for m in members)
    reason = (
        f"{cause}: {reader} reads {labels} as {members[0].need.need}; they are {members[0].need.have}: "
        f"{len(members)} {kind}s at one site fused into one buffer"
    )
    members_t = tuple(m.index for m in members)
    return SiteBucket(number, kind, members_t, moved.bytes, moved.time, reason, step.reduce or "sum")


def emitted_ops(bucket: SiteBucket, members: list[PlannedReshard], rank: int) -> int:
    """How many ops :func:`_emit` adds to ``rank``'s program (what pricing counts: on a host each
    op costs its launch; each Paddle op with the constants it takes: reshape 2, concat 3,
    split 4, transpose 1)."""
    if members[0].plan.steps[0].group_of(rank) is None:
        return 0
    if not kind_of(bucket.kind).gathers:  # (an all_reduce)
        return 3 + 1 + 4 + 4 * len(members)  # concat, all_reduce, split; each flattened and shaped back
    ops = 3 + 1 + 2 + 4  # concat, all_gather, reshape to rows, split
    for member in members:
        axis = member.plan.steps[0].tensor_dims[0]
        ops += 2 + 2 + (1 + 2) * (axis > 0)  # flattened; rows shaped; ranks moved next to the dim, merged
    return ops


def _emit(state: CompileState, rp: RankProgram, bucket: SiteBucket, members: list[PlannedReshard]) -> None:
    import paddle

    step = members[0].plan.steps[0]
    group = step.group_of(rp.rank)
    site, _ = read_site(state, rp, members[0])
    paddle.pir.set_insertion_point(site)
    pieces = [m.need.have.local_shape(m.plan.shape, rp.rank) for m in members]
    sizes = [math.prod(s) for s in pieces]
    flat = paddle._C_ops.concat([paddle._C_ops.reshape(rp.current(m.need.value), [-1]) for m in members], 0)
    gather = kind_of(bucket.kind).gathers
    total = sum(sizes) * (len(group) if gather else 1)
    mesh = step.src.mesh
    pending = () if gather else tuple((d, bucket.reduce) for d in step.mesh_dims)
    collective = Collective(
        kind=bucket.kind, group=group, key=CollectiveKey("site", bucket.index),
        value=f"site bucket {bucket.index} ({len(members)} values)",
        src=DistAttr.of(mesh, (tuple(step.mesh_dims),) if gather else ((),), pending),
        dst=DistAttr.of(mesh, ((),)), shape=(total,), output_shape=(total,), bytes=bucket.bytes, time=bucket.time,
        reason=bucket.reason, reduce=bucket.reduce, dtype=members[0].plan.dtype,
    )  # fmt: skip
    gathered = emit_collective(state, rp, collective, flat, step.mesh_dims)
    if not gather:
        for member, piece in zip(members, paddle._C_ops.split(gathered, sizes, 0)):
            out = paddle._C_ops.reshape(piece, list(member.need.need.local_shape(member.plan.shape, rp.rank)))
            consumer, slot = read_site(state, rp, member)
            consumer.operand(slot).set_source(out)
            rp.resharded[member.index] = out
        return
    rows = paddle._C_ops.split(paddle._C_ops.reshape(gathered, [len(group), -1]), sizes, 1)
    for member, piece, row in zip(members, pieces, rows):
        axis = member.plan.steps[0].tensor_dims[0]
        whole = member.need.need.local_shape(member.plan.shape, rp.rank)
        out = paddle._C_ops.reshape(row, [len(group), *piece])  # [ranks, *piece]
        if axis > 0:  # ranks next to the gathered dim: [.., ranks, piece[axis], ..]
            out = paddle._C_ops.transpose(out, [*range(1, axis + 1), 0, *range(axis + 1, len(piece) + 1)])
        out = paddle._C_ops.reshape(out, list(whole))
        consumer, slot = read_site(state, rp, member)
        consumer.operand(slot).set_source(out)
        rp.resharded[member.index] = out
