"""Reshard planner: the cheapest steps from one placement to another (stage: plan reshards).

A *state* is a placement of the tensor on a mesh (a :class:`DistAttr`). An *edge* is one step
over a set of mesh dims ``D`` (each step runs concurrently in every group ``mesh.groups(D)``):

- ``all_reduce``: ``P(k)`` on every dim of D -> ``R``;
- ``reduce_scatter``: ``P(k)`` -> ``S(t)`` (never all_reduce + slice: it moves less);
- ``all_gather``: ``S(t)`` -> ``R``;  ``all_to_all``: ``S(t)`` -> ``S(u)`` on the same dims;
- ``slice``: ``R`` -> ``S(t)``, local;  ``make_partial``: ``R`` -> ``P(k)``, local (sum: every
  rank but the group's first zeroes its copy; avg/max/min: every rank keeps its copy).

An edge exists only if every rank's new piece can be built from what its group holds, checked
on the concrete ``numpy.array_split`` bounds: with uneven shards, splitting a split dim
further only nests when the bounds nest, and a multi-dim split must be undone over the
combined group. Dijkstra over these states, with edge costs from :mod:`comm` quantized to
picoseconds (+1 ps per step) and ties broken by fewer steps, gives the plan; an identity
reshard is empty.

Different meshes (pipeline stages): reshard on the source mesh to some placement X, send each
rank's piece to the rank at the same mesh coordinate of the destination mesh (same mesh shape
only), reshard there. X is chosen over every placement; the fallback for any pair of meshes
goes through Replicate: send_recv of the whole tensor to every destination rank, or to one
followed by a broadcast, whichever is cheaper.

``bytes`` of a step is its nccl-tests *size* on the rank where it is largest: the all_reduce /
broadcast buffer, the all_gather output, the reduce_scatter input, the all_to_all send buffer,
the send_recv message, the slice's output, the make_partial's zeroed buffer. ``time`` is the
predicted seconds of the step (the slowest group); ``plan.time`` is the sum over steps.
Reductions use the partial's kind; ``avg`` is a sum followed by a scale by 1/|group|.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from autopar.collective import CollectiveKind
from autopar.collective_kinds import kind_of, moves_from, point_to_point, step_kinds
from autopar.cost_model import comm
from autopar.cost_model.cluster import Cluster, default_cluster, dtype_bytes
from autopar.dist_attr import DistAttr
from autopar.errors import CostModelError
from autopar.mesh import ProcessMesh
from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.units import format_bytes, format_time  # noqa: F401  (re-exported: cost_model.planner.format_*)

STEP_KINDS = step_kinds()  # the kinds a plan step can have, from the table (autopar/collective_kinds.py)
_PS = 1e12  # search costs are integer picoseconds: exact sums, exact ties

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective or local step of a plan; enough to emit the op without re-deriving it.

    ``mesh_dims``: the mesh dims of ``src.mesh`` the step runs along (() for send_recv);
    ``groups``: the rank groups (send_recv: ``(from, to)`` pairs; broadcast: root first);
    ``tensor_dims``: gathered / scattered / sliced tensor dim, ``(from, to)`` for all_to_all;
    ``reduce``: the reduction of all_reduce / reduce_scatter / make_partial; ``shift``: a
    permute's ring shift (:func:`plan_ring_shift`).
    """

    kind: CollectiveKind
    mesh_dims: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    bytes: int
    time: float
    src: DistAttr
    dst: DistAttr
    tensor_dims: tuple[int, ...] = ()
    reduce: str | None = None
    shift: int = 0  # permute: each rank's piece goes to the rank ``shift`` places on in its group

    def __post_init__(self) -> None:
        if not isinstance(self.kind, CollectiveKind):
            object.__setattr__(self, "kind", CollectiveKind(self.kind))

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The group ``rank`` takes part in (None: the step does not involve it)."""
        if point_to_point(self.kind):
            return next((g for g in self.groups if rank in g), None)
        if not self.groups:
            return None
        if rank not in self.src.mesh.ranks:
            return None
        return group_at(self.src.mesh, rank, self.mesh_dims)

    def __str__(self) -> str:
        names = "/".join(self.src.mesh.dim_names[d] for d in self.mesh_dims)
        where = f"{names} over ranks " if names else ""
        group = ",".join(map(str, self.groups[0])) if self.groups else ""
        more = f" (+{len(self.groups) - 1} groups)" if len(self.groups) > 1 else ""
        op = f"{self.kind}[{self.reduce}]" if self.reduce and self.reduce != "sum" else self.kind
        meshes = "" if self.src.mesh == self.dst.mesh else f" {self.src.mesh} -> {self.dst.mesh}"
        return f"{op}({where}({group}){more}, {format_bytes(self.bytes)}, {format_time(self.time)}): {self.src} -> {self.dst}{meshes}"


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """Steps from ``src`` to ``dst`` for a tensor of ``shape`` and ``dtype``; ``time`` = sum of steps."""

    src: DistAttr
    dst: DistAttr
    shape: tuple[int, ...]
    dtype: str
    steps: tuple[ReshardStep, ...]

    @property
    def time(self) -> float:
        return sum(step.time for step in self.steps)

    @property
    def bytes(self) -> int:
        return sum(step.bytes for step in self.steps if not step.kind.is_local)

    def kinds(self) -> list[str]:
        return [step.kind for step in self.steps]

    def __str__(self) -> str:
        head = f"reshard {self.dtype}{list(self.shape)} {self.src} -> {self.dst}: {format_time(self.time)}"
        return "\n".join([head, *(f"  {step}" for step in self.steps)]) if self.steps else head + " (identity)"


@lru_cache(maxsize=4096)
def mesh_groups(mesh: ProcessMesh, mesh_dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``mesh.groups(mesh_dims)``, computed once per mesh (edges of every plan ask for it)."""
    return tuple(mesh.groups(list(mesh_dims)))


def group_at(mesh: ProcessMesh, rank: int, mesh_dims: Sequence[int]) -> tuple[int, ...]:
    """The group along ``mesh_dims`` holding ``rank``, in group order (without listing every group)."""
    return _group_at(mesh, rank, tuple(mesh_dims))


@lru_cache(maxsize=1 << 16)
def _group_at(mesh: ProcessMesh, rank: int, mesh_dims: tuple[int, ...]) -> tuple[int, ...]:
    """(Cached: a search asks the same meshes for the same ranks' groups across candidates.)"""
    coord = list(mesh.coordinate(rank))
    group = []
    for inner in itertools.product(*(range(mesh.shape[d]) for d in mesh_dims)):
        for d, i in zip(mesh_dims, inner):
            coord[d] = i
        group.append(mesh.rank_at(coord))
    return tuple(group)


# ---- the problem: one mesh, one tensor ------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Problem:
    mesh: ProcessMesh
    shape: tuple[int, ...]
    itemsize: int
    kinds: tuple[str, ...]  # partial kinds a state may carry
    cluster: Cluster


def _split_dims(*attrs: DistAttr) -> tuple[int, ...]:
    """The mesh dims splitting a tensor dim in any of ``attrs`` (a rank's piece depends on its
    coordinates along these alone)."""
    return tuple(sorted({d for attr in attrs for dims in attr.mapping for d in dims}))


def _representatives(mesh: ProcessMesh, dims: tuple[int, ...]) -> tuple[int, ...]:
    """One rank per coordinate along ``dims`` (0 along the others: the group along ``dims`` of
    the mesh's first rank): under placements split only along ``dims``, every rank holds the
    pieces of its representative, so a check of pieces need not visit every rank (1536 ranks of
    8 x 8 x 24: 64 along mp x pp)."""
    return _group_at(mesh, mesh.rank_at([0] * mesh.ndim), dims)


@lru_cache(maxsize=1 << 18)
def _box(attr: DistAttr, shape: tuple[int, ...], rank: int) -> Box:
    return tuple((s.start, s.stop) for s in attr.local_slices(shape, rank))


def _piece_bytes(p: _Problem, attr: DistAttr) -> int:
    ranks = _representatives(attr.mesh, _split_dims(attr))
    return max(math.prod(b - a for a, b in _box(attr, p.shape, r)) for r in ranks) * p.itemsize


def _assignment(attr: DistAttr) -> list[Placement]:
    """Per mesh dim its placement, the split order aside (``Shard(t)``: one of t's splits)."""
    out: list[Placement] = [Replicate()] * attr.mesh.ndim
    for t, dims in enumerate(attr.mapping):
        for d in dims:
            out[d] = Shard(t)
    for d, kind in attr.partial:
        out[d] = Partial(kind)
    return out


def _moved(attr: DistAttr, dims: tuple[int, ...], target: Placement) -> DistAttr:
    """``attr`` with the mesh dims ``dims`` taken out of where they are and given ``target``.

    Edits the mapping, never rebuilds it: every other mesh dim keeps its place and order, and
    ``Shard(t)`` appends ``dims`` innermost to t in the order given (the step's group order,
    so that group position = piece index).
    """
    mapping = [tuple(d for d in m if d not in dims) for m in attr.mapping]
    partial = {d: k for d, k in attr.partial if d not in dims}
    if isinstance(target, Shard):
        mapping[target.dim] += dims
    elif isinstance(target, Partial):
        partial.update(dict.fromkeys(dims, target.reduce))
    return DistAttr.of(attr.mesh, tuple(mapping), tuple(sorted(partial.items())))


def _contained(p: _Problem, new: DistAttr, old: DistAttr) -> bool:
    """Every rank's new piece lies inside its old piece (slice, reduce_scatter)."""
    ranks = _representatives(p.mesh, _split_dims(new, old))
    return all(
        all(oa <= na and nz <= oz for (na, nz), (oa, oz) in zip(_box(new, p.shape, r), _box(old, p.shape, r)))
        for r in ranks
    )  # fmt: skip


def _gathered(p: _Problem, new: DistAttr, old: DistAttr, dims: tuple[int, ...], t: int) -> bool:
    """Every rank's new piece along ``t`` is exactly its group's old pieces concatenated in group
    order (all_gather, all_to_all), and lies inside its old piece along every other dim."""
    others = [i for i in range(len(p.shape)) if i != t]
    outside = tuple(d for d in _split_dims(new, old) if d not in dims)
    for first in _representatives(p.mesh, outside):  # one group per coordinate outside ``dims``
        group = _group_at(p.mesh, first, dims)
        pieces = [_box(old, p.shape, g) for g in group]
        along = [piece[t] for piece in pieces]
        made = [_box(new, p.shape, r) for r in group]
        if not all(_concatenates(along, bounds) for bounds in {mine[t] for mine in made}):
            return False
        for had, mine in zip(pieces, made):
            if any(not (had[i][0] <= mine[i][0] and mine[i][1] <= had[i][1]) for i in others):
                return False
    return True


def _concatenates(pieces: list[tuple[int, int]], bounds: tuple[int, int]) -> bool:
    """The non-empty ``pieces``, in group order, tile ``bounds`` exactly (a concat in group order)."""
    at, stop = bounds
    for lo, hi in pieces:
        if hi > lo:
            if lo != at:
                return False
            at = hi
    return at == stop


def _step(p: _Problem, kind: CollectiveKind, dims: tuple[int, ...], src: DistAttr, dst: DistAttr, **extra) -> ReshardStep:
    groups = mesh_groups(p.mesh, dims)
    entry = kind_of(kind)
    nbytes = _piece_bytes(p, src if entry.sized_by_input else dst)  # (all_gather, slice, make_partial: their output)
    if CollectiveKind(kind).is_local:
        nbytes, time = entry.local_time(nbytes, extra.get("reduce"), p.cluster)
    else:
        time = comm.groups_time(kind, groups, nbytes, p.cluster)
    return ReshardStep(kind, dims, groups, int(nbytes), time, src, dst, **extra)


def _edges(p: _Problem, attr: DistAttr) -> list[ReshardStep]:
    """Every valid single step out of ``attr`` (deterministic order)."""
    return list(_edges_cached(p, attr))


@lru_cache(maxsize=65536)
def _edges_cached(p: _Problem, attr: DistAttr) -> tuple[ReshardStep, ...]:
    assign = _assignment(attr)
    out: list[ReshardStep] = []
    for size in range(1, p.mesh.ndim + 1):
        for dims in itertools.combinations(range(p.mesh.ndim), size):
            items = {assign[d] for d in dims}
            if len(items) != 1:
                continue
            (item,) = items
            if isinstance(item, Partial):
                out += _partial_edges(p, attr, dims, item.reduce)
            elif isinstance(item, Shard):
                out += _shard_edges(p, attr, dims, item.dim)
            else:
                out += _replicate_edges(p, attr, dims)
    return tuple(out)


def _partial_edges(p: _Problem, attr: DistAttr, dims: tuple[int, ...], kind: str) -> list[ReshardStep]:
    """The table's moves out of ``Partial(kind)`` over ``dims`` (all_reduce; reduce_scatter onto
    any tensor dim, the new splits innermost in any order)."""
    out = []
    for step_kind, target in moves_from(Partial):
        if target is Replicate:
            out.append(_step(p, step_kind, dims, attr, _moved(attr, dims, Replicate()), reduce=kind))
        elif target is Shard:
            out += _split_onto(p, attr, dims, step_kind, reduce=kind)
    return out


def _shard_edges(p: _Problem, attr: DistAttr, dims: tuple[int, ...], t: int) -> list[ReshardStep]:
    """The table's moves out of t's splits over ``dims`` (all_gather; all_to_all onto another
    tensor dim): the group runs in t's split order."""
    order = tuple(d for d in attr.mapping[t] if d in dims)
    out = []
    for step_kind, target in moves_from(Shard):
        if target is Replicate:
            new = _moved(attr, order, Replicate())
            if _gathered(p, new, attr, order, t):
                out.append(_step(p, step_kind, order, attr, new, tensor_dims=(t,)))
        elif target is Shard:
            for u in range(len(p.shape)):
                new = _moved(attr, order, Shard(u))
                if u != t and _gathered(p, new, attr, order, t):
                    out.append(_step(p, step_kind, order, attr, new, tensor_dims=(t, u)))
    return out


def _replicate_edges(p: _Problem, attr: DistAttr, dims: tuple[int, ...]) -> list[ReshardStep]:
    """The table's moves out of whole copies over ``dims`` (slice onto any tensor dim, the new
    splits innermost in any order; make_partial)."""
    out = []
    for step_kind, target in moves_from(Replicate):
        if target is Shard:
            out += _split_onto(p, attr, dims, step_kind)
        elif target is Partial:
            for kind in (k for k in p.kinds if _can_add_partial(attr, k)):
                out.append(_step(p, step_kind, dims, attr, _moved(attr, dims, Partial(kind)), reduce=kind))
    return out


def _split_onto(p: _Problem, attr: DistAttr, dims: tuple[int, ...], kind: CollectiveKind, reduce: str | None = None) -> list[ReshardStep]:
    """Steps of ``kind`` splitting any tensor dim over ``dims`` (innermost, in any order) where each
    rank's new piece lies inside what it holds (slice, reduce_scatter)."""
    out = []
    for t in range(len(p.shape)):
        for order in itertools.permutations(dims):
            new = _moved(attr, order, Shard(t))
            if _contained(p, new, attr):
                extra = {"reduce": reduce} if reduce is not None else {}
                out.append(_step(p, kind, order, attr, new, tensor_dims=(t,), **extra))
    return out


def _can_add_partial(attr: DistAttr, kind: str) -> bool:
    """A pending ``kind`` may join the placement's pending reductions if they reduce alike, or
    all are linear (sum and avg commute: their order of reduction does not matter)."""
    kinds = set(attr.partial_dims.values()) | {kind}
    return len(kinds) == 1 or kinds <= {"sum", "avg"}


def _cost(step: ReshardStep) -> int:
    """Search cost of a step: integer picoseconds, plus 1 ps per step so that a rounding
    difference never lets more steps beat fewer at an equal time (RS + AG vs a ring all_reduce)."""
    return round(step.time * _PS) + 1


def _shortest(p: _Problem, src: DistAttr, dst: DistAttr) -> tuple[ReshardStep, ...]:
    """Dijkstra on (picoseconds, steps); deterministic: ties keep the first path found."""
    if src == dst:
        return ()
    best: dict[DistAttr, tuple[int, int]] = {src: (0, 0)}
    back: dict[DistAttr, ReshardStep] = {}
    order = itertools.count()
    heap = [(0, 0, next(order), src)]
    done: set[DistAttr] = set()
    while heap:
        cost, nsteps, _, state = heapq.heappop(heap)
        if state in done:
            continue
        if state == dst:
            break
        done.add(state)
        for step in _edges(p, state):
            key = (cost + _cost(step), nsteps + 1)
            if step.dst not in done and key < best.get(step.dst, (math.inf, math.inf)):
                best[step.dst] = key
                back[step.dst] = step
                heapq.heappush(heap, (*key, next(order), step.dst))
    if dst not in back:
        raise CostModelError(f"no reshard path from {src} to {dst} (planner bug: Replicate always reaches)")
    steps = []
    state = dst
    while state != src:
        steps.append(back[state])
        state = back[state].src
    return tuple(reversed(steps))


# ---- public entry points ----------------------------------------------------------------


def plan_reshard(
    src: DistAttr, dst: DistAttr, shape: Sequence[int], dtype: str = "float32", cluster: Cluster | None = None
) -> ReshardPlan:
    """The cheapest plan from ``src`` to ``dst`` for a tensor of global ``shape`` and ``dtype``.

    ``cluster`` defaults to the shipped profile for the hardware in use (``cpu-gloo`` without a
    visible GPU, see :func:`~autopar.cost_model.cluster.hardware_profile`), grown to as many
    nodes as the meshes need. Pure and deterministic; results are cached on the (frozen) inputs.
    """
    try:
        return _planned(src, dst, tuple(shape), dtype, cluster)
    except TypeError:  # an unhashable or non-sequence argument: said by name
        _check(src, dst, shape, dtype, cluster)
        raise


@lru_cache(maxsize=1 << 15)
def _planned(src: DistAttr, dst: DistAttr, shape: tuple, dtype: str, cluster: Cluster | None) -> ReshardPlan:
    """:func:`plan_reshard` once per distinct call: a compile asks for the same few reshards
    thousands of times (the layers repeat), and the check and the defaults cost as much as
    the cached plan's lookup."""
    shape_t = _check(src, dst, shape, dtype, cluster)
    if cluster is None:
        cluster = default_cluster().fitted(src.mesh.ranks + dst.mesh.ranks)
    return _plan_cached(src, dst, shape_t, str(dtype).removeprefix("paddle."), cluster)


def all_reduce_plan(
    src: DistAttr, dst: DistAttr, shape: Sequence[int], dtype: str = "float32", cluster: Cluster | None = None,
    zeroed: Sequence[int] = (),
) -> ReshardPlan | None:  # fmt: skip
    """``src -> dst`` as one all_reduce over the mesh dims whose pending reduction ``dst`` drops,
    priced like a planned step; None when ``dst`` is not ``src`` with those dims replicated (or
    they reduce differently). ``zeroed``: replicated mesh dims (of both) made a pending sum
    first (make_partial: every copy but the group's first zeroed), so that the all_reduce runs
    over them too — what the planner does on a profile whose sub-groups are slow.

    Fusion (passes/allreduce_fusion.py) weighs it against the cheapest plan: on ``cpu-gloo`` the
    cheapest single reshard of a dp x mp gradient may be a world all_reduce (make_partial over
    mp first), yet one bucket over dp beats several of those.
    """
    shape_t = _check(src, dst, shape, dtype, cluster)
    dropped = {d: k for d, k in src.partial if d not in dst.partial_dims}
    kinds = set(dropped.values())
    same_split = src.mesh == dst.mesh and src.mapping == dst.mapping and set(dst.partial) <= set(src.partial)
    if not same_split or len(kinds) != 1:
        return None
    (kind,) = kinds
    zeroed = tuple(sorted(set(zeroed)))
    busy = src.sharded_mesh_dims() | set(src.partial_dims) | set(dst.partial_dims)
    if zeroed and (kind != "sum" or busy & set(zeroed)):
        return None
    if cluster is None:
        cluster = default_cluster().fitted(src.mesh.ranks)
    problem = _Problem(src.mesh, shape_t, dtype_bytes(dtype), tuple(sorted(set(src.partial_dims.values()))), cluster)
    steps, before = [], src
    if zeroed:
        before = _moved(src, zeroed, Partial(kind))
        steps.append(_step(problem, CollectiveKind.MAKE_PARTIAL, zeroed, src, before, reduce=kind))
    steps.append(_step(problem, CollectiveKind.ALL_REDUCE, tuple(sorted({*dropped, *zeroed})), before, dst, reduce=kind))
    return ReshardPlan(src, dst, shape_t, str(dtype).removeprefix("paddle."), tuple(steps))


def _check(src: DistAttr, dst: DistAttr, shape: Sequence[int], dtype: str, cluster: Cluster | None) -> tuple[int, ...]:
    for name, attr in (("src", src), ("dst", dst)):
        if not isinstance(attr, DistAttr):
            raise CostModelError(f"{name} must be an autopar.DistAttr, got {type(attr).__name__}")
    try:
        shape_t = tuple(int(s) for s in shape)
    except (TypeError, ValueError) as err:
        raise CostModelError(f"shape must be a sequence of ints, got {shape!r}") from err
    if any(s < 0 for s in shape_t):
        raise CostModelError(f"shape {list(shape_t)} has a negative dim")
    for name, attr in (("src", src), ("dst", dst)):
        if attr.ndim != len(shape_t):
            raise CostModelError(
                f"{name}.dims_mapping {attr.dims_mapping_text} has {attr.ndim} entries, shape {list(shape_t)} has {len(shape_t)} dims"
            )
    dtype_bytes(dtype)
    if cluster is not None:
        for name, attr in (("src", src), ("dst", dst)):
            if max(attr.mesh.ranks) >= cluster.world_size:
                raise CostModelError(f"{name}.mesh {attr.mesh} does not fit {cluster} ({cluster.world_size} devices)")
    return shape_t


@lru_cache(maxsize=1 << 15)
def _plan_cached(src: DistAttr, dst: DistAttr, shape: tuple[int, ...], dtype: str, cluster: Cluster) -> ReshardPlan:
    offset = _node_offset(src.mesh, dst.mesh, cluster)
    if offset:  # planned where the meshes start on node 0, then moved back
        return _shifted_plan(_plan_cached(_shifted(src, -offset), _shifted(dst, -offset), shape, dtype, cluster), offset)
    return _plan_here(src, dst, shape, dtype, cluster)


def _plan_here(src: DistAttr, dst: DistAttr, shape: tuple[int, ...], dtype: str, cluster: Cluster) -> ReshardPlan:
    """The plan on the meshes as they are (:func:`_plan_cached` first moves them to node 0)."""
    kinds = tuple(sorted(set(src.partial_dims.values()) | set(dst.partial_dims.values())))
    if src.mesh == dst.mesh:
        problem = _Problem(src.mesh, shape, dtype_bytes(dtype), kinds, cluster)
        return ReshardPlan(src, dst, shape, dtype, _shortest(problem, src, dst))
    return ReshardPlan(src, dst, shape, dtype, _plan_cross(src, dst, shape, dtype, kinds, cluster))


def _node_offset(a: ProcessMesh, b: ProcessMesh, cluster: Cluster) -> int:
    """The first rank of the node holding the meshes' lowest rank. A plan moved by whole nodes
    costs the same (rank ``r`` lives on node ``r // devices_per_node``, every node alike), so
    one plan serves every pipeline stage's copy of a reshard: planned once where the meshes
    start on node 0 (a 64-stage pipeline: once, not 64 times)."""
    first = min(min(a.ranks), min(b.ranks))
    return first - first % cluster.devices_per_node


@lru_cache(maxsize=1 << 12)
def _shifted_mesh(mesh: ProcessMesh, offset: int) -> ProcessMesh:
    return ProcessMesh(shape=mesh.shape, ranks=[r + offset for r in mesh.ranks], dim_names=mesh.dim_names)


def _shifted(attr: DistAttr, offset: int) -> DistAttr:
    return DistAttr.of(_shifted_mesh(attr.mesh, offset), attr.mapping, attr.partial)


def _shifted_plan(plan: ReshardPlan, offset: int) -> ReshardPlan:
    """``plan`` with every rank moved by ``offset``."""
    steps = tuple(
        dataclasses.replace(
            step, groups=tuple(tuple(r + offset for r in g) for g in step.groups), src=_shifted(step.src, offset),
            dst=_shifted(step.dst, offset),
        )
        for step in plan.steps
    )  # fmt: skip
    return ReshardPlan(_shifted(plan.src, offset), _shifted(plan.dst, offset), plan.shape, plan.dtype, steps)


def _plan_cross(
    src: DistAttr, dst: DistAttr, shape: tuple[int, ...], dtype: str, kinds: tuple[str, ...], cluster: Cluster
) -> tuple[ReshardStep, ...]:
    itemsize = dtype_bytes(dtype)
    here = _Problem(src.mesh, shape, itemsize, kinds, cluster)
    there = _Problem(dst.mesh, shape, itemsize, kinds, cluster)
    held = _held(src, dst, shape)
    if held is not None:  # every destination rank already holds its piece: local steps only
        return _shortest(there, held, dst)
    options: list[tuple[ReshardStep, ...]] = []
    if src.mesh.shape == dst.mesh.shape:
        for assign in itertools.product(*(_choices(len(shape), kinds) for _ in range(src.mesh.ndim))):
            x = DistAttr.from_placements(src.mesh, assign, len(shape))
            x_there = DistAttr(dst.mesh, x.mapping, x.partial)
            pairs = tuple(zip(src.mesh.ranks, dst.mesh.ranks))
            move = _send(here, x, x_there, pairs)
            options.append(_shortest(here, src, x) + (move,) + _shortest(there, x_there, dst))
    whole_here = DistAttr.replicated(src.mesh, len(shape))
    whole_there = DistAttr.replicated(dst.mesh, len(shape))
    before, after = _shortest(here, src, whole_here), _shortest(there, whole_there, dst)
    senders = src.mesh.ranks
    direct = tuple((senders[j % len(senders)], r) for j, r in enumerate(dst.mesh.ranks))
    options.append(before + (_send(here, whole_here, whole_there, direct),) + after)
    root = dst.mesh.ranks[0]
    first = _send(here, whole_here, whole_there, ((senders[0], root),))
    nbytes = first.bytes
    spread = ReshardStep(
        CollectiveKind.BROADCAST, tuple(range(dst.mesh.ndim)), (dst.mesh.ranks,), nbytes,
        comm.collective_time(CollectiveKind.BROADCAST, dst.mesh.ranks, nbytes, cluster), whole_there, whole_there,
    )  # fmt: skip
    options.append(before + (first, spread) + after)
    return min(options, key=lambda steps: (sum(_cost(s) for s in steps), len(steps)))


def _held(src: DistAttr, dst: DistAttr, shape: tuple[int, ...]) -> DistAttr | None:
    """``src`` re-expressed on ``dst.mesh`` when that mesh is inside ``src.mesh`` and each of its
    ranks holds the same piece under both (a stage reading a value replicated over the whole
    mesh, or split along a dim the stage shares); None otherwise."""
    if not set(dst.mesh.ranks) <= set(src.mesh.ranks):
        return None
    names = {name: d for d, name in enumerate(dst.mesh.dim_names)}

    def moved(d: int) -> int | None:
        there = names.get(src.mesh.dim_names[d])
        return there if there is not None and dst.mesh.shape[there] == src.mesh.shape[d] else None

    used = [d for dims in src.mapping for d in dims] + [d for d, _ in src.partial]
    if any(moved(d) is None for d in used):
        return None
    mapping = tuple(tuple(moved(d) for d in dims) for dims in src.mapping)
    partial = tuple(sorted((moved(d), kind) for d, kind in src.partial))
    held = DistAttr.of(dst.mesh, mapping, partial)
    for rank in dst.mesh.ranks:
        if held.local_slices(shape, rank) != src.local_slices(shape, rank):
            return None
        here, there = src.mesh.coordinate(rank), dst.mesh.coordinate(rank)
        if any(here[d] != there[moved(d)] for d, _ in src.partial):
            return None
    return held


def _choices(ndim: int, kinds: tuple[str, ...]) -> list[Placement]:
    return [Replicate(), *(Shard(t) for t in range(ndim)), *(Partial(k) for k in kinds)]


def _send(p: _Problem, src: DistAttr, dst: DistAttr, pairs: tuple[tuple[int, int], ...]) -> ReshardStep:
    """Point-to-point moves of each piece; a sender with several receivers sends in turn."""
    nbytes = _piece_bytes(p, src)
    moving = tuple(pair for pair in pairs if pair[0] != pair[1])
    per_sender: dict[int, float] = {}
    for a, b in moving:
        per_sender[a] = per_sender.get(a, 0.0) + comm.collective_time(CollectiveKind.SEND_RECV, (a, b), nbytes, p.cluster)
    return ReshardStep(CollectiveKind.SEND_RECV, (), moving, nbytes, max(per_sender.values(), default=0.0), src, dst)


def plan_ring_shift(
    attr: DistAttr, mesh_dim: int, shape: Sequence[int], dtype: str = "float32", cluster: Cluster | None = None
) -> ReshardStep:
    """One ring shift of a value placed as ``attr`` along ``mesh_dim``: every group of that mesh
    dim passes each rank's piece on to the next rank (a ``permute``, shift 1; ring attention's
    key / value rotation). The placement stays ``attr`` (each rank then holds its neighbour's
    piece); priced by the table's formula for the largest piece (the groups run at once)."""
    if not 0 <= mesh_dim < attr.mesh.ndim:
        raise CostModelError(f"ring shift of {attr}: mesh dim {mesh_dim} is not a dim of {attr.mesh}")
    if cluster is None:
        cluster = default_cluster().fitted(attr.mesh.ranks)
    nbytes = max(math.prod(attr.local_shape(tuple(shape), r)) for r in attr.mesh.ranks) * dtype_bytes(dtype)
    groups = mesh_groups(attr.mesh, (mesh_dim,))
    time = comm.groups_time(CollectiveKind.PERMUTE, groups, nbytes, cluster)
    return ReshardStep(CollectiveKind.PERMUTE, (mesh_dim,), groups, int(nbytes), time, attr, attr, shift=1)
