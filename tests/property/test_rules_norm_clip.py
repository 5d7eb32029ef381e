"""squared_l2_norm, p_norm, stack / unstack and their grads (the ops of global-norm clipping)
checked numerically with hypothesis (Paddle's own kernels), and against Paddle's SPMD rules
where Paddle has one (squared_l2_norm, p_norm, stack).

Known, deliberate differences from Paddle:
- a partial input of squared_l2_norm / p_norm: both reduce it first (the norm of a pending
  sum is not the sum of the pieces' norms);
- p_norm over a split dim: Paddle's rule (``ReductionInferSpmd``) makes every order a pending
  sum; the kernel on a piece computes ``(sum |x|^p)^(1/p)``, whose pieces do not add up for
  p other than 0 and 1. Ours keeps the reduced dims whole then, and gives a pending max / min
  for p = inf / -inf (Paddle labels those sum too);
- stack of operands partial and whole alike over a mesh dim: Paddle reduces the partial
  ones; ours makes the whole ones partial (locally) and keeps one pending sum.
"""

import math

import numpy as np
import paddle
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops
from paddle_oracle import (
    Spec,
    agree_or_explained,
    drop_trivial,
    nontrivial_differences,
    paddle_dists,
    paddle_infer,
    split_hazards,
)

from autopar import DistAttr, ProcessMesh
from autopar.pieces import reduce_partials
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.norm_clip import p_norm_axes
from autopar.spmd.operands import letters
from autopar.testing import check_rule, dist_attrs, eager, eager_grad, maybe_dist_attrs, meshes, shapes

EPS = 1e-12
ORDERS = [0.0, 1.0, 2.0, 3.0, math.inf, -math.inf]


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _ours(op, shapes_, dists, attrs, mesh):
    specs = [TensorSpec(tuple(s), d) for s, d in zip(shapes_, dists)]
    return get_rule(op).infer_forward(specs, attrs, RuleContext(mesh, op_name=op))


# ---- squared_l2_norm ---------------------------------------------------------------------------

squared_l2_norm = eager(lambda x: _C_ops.squared_l2_norm(x))


@given(meshes(), shapes(0, 3), st.data())
def test_squared_l2_norm(mesh, shape, data):
    x = _rand(shape)
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    check = check_rule("squared_l2_norm", squared_l2_norm, [x], [dist], {}, mesh)
    required, out = check.result.inputs[0], check.result.outputs[0]
    assert not required.partial  # the norm of a pending sum is not the sum of the pieces' norms
    assert set(out.partial_dims) == required.sharded_mesh_dims() and set(out.partial_dims.values()) <= {"sum"}
    check_rule("squared_l2_norm", squared_l2_norm, [x], [None], {}, mesh, backward=[data.draw(dist_attrs(mesh, 1))])


def test_a_partial_gradient_is_reduced_before_its_norm():
    """Data parallelism: a gradient pending a sum over dp. Reading it as it lies would sum the
    ranks' squared norms, which is not the squared norm of the sum."""
    mesh = ProcessMesh([0, 1], ["dp"])
    pending = DistAttr.parse("[P(sum)]", mesh, 2)
    ours = _ours("squared_l2_norm", [(4, 6)], [pending], {}, mesh)
    assert str(ours.inputs[0]) == "[R]" and str(ours.outputs[0]) == "[R]"
    pieces = {0: _rand((4, 6), 1), 1: _rand((4, 6), 2)}
    whole = reduce_partials(pieces, pending)[0]
    summed_norms = sum(float(squared_l2_norm([p], {})[0][0]) for p in pieces.values())
    assert not np.isclose(summed_norms, float(squared_l2_norm([whole], {})[0][0]), rtol=1e-3)


def test_a_split_gradient_gives_a_pending_scalar():
    """On dp x mp (placements per mesh dim): ``ab[S(0),S(1)] -> 1[P(sum),P(sum)]``; a
    tensor-parallel gradient under data parallelism ``ab[P(sum),S(1)]`` is read ``[R,S(1)]``
    (the dp sum done first) and gives ``1[R,P(sum)]``."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    ours = _ours("squared_l2_norm", [(4, 6)], [DistAttr.parse("[S(0),S(1)]", mesh, 2)], {}, mesh)
    assert str(ours.outputs[0]) == "[P(sum),P(sum)]"
    ours = _ours("squared_l2_norm", [(4, 6)], [DistAttr.parse("[P(sum),S(1)]", mesh, 2)], {}, mesh)
    assert str(ours.inputs[0]) == "[R,S(1)]" and str(ours.outputs[0]) == "[R,P(sum)]"


@given(meshes(), shapes(0, 3), st.data())
def test_squared_l2_norm_grad(mesh, shape, data):
    x, out_grad = _rand(shape), np.array([0.7], "float32")
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, 1, partial=True))]
    check = check_rule(
        "squared_l2_norm_grad", eager(lambda x, g: _C_ops.squared_l2_norm_grad(x, g)), [x, out_grad], dists, {}, mesh
    )
    if dists[1] is not None:  # linear in out_grad: its pending sums over dims x is not split by pass through
        split = check.result.inputs[0].sharded_mesh_dims()
        assert check.result.inputs[1].partial == tuple((d, k) for d, k in dists[1].partial if d not in split)


# ---- p_norm ------------------------------------------------------------------------------------


@st.composite
def p_norm_cases(draw, max_side=6):
    shape = draw(shapes(1, 3, max_side=max_side))
    attrs = {
        "porder": draw(st.sampled_from(ORDERS)), "axis": draw(st.integers(-len(shape), len(shape) - 1)),
        "epsilon": EPS, "keepdim": draw(st.booleans()), "asvector": draw(st.booleans()),
    }  # fmt: skip
    # zeros (p = 0 counts non-zeros) and ties (p = inf / -inf) among small integers
    x = np.random.default_rng(3).integers(-2, 3, shape).astype("float32")
    return x, attrs


p_norm = eager(
    lambda x, porder, axis, epsilon, keepdim, asvector: _C_ops.p_norm(x, porder, axis, epsilon, keepdim, asvector)
)


@given(meshes(), p_norm_cases(), st.data())
def test_p_norm(mesh, case, data):
    x, attrs = case
    dist = data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))
    check = check_rule("p_norm", p_norm, [x], [dist], attrs, mesh)
    required = check.result.inputs[0]
    assert not required.partial
    if attrs["porder"] not in (0.0, 1.0, math.inf, -math.inf):  # (sum |x|^p)^(1/p): reduced dims whole
        assert not any(required.mapping[a] for a in p_norm_axes(x.ndim, attrs))
    out = p_norm([x], attrs)[0]
    check_rule("p_norm", p_norm, [x], [None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, out.ndim))])


@given(meshes(), p_norm_cases(), st.data())
def test_p_norm_grad(mesh, case, data):
    x, attrs = case
    x = x + 0.5  # p_norm_grad divides by the norm: keep it away from 0
    out = p_norm([x], attrs)[0]
    out_grad = _rand(out.shape, 1)

    p_norm_grad = eager(
        lambda x, out, g, porder, axis, epsilon, keepdim, asvector: _C_ops.p_norm_grad(
            x, out, g, porder, axis, epsilon, keepdim, asvector
        )
    )
    dists = [
        data.draw(maybe_dist_attrs(mesh, x.ndim)),
        data.draw(maybe_dist_attrs(mesh, out.ndim)),
        data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)),
    ]
    check_rule("p_norm_grad", p_norm_grad, [x, out, out_grad], dists, attrs, mesh)


# ---- stack / unstack -------------------------------------------------------------------------


@st.composite
def stack_cases(draw):
    shape = draw(shapes(0, 3, max_side=6))
    count = draw(st.integers(1, 4))
    return [_rand(shape, i) for i in range(count)], {"axis": draw(st.integers(-len(shape) - 1, len(shape)))}


stack = eager(lambda *xs, axis: _C_ops.stack(list(xs), axis))


@given(meshes(), stack_cases(), st.data())
def test_stack_and_unstack_grad(mesh, case, data):
    xs, attrs = case
    dists = [data.draw(maybe_dist_attrs(mesh, xs[0].ndim, partial=True)) for _ in xs]
    for name in ("stack", "unstack_grad"):
        check_rule(name, stack, xs, dists, attrs, mesh)
    out = stack(xs, attrs)[0]
    check_rule("stack", stack, xs, [None] * len(xs), attrs, mesh, backward=[data.draw(dist_attrs(mesh, out.ndim))])


def test_stacking_pending_and_whole_norms_keeps_one_pending_sum():
    """Tensor parallelism: split gradients' squared norms are pending sums over mp, replicated
    gradients' are whole. The whole ones are made partial (locally) and the stack stays one
    pending sum: reduced once, as one scalar, where sqrt needs it."""
    mesh = ProcessMesh([0, 1], ["mp"])
    pending, whole = DistAttr.parse("[P(sum)]", mesh, 1), DistAttr.parse("[R]", mesh, 1)
    norms = [np.array([v], "float32") for v in (1.0, 2.0, 3.0)]
    check = check_rule("stack", stack, norms, [pending, whole, pending], {"axis": 0}, mesh)
    assert all(d == pending for d in check.result.inputs)
    assert str(check.result.outputs[0]) == "[P(sum)]"
    # a pending max cannot be mixed in: reduced first, the sums stay pending alike
    maxed = DistAttr.parse("[P(max)]", mesh, 1)
    result = _ours("stack", [(1,)] * 3, [pending, maxed, whole], {"axis": 0}, mesh)
    assert not result.inputs[1].partial and not result.outputs[0].partial


unstack = eager(lambda x, axis, num: _C_ops.unstack(x, axis, num))


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_unstack_and_stack_grad(mesh, shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {"axis": axis, "num": shape[axis]}
    x = _rand(shape)
    check_rule("unstack", unstack, [x], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh)
    outs = unstack([x], attrs)
    check_rule(
        "unstack", unstack, [x], [None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, outs[0].ndim))] * len(outs)
    )
    # stack_grad (x[0..n-1], out_grad) -> x_grad[0..n-1]: Paddle's kernel through autograd
    count = data.draw(st.integers(1, 3))
    xs = [_rand(outs[0].shape, i) for i in range(count)]
    stack_attrs = {"axis": axis}
    out_grad = _rand(stack(xs, stack_attrs)[0].shape, 9)
    grad = eager_grad(lambda *ts, axis: paddle.stack(list(ts), axis), wrt=range(count))
    x_dists = [data.draw(maybe_dist_attrs(mesh, xs[0].ndim, partial=True)) for _ in xs]
    g_dist = data.draw(maybe_dist_attrs(mesh, out_grad.ndim, partial=True))
    check_rule("stack_grad", grad, xs + [out_grad], x_dists + [g_dist], stack_attrs, mesh)


# ---- against Paddle's rules --------------------------------------------------------------------

SIDES = st.sampled_from([1, 2, 3, 4, 6, 8])
even_shapes = st.lists(SIDES, min_size=1, max_size=3).map(tuple)


@given(meshes(), even_shapes, st.data())
def test_squared_l2_norm_vs_paddle(mesh, shape, data):
    """Paddle 3.3.1 registers its reduction rule under ``squared_l2_norm`` (with sum's
    arguments: called without ``axis, keepdim`` it crashes); with ``axis=[]`` (every dim) it
    answers a 0-d output: compared on the input and on the output's partial mesh dims."""
    x = _rand(shape)
    dist = data.draw(paddle_dists(mesh, len(shape)))
    ours = _ours("squared_l2_norm", [shape], [dist], {}, mesh)
    ins, outs = paddle_infer("squared_l2_norm", Spec(shape, dist), [], False)
    mine, theirs = drop_trivial(ours.outputs[0]), drop_trivial(outs[0])
    diffs = nontrivial_differences(ours, ins, [], [0])
    if set(mine.partial_dims) != set(theirs.partial_dims):
        diffs.append(f"output: ours {mine} paddle {theirs}")
    agree_or_explained(
        diffs,
        split_hazards([letters(len(shape))], [shape], [dist]),
        lambda: check_rule("squared_l2_norm", squared_l2_norm, [x], [dist], {}, mesh),
    )


@given(meshes(), even_shapes, st.sampled_from(ORDERS), st.data())
def test_p_norm_vs_paddle(mesh, shape, porder, data):
    """Clean cases agree where the pieces' norms reduce (p 0, 1, inf, -inf: mappings and partial
    mesh dims; Paddle names the inf partials sum); for other p ours keeps the reduced dims whole."""
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {
        "porder": porder,
        "axis": axis,
        "epsilon": EPS,
        "keepdim": data.draw(st.booleans()),
        "asvector": data.draw(st.booleans()),
    }
    x = np.random.default_rng(3).integers(-2, 3, shape).astype("float32")
    dist = data.draw(paddle_dists(mesh, len(shape)))
    ours = _ours("p_norm", [shape], [dist], attrs, mesh)
    ins, outs = paddle_infer("p_norm", Spec(shape, dist), porder, axis, EPS, attrs["keepdim"], attrs["asvector"])
    hazards = split_hazards([letters(len(shape))], [shape], [dist])
    reduced = p_norm_axes(len(shape), attrs)
    if porder not in (0.0, 1.0, math.inf, -math.inf) and any(
        mesh.shape[d] > 1 for a in reduced for d in dist.mapping[a]
    ):
        hazards.append("a reduced dim split: p-th powers' roots do not add up")
    agree_or_explained(
        nontrivial_differences(ours, ins, outs, [0]),
        hazards,
        lambda: check_rule("p_norm", p_norm, [x], [dist], attrs, mesh),
    )


@given(meshes(), st.lists(SIDES, min_size=0, max_size=2).map(tuple), st.integers(1, 3), st.data())
def test_stack_vs_paddle(mesh, shape, count, data):
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    xs = [_rand(shape, i) for i in range(count)]
    dists = [data.draw(paddle_dists(mesh, len(shape))) for _ in xs]
    ours = _ours("stack", [shape] * count, dists, {"axis": axis}, mesh)
    try:
        ins, outs = paddle_infer("stack", [Spec(shape, d) for d in dists], axis)
    except (ValueError, NotImplementedError, RuntimeError):  # Paddle refuses competing splits, even over one rank
        assert split_hazards([letters(len(shape))] * count, [shape] * count, dists, one_rank_dims=True)
        return check_rule("stack", stack, xs, dists, {"axis": axis}, mesh)
    agree_or_explained(
        nontrivial_differences(ours, ins, outs, list(range(count))),
        split_hazards([letters(len(shape))] * count, [shape] * count, dists),
        lambda: check_rule("stack", stack, xs, dists, {"axis": axis}, mesh),
    )


@pytest.mark.parametrize("porder", [2.0, math.inf])
def test_readable_p_norm_difference(porder):
    """``ab[S(0),S(1)]`` p_norm over axis 1: Paddle ``a[S(0),P(sum)]`` for every order; ours
    ``[S(0),R]`` reading ``ab[S(0),R]`` for p = 2, ``a[S(0),P(max)]`` for p = inf."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    dist = DistAttr.parse("[S(0),S(1)]", mesh, 2)
    attrs = {"porder": porder, "axis": 1, "epsilon": EPS, "keepdim": False, "asvector": False}
    ours = _ours("p_norm", [(4, 6)], [dist], attrs, mesh)
    _, outs = paddle_infer("p_norm", Spec((4, 6), dist), porder, 1, EPS, False, False)
    assert str(outs[0]) == "[S(0),P(sum)]"
    if porder == 2.0:
        assert str(ours.inputs[0]) == "[S(0),R]" and str(ours.outputs[0]) == "[S(0),R]"
    else:
        assert str(ours.outputs[0]) == "[S(0),P(max)]"
    check_rule("p_norm", p_norm, [_rand((4, 6))], [dist], attrs, mesh)
