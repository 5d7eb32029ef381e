"""Planner optimality (hypothesis): meshes up to 2 x 4, random placements, even and uneven shapes.

- the plan's cost equals the brute-force minimum over every step sequence of length <= 4
  (the same steps the planner may take: each collective / local step over any set of mesh dims);
- it is never worse than going through Replicate (Paddle's strategy);
- the plan's time is the sum of its steps, and the steps chain src -> dst;
- a bigger tensor (evenly split) never costs less;
- applied to numpy pieces with the runtime's collective semantics (group order = piece
  order), every step leaves exactly the layout it names: the plan reproduces the value, and
  no state re-orders a multi-mesh-dim split silently (placements draw split orders at random).
"""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import Cluster, Device, Link, plan_reshard, shipped_profile
from autopar.cost_model.cluster import dtype_bytes
from autopar.cost_model.planner import ReshardPlan, _cost, _edges, _Problem
from autopar.dist_attr import shard_bounds
from autopar.pieces import REDUCERS, assemble, scatter

MESH_SHAPES = [(2,), (4,), (1, 2), (2, 2), (2, 4), (4, 2)]
# two nodes of 4 devices: on a 2 x 4 mesh the first mesh dim crosses nodes
TWO_NODES = Cluster("two-nodes", 2, 4, Link(2e-6, 2e11), Link(1e-5, 2.5e10), Device((("float32", 1e14),), 2e12, 8e10))
CLUSTERS = [TWO_NODES, shipped_profile("h100-node"), shipped_profile("cpu-gloo")]


@st.composite
def problems(draw, even=False):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    mesh = ProcessMesh(
        shape=mesh_shape, process_ids=range(math.prod(mesh_shape)), dim_names=[f"m{i}" for i in range(len(mesh_shape))]
    )
    ndim = draw(st.integers(1, 2))
    if even:
        shape = tuple(draw(st.integers(1, 3)) * mesh.size for _ in range(ndim))
    else:
        shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    kinds = draw(st.sampled_from([("sum",), ("max",), ("sum", "max")]))
    options = ["R", *(f"S({t})" for t in range(ndim)), *(f"P({k})" for k in kinds)]

    def placement():
        while True:
            text = "[" + ",".join(draw(st.sampled_from(options)) for _ in mesh_shape) + "]"
            attr = DistAttr.parse(text, mesh, ndim)
            if len(set(attr.partial_dims.values())) <= 1:  # one reduction kind per tensor
                return attr.with_mapping([tuple(draw(st.permutations(dims))) for dims in attr.mapping])

    return mesh, shape, placement(), placement(), draw(st.sampled_from(CLUSTERS))


def brute_force_min(problem, src, dst, depth=4):
    """Minimum cost over all step sequences of length <= depth (dynamic programming over lengths)."""
    best = {src: 0}
    frontier = {src: 0}
    for _ in range(depth):
        nxt = {}
        for state, cost in frontier.items():
            for step in _edges(problem, state):
                total = cost + _cost(step)
                if total < nxt.get(step.dst, math.inf):
                    nxt[step.dst] = total
        for state, cost in nxt.items():
            best[state] = min(best.get(state, math.inf), cost)
        frontier = nxt
    return best.get(dst)


def search_cost(plan):
    return sum(_cost(step) for step in plan.steps)


@given(problems())
def test_plan_is_optimal_and_consistent(case):
    mesh, shape, src, dst, cluster = case
    plan = plan_reshard(src, dst, shape, "float32", cluster)
    assert plan.time == sum(step.time for step in plan.steps)
    assert all(a.dst == b.src for a, b in zip(plan.steps, plan.steps[1:]))
    if plan.steps:
        assert plan.steps[0].src == src and plan.steps[-1].dst == dst
    kinds = tuple(sorted(set(src.partial_dims.values()) | set(dst.partial_dims.values())))
    problem = _Problem(mesh, shape, dtype_bytes("float32"), kinds, cluster)
    brute = brute_force_min(problem, src, dst)
    if brute is not None:
        assert search_cost(plan) <= brute
    if len(plan.steps) <= 4:
        assert brute == search_cost(plan) or (src == dst and not plan.steps)
    whole = DistAttr.replicated(mesh, len(shape))
    via_replicate = (
        plan_reshard(src, whole, shape, "float32", cluster).time
        + plan_reshard(whole, dst, shape, "float32", cluster).time
    )
    assert plan.time <= via_replicate * (1 + 1e-9) + 1e-12


@given(problems(even=True), st.integers(2, 3))
def test_bigger_tensors_never_cost_less(case, factor):
    mesh, shape, src, dst, cluster = case
    small = plan_reshard(src, dst, shape, "float32", cluster)
    bigger = tuple(s * factor for s in shape)
    assert plan_reshard(src, dst, bigger, "float32", cluster).time >= small.time * (1 - 1e-9)
    assert plan_reshard(src, dst, shape, "float64", cluster).time >= small.time * (1 - 1e-9)


# ---- numeric check: the steps do what their states say ------------------------------------


def _take(x, axis, bounds):
    return np.take(x, np.arange(*bounds), axis=axis)


def _collective(step, inputs):
    """Every member's output of one group of a collective step (the runtime's semantics)."""
    t = step.tensor_dims[0] if step.tensor_dims else 0
    n = len(inputs)
    if step.kind in ("all_reduce", "reduce_scatter"):
        total = REDUCERS[step.reduce](np.stack(inputs), axis=0)
        if step.kind == "all_reduce":
            return [total] * n
        return [_take(total, t, shard_bounds(total.shape[t], n, i)) for i in range(n)]
    if step.kind == "all_gather":
        return [np.concatenate(inputs, axis=t)] * n
    assert step.kind == "all_to_all", step.kind
    u = step.tensor_dims[1]
    return [np.concatenate([_take(x, u, shard_bounds(x.shape[u], n, i)) for x in inputs], axis=t) for i in range(n)]


def apply_step(step, pieces, shape):
    """Every rank's piece after one same-mesh plan step."""
    out = dict(pieces)
    for group in step.groups:
        if step.kind == "slice":
            for r in group:
                old, new = step.src.local_slices(shape, r), step.dst.local_slices(shape, r)
                out[r] = pieces[r][tuple(slice(n.start - o.start, n.stop - o.start) for o, n in zip(old, new))]
        elif step.kind == "make_partial":
            for r in group[1:]:
                out[r] = pieces[r] if step.reduce in ("max", "min") else np.zeros_like(pieces[r])
        else:
            out.update(zip(group, _collective(step, [pieces[r] for r in group])))
    return out


def check_numerically(plan, seed=0):
    """Run the plan on random pieces; after every step the pieces assemble to the value."""
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(plan.shape)
    pieces = scatter(value, plan.src, rng)
    for step in plan.steps:
        pieces = apply_step(step, pieces, plan.shape)
        for r, piece in pieces.items():
            assert piece.shape == step.dst.local_shape(plan.shape, r), f"{step}: rank {r}"
        np.testing.assert_allclose(assemble(pieces, step.dst, plan.shape), value, atol=1e-9, err_msg=str(step))


@given(problems())
def test_plans_reproduce_the_value(case):
    mesh, shape, src, dst, cluster = case
    check_numerically(plan_reshard(src, dst, shape, "float64", cluster))


SQUARE = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_split_order_survives_every_plan():
    mp_dp = DistAttr(SQUARE, [("mp", "dp"), None])
    dp_mp = DistAttr(SQUARE, [("dp", "mp"), None])
    whole = DistAttr.replicated(SQUARE, 2)
    for src, dst in [(mp_dp, whole), (mp_dp, dp_mp), (dp_mp, mp_dp), (whole, mp_dp)]:
        plan = plan_reshard(src, dst, (8, 4), "float64")
        assert plan.steps and plan.steps[-1].dst == dst, str(plan)
        check_numerically(plan)
    # the first gather takes the innermost split (dp): its groups vary dp (NCCL: sub-groups are
    # native; on cpu-gloo one world all_gather over both dims is cheaper than a sub-group's)
    first = plan_reshard(mp_dp, whole, (8, 4), cluster=shipped_profile("h100-node")).steps[0]
    assert first.kind == "all_gather" and first.mesh_dims == (0,) and first.dst.mapping == ((1,), ())


@given(problems())
def test_every_edge_does_what_its_states_say(case):
    mesh, shape, src, _, cluster = case
    kinds = tuple(sorted(set(src.partial_dims.values()) | {"sum"}))
    problem = _Problem(mesh, shape, dtype_bytes("float64"), kinds, cluster)
    for step in _edges(problem, src):
        check_numerically(ReshardPlan(src, step.dst, shape, "float64", (step,)))


def test_replicated_to_pending_avg_keeps_every_copy():
    """R -> P(avg) is local: the average of identical copies is the value (zeroing all but one
    copy, as for a sum, would divide it by the group size)."""
    from autopar.pieces import assemble

    mesh = ProcessMesh([0, 1], ["x"])
    plan = plan_reshard(DistAttr(mesh, [-1]), DistAttr(mesh, [-1], {0: "avg"}), (4,))
    (step,) = plan.steps
    assert step.kind == "make_partial" and step.bytes == 0 and step.time == 0.0
    value = np.arange(4.0)
    assert np.array_equal(assemble({0: value, 1: value}, step.dst, (4,)), value)


@st.composite
def piece_checks(draw):
    """Two placements of one tensor on a 3-d mesh (dims a placement leaves alone included)."""
    mesh_shape = draw(st.sampled_from([(2, 2, 2), (3, 2, 2), (2, 3, 1), (1, 2, 3)]))
    mesh = ProcessMesh(shape=mesh_shape, process_ids=range(math.prod(mesh_shape)), dim_names=["a", "b", "c"])
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    options = ["R", *(f"S({t})" for t in range(ndim)), "P(sum)"]

    def placement():
        attr = DistAttr.parse("[" + ",".join(draw(st.sampled_from(options)) for _ in mesh_shape) + "]", mesh, ndim)
        return attr.with_mapping([tuple(draw(st.permutations(dims))) for dims in attr.mapping])

    dims = tuple(draw(st.permutations(sorted(draw(st.sets(st.integers(0, 2), min_size=1, max_size=2))))))
    return _Problem(mesh, shape, 4, ("sum",), TWO_NODES), placement(), placement(), dims, draw(st.integers(0, ndim - 1))


@given(piece_checks())
def test_piece_checks_on_representative_ranks_equal_every_rank(check):
    """The planner checks pieces on one rank per coordinate along the dims that split the
    tensor (every other rank holds the same pieces): the same answers as visiting every rank."""
    from autopar.cost_model.planner import _contained, _gathered

    p, new, old, dims, t = check
    box = {(attr, r): tuple((s.start, s.stop) for s in attr.local_slices(p.shape, r)) for attr in (new, old) for r in p.mesh.ranks}
    inside = all(
        all(oa <= na and nz <= oz for (na, nz), (oa, oz) in zip(box[new, r], box[old, r])) for r in p.mesh.ranks
    )  # fmt: skip
    assert _contained(p, new, old) == inside
    gathered = True
    for group in p.mesh.groups(list(dims)):
        for r in group:
            at, stop = box[new, r][t]
            for g in group:
                lo, hi = box[old, g][t]
                if hi > lo:
                    gathered &= lo == at
                    at = hi
            gathered &= at == stop
            gathered &= all(box[old, r][i][0] <= box[new, r][i][0] and box[new, r][i][1] <= box[old, r][i][1]
                            for i in range(len(p.shape)) if i != t)  # fmt: skip
    assert _gathered(p, new, old, dims, t) == gathered


FOUR_NODES = Cluster("four-nodes", 4, 4, Link(2e-6, 2e11), Link(1e-5, 2.5e10), Device((("float32", 1e14),), 2e12, 8e10))


def _moved_mesh(mesh, offset):
    return ProcessMesh(shape=mesh.shape, process_ids=[r + offset for r in mesh.ranks], dim_names=mesh.dim_names)


@given(problems(), st.sampled_from([0, 2, 4, 8]), st.sampled_from([0, 2, 4, 8]))
def test_plans_moved_by_whole_nodes_equal_plans_made_there(case, src_at, dst_at):
    """The planner plans once where the meshes start on node 0 and moves the plan back (one
    plan for every pipeline stage's copy of a reshard): equal to planning on the meshes where
    they are, for meshes on one node or two, the same or different (a stage-to-stage send)."""
    from autopar.cost_model.planner import _plan_here

    _, shape, src, dst, _ = case
    src = DistAttr(_moved_mesh(src.mesh, src_at), mapping=src.mapping, partial=src.partial)
    dst = DistAttr(_moved_mesh(dst.mesh, dst_at), mapping=dst.mapping, partial=dst.partial)
    assert plan_reshard(src, dst, shape, "float32", FOUR_NODES) == _plan_here(src, dst, shape, "float32", FOUR_NODES)
