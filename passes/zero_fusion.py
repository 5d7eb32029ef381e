"""ZeRO bucket fusion: the per-parameter gradient reduce_scatters and the write-back
all_gathers become one collective per bucket (stage: reshard-planned -> zero-buckets-planned
at compile; comm-inserted -> zero-comm-fused per rank).

ZeRO leaves one reduce_scatter per gradient — in front of its update (stage 1), or right after
backward makes it (stages 2 and 3: the bucket then runs after its last member is made, so a
gradient stays whole until its bucket fills: at most the bucket's bytes) — and one all_gather
after each update (stages 1 and 2). Each pays a launch latency (and on the host backend a
program cut), so they are packed like the gradient all-reduces (:mod:`.allreduce_fusion`). A flat buffer of several
tensors scatters correctly only if rank ``i``'s chunk holds exactly its shards, so the buffer is
laid out rank-major: for each rank of the group, each member's shard for that rank, flattened
and padded to the member's largest shard (uneven shards), so every chunk has the same size:

    reduce_scatter:  [m0 shard(r0) | m1 shard(r0)] [m0 shard(r1) | m1 shard(r1)] -> own chunk -> unpad
    all_gather:      own [m0 | m1] (padded) -> every chunk -> each member's shards, concatenated
                     along its split dim -> assigned to the parameter

The bytes moved grow only by the padding; the collectives drop to one per bucket.

Most shards are equal blocks of the outermost dim (ZeRO splits a parameter's first dim that
holds a piece per rank), so each member's shards are already contiguous in its flattened piece:
then a reshape to ``[ranks, shard]`` lays it out, and the gathered buffer is split back per
member by one reshape, without cutting every shard apart (on a host backend every op costs its
launch: a GPT block's ZeRO-1 rank program held 1942 ops with the cuts, 429 without ZeRO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.causes import gradients, in_layer, layers_text, value_layer
from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import composed, kind_of
from autopar.cost_model.planner import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.graph import Role, ValueKey
from autopar.passes.allreduce_fusion import check_bucket_bytes
from autopar.passes.base import CompileState, Pass, PlannedReshard, RankProgram
from autopar.passes.reshard_emission import cast_to, dtype_name, emit_collective, read_site, replace_uses
from autopar.passes.results import ZeroBucket, ZeroBuckets
from autopar.propagation import SiteKind


@dataclass(frozen=True)
class ZeroBucketFusion(Pass):
    bucket_bytes: int = 32 << 20

    name: ClassVar[str] = "zero_bucket_fusion"
    plan_requires: ClassVar[tuple[str, ...]] = ("reshard-planned", "zero-sharded")
    plan_ensures: ClassVar[str] = "zero-buckets-planned"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted", "zero-buckets-planned")
    emit_ensures: ClassVar[str] = "zero-comm-fused"

    def __post_init__(self) -> None:
        check_bucket_bytes(self.name, self.bucket_bytes)

    def plan(self, state: CompileState) -> ZeroBuckets:
        buckets: list[ZeroBucket] = []
        for kind, members in _groups(state):
            current: list[PlannedReshard] = []
            for planned in members + [None]:
                size = sum(m.plan.steps[0].bytes for m in current)
                if current and (planned is None or size + planned.plan.steps[0].bytes > self.bucket_bytes):
                    if len(current) > 1:
                        buckets.append(_bucket(state, len(buckets), kind, current))
                    current = []
                if planned is not None:
                    current.append(planned)
        return ZeroBuckets(tuple(buckets))

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        by_index = {p.index: p for p in state.reshards}
        riders = _riders(state, rp, by_index)
        carried: list[Any] = []
        with paddle.static.program_guard(rp.program):
            for bucket in state.zero_buckets:
                members = [by_index[i] for i in bucket.members]
                if members[0].plan.steps[0].group_of(rp.rank) is None:
                    continue  # (another pipeline stage's parameters)
                if kind_of(bucket.kind).reduces:  # (a reduce_scatter of gradients, else an all_gather)
                    carried = _emit_scatter(state, rp, bucket, members, riders)
                else:
                    _emit_gather(state, rp, bucket, members, list(zip(riders, carried)))
            paddle.pir.reset_insertion_point_to_end()


def _riders(state: CompileState, rp: RankProgram, by_index: dict[int, PlannedReshard]) -> list[ValueKey]:
    """The fetches of ``rp`` that ride in the step's ZeRO buckets: made whole by one sum
    all_reduce over the buckets' group (a data-parallel loss), made before the gradients.
    Each rides in the reduce_scatter (its local value in the first rank's chunk, zeros in the
    others': that rank gets the sum) and in the all_gather after the updates (every rank gets
    it), so it needs no collective of its own; only where the step has one bucket of each."""
    from autopar.passes.fetch_replication import whole_plan

    mine = [b for b in state.zero_buckets if by_index[b.members[0]].plan.steps[0].group_of(rp.rank) is not None]
    scatters = [b for b in mine if kind_of(b.kind).reduces]
    gathers = [b for b in mine if not kind_of(b.kind).reduces]
    if state.pipeline is not None or not rp.fetches or len(scatters) != 1 or len(gathers) != 1:
        return []
    first = by_index[scatters[0].members[0]]
    group = first.plan.steps[0].group_of(rp.rank)
    gather = by_index[gathers[0].members[0]]
    if gather.plan.steps[0].group_of(rp.rank) != group or gather.plan.dtype != first.plan.dtype:
        return []  # (a rider is one buffer's piece in both: gradients reduced in another dtype than the parameters')
    positions = {op.id(): i for i, op in enumerate(rp.program.global_block().ops)}
    start = positions[rp.ops[min(by_index[i].need.op for i in scatters[0].members)].id()]
    out: list[ValueKey] = []
    rides = composed([scatters[0].kind, gathers[0].kind])  # (the all_reduce the two buckets make)
    for key in rp.fetches:
        plan = whole_plan(state, key)
        if key in rp.fetched or key in out or plan.kinds() != [rides] or plan.dtype != first.plan.dtype:
            continue
        if plan.steps[0].group_of(rp.rank) != group or (plan.steps[0].reduce or "sum") != "sum":
            continue
        producer = rp.produced(key).get_defining_op()
        if producer is not None and positions.get(producer.id(), start) < start:
            out.append(key)
    return out


def _groups(state: CompileState) -> list[tuple[CollectiveKind, list[PlannedReshard]]]:
    """Reduce_scatters read by an update, reduce_scatters of an update's gradient right after it
    is made, and single-step write-back all_gathers, grouped by site, mesh, mesh dims and dtype,
    in program order. A gradient's reduce_scatter is its plan's one step, or its plan is an
    all_reduce then a local slice of the own shard (the planner's cheapest way for a small
    gradient alone, 256 B - 8 KiB on ``cpu-shm``): in a bucket it is a reduce_scatter like the
    others (the same result), so no gradient below the bucket size pays a collective of its own."""
    shared = {p.shared_with for p in state.reshards if p.shared_with is not None}
    grads = gradients(state.graph)
    groups: dict[tuple, list[PlannedReshard]] = {}
    for planned in state.reshards:
        steps = planned.plan.steps
        if planned.shared_with is not None or planned.index in shared:
            continue
        site, kind = planned.need.site.kind, _fusable_kind(planned)
        scatters = kind is not None and kind_of(kind).reduces  # (else an all_gather)
        if site is SiteKind.BEFORE_READ and scatters:
            if state.graph.ops[planned.need.op].role is not Role.OPTIMIZER:
                continue
        elif site is SiteKind.AFTER_PRODUCER and scatters:
            if planned.need.value not in grads:
                continue
        elif not (site is SiteKind.WRITE_BACK and kind is not None and not scatters):
            continue
        key = (site, kind, planned.need.have.mesh, steps[0].mesh_dims, planned.plan.dtype)
        groups.setdefault(key, []).append(planned)
    return [(key[1], _read_after_made(state, members) if key[0] is SiteKind.AFTER_PRODUCER else members) for key, members in groups.items()]


def _fusable_kind(planned: PlannedReshard) -> CollectiveKind | None:
    """The collective ``planned`` is in a ZeRO bucket: its plan's one step (a reduce_scatter or
    an all_gather), or a reduce_scatter for an all_reduce then a slice of the own shard along
    the same mesh dims (``P(sum) -> S``: what a reduce_scatter makes); else None."""
    steps = planned.plan.steps
    if len(steps) == 1 and kind_of(steps[0].kind).zero_bucket:
        return steps[0].kind
    if len(steps) != 2 or kind_of(steps[0].kind).sliced is None or not kind_of(steps[1].kind).slices:
        return None
    if tuple(steps[0].mesh_dims) != tuple(steps[1].mesh_dims):
        return None
    have, need = planned.need.have, planned.need.need
    dims = set(steps[0].mesh_dims)
    if set(have.partial_dims) != dims or need.partial or set(need.sharded_mesh_dims()) - set(have.sharded_mesh_dims()) != dims:
        return None
    return kind_of(steps[0].kind).sliced


def _read_after_made(state: CompileState, members: list[PlannedReshard]) -> list[PlannedReshard]:
    """The gradients no op reads before the last of them is made (the bucket runs there)."""
    last = max(m.need.op for m in members)
    return [m for m in members if all(user > last for user in state.graph.values[m.need.value].users)]


def _sizes(planned: PlannedReshard, group: tuple[int, ...]) -> list[int]:
    """Each group member's shard size (elements) of this reshard's sharded placement."""
    sharded = planned.need.have if planned.need.site.kind is SiteKind.WRITE_BACK else planned.need.need
    return [math.prod(sharded.local_shape(planned.plan.shape, r)) for r in group]


def _bucket(state: CompileState, number: int, kind: CollectiveKind, members: list[PlannedReshard]) -> ZeroBucket:
    step = members[0].plan.steps[0]
    group = step.groups[0]
    chunk = sum(max(_sizes(m, group)) for m in members)
    mesh = members[0].need.have.mesh
    flat = (chunk * len(group),)
    whole = DistAttr.of(mesh, ((),))
    split = DistAttr.of(mesh, (tuple(step.mesh_dims),))
    if kind_of(kind).reduces:
        src = DistAttr.of(mesh, ((),), tuple((d, step.reduce or "sum") for d in step.mesh_dims))
        plan = plan_reshard(src, split, flat, members[0].plan.dtype, state.cluster)
    else:
        plan = plan_reshard(split, whole, flat, members[0].plan.dtype, state.cluster)
    labels = ", ".join(state.label(m.need.value) for m in members)
    what = {
        SiteKind.BEFORE_READ: "gradient reduce_scatters at the updates",
        SiteKind.AFTER_PRODUCER: "gradient reduce_scatters after backward",
        SiteKind.WRITE_BACK: "write-back all_gathers",
    }[members[0].need.site.kind]
    feature = "ZeRO gradient sync" if kind_of(kind).reduces else "ZeRO parameter gather"
    layers = layers_text([value_layer(state.graph, m.need.value) for m in members])
    return ZeroBucket(
        number, kind, tuple(m.index for m in members), int(sum(s.bytes for s in plan.steps)), plan.time,
        f"{in_layer(feature, layers)}: {len(members)} {what} fused into one buffer: {labels}",
    )  # fmt: skip


def _in_blocks(piece: DistAttr, sharded: DistAttr, shape: tuple[int, ...], rank: int, group: tuple[int, ...]) -> bool:
    """Whether the group members' shards (under ``sharded``) are equal consecutive blocks, in
    group order, of ``rank``'s flattened piece under ``piece``: they split one dim evenly and
    every dim before it holds one element."""
    mine = piece.local_slices(shape, rank)
    boxes = [sharded.local_slices(shape, member) for member in group]
    axes = [t for t in range(len(shape)) if any((b[t].start, b[t].stop) != (mine[t].start, mine[t].stop) for b in boxes)]
    if len(axes) != 1:
        return False
    axis = axes[0]
    extent = mine[axis].stop - mine[axis].start
    block = extent // len(group)
    if block * len(group) != extent or math.prod(s.stop - s.start for s in mine[:axis]) != 1:
        return False
    return all(
        (b[axis].start - mine[axis].start, b[axis].stop - mine[axis].start) == (i * block, (i + 1) * block)
        for i, b in enumerate(boxes)
    )  # fmt: skip


def _rank_rows(x: Any, planned: PlannedReshard, have: DistAttr, sharded: DistAttr, rank: int, group: tuple[int, ...]) -> Any:
    """``x`` (this rank's piece under ``have``) as ``[ranks, largest shard]``: row ``i`` holds
    group member ``i``'s shard, flattened and padded."""
    import paddle

    shape = planned.plan.shape
    if _in_blocks(have, sharded, shape, rank, group):
        return paddle._C_ops.reshape(x, [len(group), -1])
    sizes = _sizes(planned, group)
    pieces = _pieces(x, have, sharded, shape, rank, group)
    return paddle._C_ops.stack([_padded(p, size, max(sizes)) for p, size in zip(pieces, sizes)], 0)


def emitted_ops(state: CompileState, bucket: ZeroBucket, members: list[PlannedReshard], rank: int) -> int:
    """How many ops :meth:`ZeroBucketFusion.emit` adds to ``rank``'s program for ``bucket``
    (what pricing counts: on a host each op costs its launch; each Paddle op below with the
    constants it takes: reshape 2, slice 3, concat 3, split 4, stack 2, full 1)."""
    group = members[0].plan.steps[0].group_of(rank)
    if group is None:
        return 0
    own = group.index(rank)
    ops = 3 + 2 + 1 + 4  # the buffer joined (and flattened or split into rows), the collective, the split
    for member in members:
        ops += 2 * (member.plan.dtype != state.graph.values[member.need.value].dtype)  # reduce_dtype: cast there and back
        sizes, shape = _sizes(member, group), member.plan.shape
        padded = 2 * (len(shape) != 1)  # (_padded: flattened unless 1-d, padded with a full + concat)
        if kind_of(bucket.kind).reduces:
            have, sharded = member.need.have, member.need.need
            if _in_blocks(have, sharded, shape, rank, group):
                ops += 2
            else:
                mine = have.local_slices(shape, rank)
                cut = sum(3 for r in group if sharded.local_slices(shape, r) != mine)
                ops += cut + len(group) * padded + sum(4 for size in sizes if size != max(sizes)) + 2
            ops += 3 * (sizes[own] != max(sizes)) + 2
        else:
            sharded, whole = member.need.have, member.need.need
            ops += padded + 4 * (sizes[own] != max(sizes))
            ops += 2 if _in_blocks(whole, sharded, shape, rank, group) else 5 * len(group) + 3
            ops += 1  # assign_out_
    return ops


def _pieces(x: Any, have: DistAttr, sharded: DistAttr, shape: tuple[int, ...], rank: int, group: tuple[int, ...]) -> list[Any]:
    """The shard of each group member, cut out of ``x`` (this rank's piece under ``have``)."""
    import paddle

    mine = have.local_slices(shape, rank)
    out = []
    for member in group:
        box = sharded.local_slices(shape, member)
        axes = [t for t in range(len(shape)) if (box[t].start, box[t].stop) != (mine[t].start, mine[t].stop)]
        starts = [box[t].start - mine[t].start for t in axes]
        ends = [box[t].stop - mine[t].start for t in axes]
        out.append(paddle._C_ops.slice(x, axes, starts, ends, [1] * len(axes), []) if axes else x)
    return out


def _padded(x: Any, size: int, to: int) -> Any:
    import paddle

    flat = x if len(x.shape) == 1 else paddle._C_ops.reshape(x, [-1])
    if size == to:
        return flat
    return paddle._C_ops.concat([flat, paddle._C_ops.full([to - size], 0.0, flat.dtype, paddle.CPUPlace())], 0)


def _record(
    state: CompileState, rp: RankProgram, bucket: ZeroBucket, x: Any, group: tuple[int, ...], step: Any,
    riders: list[ValueKey] = (),
) -> Any:  # fmt: skip
    scatter = kind_of(bucket.kind).reduces
    chunk = math.prod(x.shape) // (len(group) if scatter else 1)
    total = chunk * len(group)
    mesh = step.src.mesh
    split = DistAttr.of(mesh, (tuple(step.mesh_dims),))
    collective = Collective(
        kind=bucket.kind, group=group, key=CollectiveKey("zero_bucket", bucket.index),
        value=f"zero bucket {bucket.index} ({len(bucket.members)} tensors)",
        src=DistAttr.of(mesh, ((),), tuple((d, "sum") for d in step.mesh_dims)) if scatter else split,
        dst=split if scatter else DistAttr.of(mesh, ((),)), shape=(total,), output_shape=(chunk,) if scatter else (total,),
        bytes=bucket.bytes, time=bucket.time, reduce=step.reduce or "sum", dtype=dtype_name(x),
        reason=bucket.reason + (f"; fetched {', '.join(state.graph.values[k].label for k in riders)} rides along (no collective of its own)" if riders else ""),
    )  # fmt: skip
    return emit_collective(state, rp, collective, x, step.mesh_dims)


def _emit_scatter(
    state: CompileState, rp: RankProgram, bucket: ZeroBucket, members: list[PlannedReshard], riders: list[ValueKey]
) -> list[Any]:
    """The bucket's reduce_scatter on ``rp``; returns each rider's piece of the own chunk (the
    sum on the group's first rank, zeros on the others)."""
    import paddle

    step = members[0].plan.steps[0]
    group = step.group_of(rp.rank)
    after = members[0].need.site.kind is SiteKind.AFTER_PRODUCER
    if after:  # right after the last member is made; every reader reads the shard
        paddle.pir.set_insertion_point_after(rp.ops[max(m.need.op for m in members)])
        sources = [rp.produced(m.need.value) for m in members]
    else:  # in front of the first update
        paddle.pir.set_insertion_point(read_site(state, rp, members[0])[0])
        sources = [rp.current(m.need.value) for m in members]
    readers = [{u.id() for u in source.all_used_ops()} for source in sources]
    sizes = [_sizes(m, group) for m in members]
    moved = members[0].plan.dtype  # (gradients reduced in another dtype: Strategy.reduce_dtype)
    cast = [cast_to(x, moved) for x in sources]
    rows = [_rank_rows(x, m, m.need.have, m.need.need, rp.rank, group) for x, m in zip(cast, members)]
    numels = [math.prod(state.graph.values[key].shape) for key in riders]
    for key, numel in zip(riders, numels):  # row 0: the local value; the others' rows zeros
        value = paddle._C_ops.reshape(rp.produced(key), [1, numel])
        zeros = paddle._C_ops.full([len(group) - 1, numel], 0.0, value.dtype, paddle.CPUPlace())
        rows.append(paddle._C_ops.concat([value, zeros], 0))
    flat = paddle._C_ops.reshape(paddle._C_ops.concat(rows, 1), [-1])  # rank-major: row i holds rank i's shards
    mine = _record(state, rp, bucket, flat, group, step, riders)
    own = group.index(rp.rank)
    split = paddle._C_ops.split(mine, [max(s) for s in sizes] + numels, 0)
    carried = list(split[len(members) :])
    for member, flat, size, source, old in zip(members, split, sizes, sources, readers):
        local = member.need.need.local_shape(member.plan.shape, rp.rank)
        value = paddle._C_ops.slice(flat, [0], [0], [size[own]], [1], []) if size[own] != max(size) else flat
        value = cast_to(paddle._C_ops.reshape(value, list(local)), state.graph.values[member.need.value].dtype)
        if after:
            replace_uses(source, value, {u.id() for u in source.all_used_ops()} - old)  # (not the pieces cut here)
            rp.final[member.need.value] = value
        else:
            consumer, slot = read_site(state, rp, member)
            consumer.operand(slot).set_source(value)
        rp.resharded[member.index] = value
    return carried


def _emit_gather(
    state: CompileState, rp: RankProgram, bucket: ZeroBucket, members: list[PlannedReshard], riders: list[tuple[ValueKey, Any]]
) -> None:
    """The bucket's all_gather on ``rp``; each rider's piece (from the reduce_scatter) rides
    along and its first rank's copy is the whole fetched value."""
    import paddle

    step = members[0].plan.steps[0]
    group = step.group_of(rp.rank)
    paddle.pir.set_insertion_point_after(rp.ops[max(m.need.op for m in members)])
    sizes = [_sizes(m, group) for m in members]
    own = group.index(rp.rank)
    parts = [_padded(rp.value(m.need.value), sizes[j][own], max(sizes[j])) for j, m in enumerate(members)]
    parts += [piece for _, piece in riders]
    numels = [math.prod(state.graph.values[key].shape) for key, _ in riders]
    gathered = _record(state, rp, bucket, paddle._C_ops.concat(parts, 0), group, step, [key for key, _ in riders])
    by_member = paddle._C_ops.split(paddle._C_ops.reshape(gathered, [len(group), -1]), [max(s) for s in sizes] + numels, 1)
    for (key, _), rows in zip(riders, by_member[len(members) :]):  # the sum is the first rank's
        first = paddle._C_ops.slice(rows, [0], [0], [1], [1], [])
        rp.fetched[key] = paddle._C_ops.reshape(first, list(state.graph.values[key].shape))
    for member, size, rows in zip(members, sizes, by_member):
        sharded, whole = member.need.have, member.need.need
        shape = member.plan.shape
        if _in_blocks(whole, sharded, shape, rp.rank, group):
            full = paddle._C_ops.reshape(rows, list(whole.local_shape(shape, rp.rank)))  # (rows: [ranks, shard])
        else:  # cut each rank's shard out of its row, unpad, and join them along the split dim
            axis = next(t for t in range(len(shape)) if sharded.mapping[t] != whole.mapping[t])
            shards = []
            for i, r in enumerate(group):
                flat = paddle._C_ops.slice(rows, [0, 1], [i, 0], [i + 1, size[i]], [1, 1], [])
                shards.append(paddle._C_ops.reshape(flat, list(sharded.local_shape(shape, r))))
            full = paddle._C_ops.concat(shards, axis)
        target = rp.value(state.graph.ops[member.need.op].inputs[member.need.site.slot])
        paddle._C_ops.assign_out_(full, target)
