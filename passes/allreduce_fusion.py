"""All-reduce fusion: the gradient all-reduces of a step become one per bucket (stage:
reshard-planned -> buckets-planned at compile; comm-inserted -> comm-fused per rank).

Data parallelism leaves one all-reduce per gradient in front of the optimizer (they fall out
of propagation). Each collective pays a launch latency, and on the host backend a program cut
and a Python round trip, so PyTorch DDP / Paddle fuse them into buckets.

Planning, from the planned reshards (values, the same on every rank): reshards read after the
last grad op (every gradient is complete there) whose plan is one all_reduce — maybe after a
make_partial, the planner's way to run a sub-group sum as an all_reduce over more ranks where
sub-groups are slow (cpu-gloo) — or could be, are packed in program order into buckets of at
most ``bucket_bytes``, one *form* per bucket (mesh, all_reduce dims, zeroed dims, reduction,
dtype); each bucket is priced as its form on the flat buffer. Two packings are priced and the
cheaper kept: each gradient on its own cheapest plan's form, or each on the direct all_reduce
over the dims it reduces (a dp x mp gradient replicated over mp then shares the dp bucket of
the mp-split ones), a rerouted gradient staying on its own plan where the bucket would cost
more than that. On a profile with native sub-groups (NCCL) both are the same. A gradient whose
own cheapest plan is the all_reduce decomposed (reduce_scatter + all_gather over the same dims:
a 1 MiB gradient on ``cpu-shm``, 4 processes) joins the bucket whatever that plan's price: the
decomposition is decided for the bucket, which is one all_reduce, so no gradient below the
bucket size pays collectives of its own (measured there, an MLP 512-512-256-10 on dp=4: the
step 8.0-9.0 ms with the gradient's own pair beside the bucket, 7.3-7.7 ms all in one
all_reduce, 9.8-11.7 ms with the whole bucket decomposed, which the profile prices cheapest). A gradient read
twice made complete (global-norm clipping: the norm, then the scaling before the optimizer) is
one reshard whose result the later read shares: the bucket serves both reads, so a bucket's
``members`` are its gradients' reshards followed by the reads sharing them (those move nothing
of their own).

Emission, per rank: each bucket becomes

    flatten each gradient -> concat -> (zero along ``zeroed`` but on the first rank) ->
    one all_reduce -> split -> reshape back

right before the first member's reader; a read sharing a member's reshard reads that
member's piece. The bytes moved stay the same; the number of collectives drops to one per
bucket, recorded once with the gradients it carries.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from autopar.causes import in_layer, layers_text, value_layer
from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import kind_of
from autopar.cost_model.planner import ReshardPlan, all_reduce_plan, group_at
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import Role
from autopar.mesh import ProcessMesh
from autopar.passes.base import CompileState, GradientBucket, GradientFusion, Pass, PlannedReshard, RankProgram
from autopar.passes.reshard_emission import cast_to, emit_collective, read_site
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

    def plan(self, state: CompileState) -> GradientFusion:
        candidates = _candidates(state)
        # every gradient on its own cheapest plan's form, or every one on the direct all_reduce
        # over the dims it reduces (where that does not pay, on its own plan): the cheaper
        own, direct = self._pack(state, candidates, "own"), self._pack(state, candidates, "direct")
        done = own if _total(state, candidates, own) < _total(state, candidates, direct) else direct
        done.sort(key=lambda b: b[0].planned.need.op)
        replaced = {m.planned.index: dataclasses.replace(m.planned, plan=m.plan) for b in done for m in b if m.rerouted}
        sharing: dict[int, list[PlannedReshard]] = {}
        for planned in state.reshards:
            if planned.shared_with is not None:
                sharing.setdefault(planned.shared_with, []).append(replaced.get(planned.index, planned))
        buckets = tuple(
            _bucket(state, number, bucket, [s for m in bucket for s in sharing.get(m.planned.index, ())])
            for number, bucket in enumerate(done)
        )
        return GradientFusion(buckets, replaced)

    def _pack(self, state: CompileState, candidates: list[Candidate], mode: str) -> list[list[Member]]:
        """Buckets of the candidates in ``mode`` ("own": each on its own plan's form; "direct":
        each on the direct all_reduce), in reader order, at most ``bucket_bytes`` each."""
        open_buckets: dict[Form, list[Member]] = {}
        done: list[list[Member]] = []
        for candidate in candidates:
            member = candidate.member(mode)
            if member is None:
                continue
            bucket = open_buckets.setdefault(member.form, [])
            if bucket and sum(m.bytes for m in bucket) + member.bytes > self.bucket_bytes:
                done.append(bucket)
                bucket = open_buckets[member.form] = []
            if bucket and member.planned.need.value[0] >= bucket[0].planned.need.op:
                continue  # made after the bucket's insertion point: leave it alone
            bucket.append(member)
        done.extend(open_buckets.values())
        return [kept for kept in (_worth_fusing(state, b) for b in done) if len(kept) > 1]

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


@dataclass(frozen=True, slots=True)
class Form:
    """How a bucket moves its flat buffer: along ``zeroed`` every copy but the group's first is
    zeroed (make_partial, local), then one all_reduce over ``mesh_dims``."""

    mesh: ProcessMesh
    mesh_dims: tuple[int, ...]
    zeroed: tuple[int, ...]
    reduce: str
    dtype: str


def form_of(plan: ReshardPlan) -> Form | None:
    """The bucket form of a plan that is one all_reduce, maybe after a make_partial (None: another)."""
    steps, entries = plan.steps, [kind_of(step.kind) for step in plan.steps]
    if len(entries) == 1 and entries[0].gradient_sync:
        zeroed: tuple[int, ...] = ()
    elif len(entries) == 2 and entries[0].makes_partial and entries[1].gradient_sync and steps[0].reduce == steps[1].reduce == "sum":
        zeroed = tuple(sorted(steps[0].mesh_dims))
    else:
        return None
    return Form(plan.src.mesh, tuple(sorted(steps[-1].mesh_dims)), zeroed, steps[-1].reduce or "sum", plan.dtype)


@dataclass(frozen=True)
class Member:
    """A gradient reshard as a bucket member: ``plan`` (of ``form``) is what the bucket does for it;
    ``rerouted`` when that is not its own cheapest plan (kept only where it pays, unless its own
    plan is this all_reduce decomposed)."""

    planned: PlannedReshard
    plan: ReshardPlan
    form: Form

    @property
    def rerouted(self) -> bool:
        return self.plan is not self.planned.plan

    @property
    def decomposed(self) -> bool:
        """Its own plan is this all_reduce as a reduce_scatter then an all_gather."""
        return decomposes(self.planned.plan, self.plan)

    @property
    def bytes(self) -> int:
        return self.plan.steps[-1].bytes

    @cached_property
    def numel(self) -> int:
        """Elements of its local piece in the bucket's flat buffer (every rank's alike)."""
        need = self.planned.need.need
        return math.prod(need.local_shape(self.plan.shape, need.mesh.ranks[0]))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A gradient reshard that may join a bucket, on its own plan or on the direct all_reduce."""

    planned: PlannedReshard
    direct: ReshardPlan | None  # one all_reduce over the dims it reduces

    def member(self, mode: str) -> Member | None:
        plan = self.planned.plan if mode == "own" or self.direct is None else self.direct
        if self.direct is not None and decomposes(self.planned.plan, self.direct):
            plan = self.direct  # (the decomposition is the bucket's to decide: one all_reduce)
        form = form_of(plan)
        return Member(self.planned, plan, form) if form is not None else None


def decomposes(plan: ReshardPlan, all_reduce: ReshardPlan) -> bool:
    """Whether ``plan`` is ``all_reduce`` (one step) as a reduce_scatter then an all_gather over
    the same mesh dims."""
    kinds = tuple(step.kind for step in plan.steps)
    if len(all_reduce.steps) != 1 or not kinds or kinds != kind_of(all_reduce.steps[0].kind).decomposed:
        return False
    dims = set(all_reduce.steps[0].mesh_dims)
    return all(set(step.mesh_dims) == dims for step in plan.steps)


def _candidates(state: CompileState) -> list[Candidate]:
    """Reshards read after the last grad op whose plan is one all_reduce (maybe after a
    make_partial) or could be, in reader order (reads sharing an earlier reshard's result are
    not candidates: they follow it)."""
    start = gradients_complete(state)
    out = []
    for planned in state.reshards:
        need, plan = planned.need, planned.plan
        if need.site.kind is not SiteKind.BEFORE_READ or planned.shared_with is not None or need.op <= start:
            continue
        if form_of(plan) is not None and not form_of(plan).zeroed:
            out.append(Candidate(planned, plan))
            continue
        direct = all_reduce_plan(plan.src, plan.dst, plan.shape, plan.dtype, state.cluster) if plan.steps else None
        if direct is not None or form_of(plan) is not None:
            out.append(Candidate(planned, direct))
    return sorted(out, key=lambda c: (c.planned.need.op, c.planned.index))


def gradients_complete(state: CompileState) -> int:
    """The index of the last grad op: every gradient is complete once it has run; what follows
    (accumulation, clipping, the optimizer) only reads gradients. Not the last op of backward
    role: ops reading gradients count as backward, so clipping's reads would fall before it."""
    grad_ops = [op.index for op in state.graph.ops if op.role is Role.BACKWARD and op.short_name.endswith("_grad")]
    return max(grad_ops, default=len(state.graph.ops))


def _worth_fusing(state: CompileState, bucket: list[Member]) -> list[Member]:
    """``bucket`` without the rerouted members that cost less on their own plan than in the
    bucket (one at a time, in order, against the bucket as it stands); a member whose own plan
    is the all_reduce decomposed stays."""
    kept = list(bucket)
    for member in bucket:
        alone = _cost(state, [m for m in kept if m is not member]) + member.planned.plan.time
        if member.rerouted and not member.decomposed and alone < _cost(state, kept):
            kept.remove(member)
    return kept


def _cost(state: CompileState, members: list[Member]) -> float:
    """Predicted time of these reshards: one fused bucket, or a lone member's own plan."""
    if len(members) <= 1:
        return sum(m.planned.plan.time for m in members)
    return _flat_plan(state, members).time


def _total(state: CompileState, candidates: list[Candidate], buckets: list[list[Member]]) -> float:
    """Predicted time of every candidate: its bucket's, or its own plan's."""
    fused = {m.planned.index for b in buckets for m in b}
    alone = sum(c.planned.plan.time for c in candidates if c.planned.index not in fused)
    return alone + sum(_flat_plan(state, b).time for b in buckets)


def _flat_plan(state: CompileState, members: list[Member]) -> ReshardPlan:
    """The bucket's plan, as emitted: its form on the flat buffer of every member's local piece."""
    form = members[0].form
    numel = sum(m.numel for m in members)
    pending = tuple((d, form.reduce) for d in form.mesh_dims if d not in form.zeroed)
    src, dst = DistAttr.of(form.mesh, ((),), pending), DistAttr.of(form.mesh, ((),))
    return all_reduce_plan(src, dst, (numel,), form.dtype, state.cluster, zeroed=form.zeroed)


def _bucket(state: CompileState, number: int, members: list[Member], sharing: list[PlannedReshard]) -> GradientBucket:
    """The bucket of ``members`` (the reshards it moves); ``sharing``: later reads of their results."""
    form, plan = members[0].form, _flat_plan(state, members)
    names = ", ".join(state.label(m.planned.need.value) for m in members)
    over = "/".join(form.mesh.dim_names[d] for d in form.mesh_dims if d not in form.zeroed)
    layers = layers_text([value_layer(state.graph, m.planned.need.value) for m in members])
    return GradientBucket(
        index=number, members=tuple(m.planned.index for m in members) + tuple(s.index for s in sharing),
        mesh_dims=form.mesh_dims, reduce=form.reduce, src=plan.steps[-1].src, dtype=form.dtype, numel=plan.shape[0],
        bytes=int(sum(m.bytes for m in members)), time=plan.time, zeroed=form.zeroed,
        reason=f"{in_layer(f'gradient sync over {over}', layers)}: {len(members)} gradient all_reduces fused into one buffer: {names}",
    )  # fmt: skip


def emitted_ops(state: CompileState, bucket: GradientBucket, planned: list[PlannedReshard], rank: int) -> int:
    """How many ops :func:`_emit_bucket` adds to ``rank``'s program (what pricing counts: on a
    host each op costs its launch): the flattened gradients joined, maybe zeroed, all-reduced,
    split and shaped back."""
    members = [p for p in planned if p.shared_with is None]
    shaped = sum(1 for m in members if len(m.need.need.local_shape(m.plan.shape, rank)) != 1)
    zeroed = bool(bucket.zeroed) and rank != group_at(bucket.src.mesh, rank, bucket.zeroed)[0]
    # a gradient reduced in another dtype: cast there and back
    casts = sum(2 for m in members if state.graph.values[m.need.value].dtype != bucket.dtype)
    # concat 3, scale 2, all_reduce 1, split 4 (each with its constants); a gradient of several
    # dims flattened and shaped back: two reshapes of 2
    return 3 + 2 * zeroed + 1 + 4 + 4 * shaped + casts


def _emit_bucket(state: CompileState, rp: RankProgram, bucket: GradientBucket, planned: list[PlannedReshard]) -> None:
    import paddle

    members = [p for p in planned if p.shared_with is None]
    first_reader, _ = read_site(state, rp, members[0])
    paddle.pir.set_insertion_point(first_reader)
    inputs = [cast_to(rp.current(m.need.value), bucket.dtype) for m in members]  # (Strategy.reduce_dtype)
    shapes = [m.need.need.local_shape(m.plan.shape, rp.rank) for m in members]
    flat = paddle._C_ops.concat([x if len(s) == 1 else paddle._C_ops.reshape(x, [-1]) for x, s in zip(inputs, shapes)], 0)
    if bucket.zeroed and rp.rank != group_at(bucket.src.mesh, rp.rank, bucket.zeroed)[0]:
        flat = paddle._C_ops.scale(flat, 0.0, 0.0, True)  # make_partial: one copy along ``zeroed`` is summed
    group = group_at(bucket.src.mesh, rp.rank, bucket.mesh_dims)  # (a stage's sub-mesh under a pipeline)
    total = sum(math.prod(s) for s in shapes)
    collective = Collective(
        kind=CollectiveKind.ALL_REDUCE, group=group, key=CollectiveKey("bucket", bucket.index),
        value=f"bucket {bucket.index} ({len(members)} gradients)", src=bucket.src, dst=DistAttr.of(state.mesh, ((),)),
        shape=(total,), output_shape=(total,), bytes=bucket.bytes, time=bucket.time,
        reason=bucket.reason, reduce=bucket.reduce, dtype=bucket.dtype,
    )  # fmt: skip
    fused = emit_collective(state, rp, collective, flat, bucket.mesh_dims)
    pieces = paddle._C_ops.split(fused, [math.prod(s) for s in shapes], 0)
    dtypes = [state.graph.values[m.need.value].dtype for m in members]
    pieces = [cast_to(piece, dtype) for piece, dtype in zip(pieces, dtypes)]
    for member, piece, shape in zip(members, pieces, shapes):
        out = piece if len(shape) == 1 else paddle._C_ops.reshape(piece, list(shape))
        consumer, slot = read_site(state, rp, member)
        consumer.operand(slot).set_source(out)
        rp.resharded[member.index] = out
    for read in planned:
        if read.shared_with is not None:
            consumer, slot = read_site(state, rp, read)
            consumer.operand(slot).set_source(rp.resharded[read.shared_with])
