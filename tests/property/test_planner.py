"""Planner optimality (hypothesis): meshes up to 2 x 4, random placements, even and uneven shapes.

- the plan's cost equals the brute-force minimum over every step sequence of length <= 4
  (the same steps the planner may take: each collective / local step over any set of mesh dims);
- it is never worse than going through Replicate (Paddle's strategy);
- the plan's time is the sum of its steps, and the steps chain src -> dst;
- a bigger tensor (evenly split) never costs less.
"""

import math

from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import Cluster, Device, Link, plan_reshard, shipped_profile
from autopar.cost_model.cluster import dtype_bytes
from autopar.cost_model.planner import _cost, _edges, _Problem

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
                return attr

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
