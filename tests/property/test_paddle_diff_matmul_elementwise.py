"""Differential tests of matmul and the elementwise rules against Paddle's own (forward and
reverse inference): matmul; add, subtract, multiply, divide, maximum, minimum; relu, gelu,
tanh, sigmoid, exp, sqrt, square, scale; add_n.

On a clean case (every split even, no two operands competing for a dim or a mesh dim; see
``split_hazards``) the two rules must agree exactly, one-rank mesh dims aside. Elsewhere we may
differ, and then our answer is checked numerically. Known, intended differences:
- a dim split into more parts than it has elements: we drop the split (Paddle's kernels
  reject the empty pieces); uneven splits: Paddle's matmul drops some, we keep them;
- competing splits: Paddle raises ("one mesh dim shard multiple tensor axes", "Tensor Axis[a]
  is Sharded by two different mesh dimension", even over mesh dims of one rank) or breaks the
  tie its own way; we merge (priority, then more ranks, then operand order) and record a
  Conflict;
- partial inputs (``test_partial_inputs_vs_paddle``): Paddle's add / subtract / matmul / sum
  reduce every pending sum first; we keep it pending where the op is linear in it (add with
  all operands pending alike, matmul with one) — fewer all-reduces, same numbers. For
  multiply with both operands pending Paddle reduces one, we reduce both (correct, one
  collective more);
- Paddle exposes no rules for the grad ops (matmul_grad, add_grad, relu_grad, ...: "Spmd rules
  is not registered") nor a reverse rule for add_n: ours are checked only numerically
  (test_rules_matmul_elementwise). Paddle's reverse matmul rule also refuses 1-D operands
  ("The max ndim of inputs should be equal out_ndim") and, for a transposed operand with a
  size-1 matrix dim, drops the other matrix dim's split from it while keeping it on the output
  ((4, 1) x (3, 1)^T, n split: y whole, out still split; ours splits y's n, checked);
- uneven splits in reverse inference: Paddle drops them from the inputs yet keeps them on the
  output it returns; we keep them on both.
"""

import numpy as np
import paddle
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paddle_oracle import (
    Spec,
    agree_or_explained,
    nontrivial_differences,
    paddle_dists,
    paddle_infer,
    paddle_infer_backward,
    split_hazards,
)
from test_rules_matmul_elementwise import (
    BINARY,
    UNARY,
    _binary_operands,
    _rand,
    broadcast_cases,
    matmul,
    matmul_cases,
)

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.letters import broadcast_letters
from autopar.spmd.matmul import matmul_letters
from autopar.testing import check_rule, eager, meshes

PADDLE_REFUSES = (ValueError, NotImplementedError, RuntimeError)
ADD_N = eager(lambda *ts: paddle.add_n(list(ts)))
# sides that mesh sizes often divide, so that clean cases (where the rules must agree exactly)
# are common; odd sides still give the uneven ones
SIDES = st.sampled_from([1, 2, 3, 4, 6, 8])


def _ours(op, shapes_, dists, attrs, mesh):
    specs = [TensorSpec(s, d) for s, d in zip(shapes_, dists)]
    return get_rule(op).infer_forward(specs, attrs, RuleContext(mesh, op_name=op))


def _ours_backward(op, in_shapes, out_shapes, out_dists, attrs, mesh):
    specs = [TensorSpec(s) for s in in_shapes]
    outs = [TensorSpec(s, d) for s, d in zip(out_shapes, out_dists)]
    return get_rule(op).infer_backward(specs, outs, attrs, RuleContext(mesh, op_name=op))


# ---- matmul ----------------------------------------------------------------------------------


@st.composite
def paddle_matmul_cases(draw):
    """matmul_cases without transpose flags on 1-D operands (Paddle's rule refuses those)."""
    x_shape, y_shape, attrs = draw(matmul_cases(sides=SIDES))
    flags = {
        "transpose_x": attrs["transpose_x"] and len(x_shape) > 1,
        "transpose_y": attrs["transpose_y"] and len(y_shape) > 1,
    }
    return x_shape, y_shape, flags


@given(meshes(), paddle_matmul_cases(), st.data())
def test_matmul_vs_paddle(mesh, case, data):
    """Three placement pairs per case (inference is cheap; clean cases need even splits)."""
    x_shape, y_shape, attrs = case
    for _ in range(3):
        dists = [data.draw(paddle_dists(mesh, len(x_shape))), data.draw(paddle_dists(mesh, len(y_shape)))]
        _compare_matmul(mesh, x_shape, y_shape, attrs, dists)


def _compare_matmul(mesh, x_shape, y_shape, attrs, dists):
    ours = _ours("matmul", [x_shape, y_shape], dists, attrs, mesh)
    x_letters, y_letters, _ = matmul_letters(x_shape, y_shape, attrs)
    hazards = split_hazards([x_letters, y_letters], [x_shape, y_shape], dists)
    flags = attrs["transpose_x"], attrs["transpose_y"]

    def check():
        check_rule("matmul", eager(matmul), [_rand(x_shape), _rand(y_shape, 1)], dists, attrs, mesh)

    try:
        ins, outs = paddle_infer("matmul", Spec(x_shape, dists[0]), Spec(y_shape, dists[1]), *flags)
    except PADDLE_REFUSES:  # Paddle only refuses competing splits (even over one-rank mesh dims)
        assert split_hazards([x_letters, y_letters], [x_shape, y_shape], dists, one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


@given(meshes(), paddle_matmul_cases(), st.data())
def test_matmul_backward_vs_paddle(mesh, case, data):
    x_shape, y_shape, attrs = case
    x, y = _rand(x_shape), _rand(y_shape, 1)
    out = eager(matmul)([x, y], attrs)[0]
    out_dist = data.draw(paddle_dists(mesh, out.ndim))
    ours = _ours_backward("matmul", [x_shape, y_shape], [out.shape], [out_dist], attrs, mesh)
    replicated = [Spec(s, DistAttr.replicated(mesh, len(s))) for s in (x_shape, y_shape)]
    flags = attrs["transpose_x"], attrs["transpose_y"]
    _, _, out_letters = matmul_letters(x_shape, y_shape, attrs)
    hazards = split_hazards([out_letters], [out.shape], [out_dist])
    # Paddle's reverse rule takes a transposed operand's size-1 matrix dim for the other one
    # (a broadcast): (4, 1) x (3, 1)^T with n split leaves y whole and claims the output split
    for shape, flag in ((x_shape, "transpose_x"), (y_shape, "transpose_y")):
        if attrs[flag] and 1 in shape[-2:]:
            hazards.append(f"{flag} with a size-1 matrix dim in {shape}")

    def check():
        check_rule("matmul", eager(matmul), [x, y], [None, None], attrs, mesh, backward=[out_dist])

    try:
        ins, outs = paddle_infer_backward("matmul", replicated, [Spec(out.shape, out_dist)], *flags)
    except PADDLE_REFUSES:  # Paddle's reverse matmul rule wants out.ndim == max input ndim
        assert min(len(x_shape), len(y_shape)) == 1
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


# ---- binary elementwise ----------------------------------------------------------------------


@given(meshes(), broadcast_cases(sides=SIDES), st.sampled_from(sorted(BINARY)), st.data())
def test_binary_vs_paddle(mesh, case, name, data):
    dists = [data.draw(paddle_dists(mesh, len(s))) for s in case]
    ours = _ours(name, list(case), dists, {}, mesh)
    letters, _ = broadcast_letters(list(case))
    hazards = split_hazards(letters, list(case), dists)

    def check():
        check_rule(name, eager(BINARY[name]), list(_binary_operands(name, *case)), dists, {}, mesh)

    try:
        ins, outs = paddle_infer(name, Spec(case[0], dists[0]), Spec(case[1], dists[1]))
    except PADDLE_REFUSES:
        assert split_hazards(letters, list(case), dists, one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


@given(meshes(), broadcast_cases(sides=SIDES), st.sampled_from(sorted(BINARY)), st.data())
def test_binary_backward_vs_paddle(mesh, case, name, data):
    operands = list(_binary_operands(name, *case))
    out = eager(BINARY[name])(operands, {})[0]
    out_dist = data.draw(paddle_dists(mesh, out.ndim))
    ours = _ours_backward(name, list(case), [out.shape], [out_dist], {}, mesh)
    replicated = [Spec(s, DistAttr.replicated(mesh, len(s))) for s in case]
    _, out_letters = broadcast_letters(list(case))
    hazards = split_hazards([out_letters], [out.shape], [out_dist])

    def check():
        check_rule(name, eager(BINARY[name]), operands, [None, None], {}, mesh, backward=[out_dist])

    try:
        ins, outs = paddle_infer_backward(name, replicated, [Spec(out.shape, out_dist)])
    except PADDLE_REFUSES:
        assert split_hazards([out_letters], [out.shape], [out_dist], one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


# ---- unary elementwise and add_n -------------------------------------------------------------

# Paddle's positional attrs after x, from ours (scale's scalar operand is an attr there)
PADDLE_UNARY_ATTRS = {
    "gelu": lambda a: [a["approximate"]],
    "scale": lambda a: [a["scale"], a["bias"], a["bias_after_scale"]],
}


@st.composite
def unary_paddle_cases(draw):
    name = draw(st.sampled_from(sorted(set(UNARY) - {"cast"})))  # Paddle has no cast rule
    shape = tuple(draw(st.lists(SIDES, min_size=1, max_size=3)))
    operands, attrs = [_rand(shape, positive=name == "sqrt")], {}
    if name == "gelu":
        attrs = {"approximate": draw(st.booleans())}
    elif name == "scale":
        attrs = {"scale": 2.0, "bias": draw(st.sampled_from([0.0, 1.0])), "bias_after_scale": True}
        operands.append(np.array([2.0], "float32"))
    return name, operands, attrs


@given(meshes(), unary_paddle_cases(), st.data())
def test_unary_vs_paddle(mesh, case, data):
    name, operands, attrs = case
    x = operands[0]
    paddle_attrs = PADDLE_UNARY_ATTRS.get(name, lambda a: [])(attrs)
    dist = data.draw(paddle_dists(mesh, x.ndim))
    rest = [None] * (len(operands) - 1)
    ours = _ours(name, [o.shape for o in operands], [dist, *rest], attrs, mesh)
    ins, outs = paddle_infer(name, Spec(x.shape, dist), *paddle_attrs)
    hazards = split_hazards(["abc"[: x.ndim]], [x.shape], [dist])
    fn = eager(UNARY[name])

    def check():
        check_rule(name, fn, operands, [dist, *rest], attrs, mesh)

    agree_or_explained(nontrivial_differences(ours, ins, outs, [0]), hazards, check)

    out_dist = data.draw(paddle_dists(mesh, x.ndim))
    ours = _ours_backward(name, [o.shape for o in operands], [x.shape], [out_dist], attrs, mesh)
    replicated = Spec(x.shape, DistAttr.replicated(mesh, x.ndim))
    ins, outs = paddle_infer_backward(name, [replicated], [Spec(x.shape, out_dist)], *paddle_attrs)
    hazards = split_hazards(["abc"[: x.ndim]], [x.shape], [out_dist])

    def check_backward():
        check_rule(name, fn, operands, [None, *rest], attrs, mesh, backward=[out_dist])

    agree_or_explained(nontrivial_differences(ours, ins[:1], outs, [0]), hazards, check_backward)


@given(meshes(), st.lists(SIDES, min_size=1, max_size=3), st.integers(2, 4), st.data())
def test_add_n_vs_paddle(mesh, shape, count, data):
    shape = tuple(shape)
    dists = [data.draw(paddle_dists(mesh, len(shape))) for _ in range(count)]
    ours = _ours("add_n", [shape] * count, dists, {}, mesh)
    letters = ["abc"[: len(shape)]] * count
    hazards = split_hazards(letters, [shape] * count, dists)

    def check():
        xs = [_rand(shape, i) for i in range(count)]
        check_rule("add_n", ADD_N, xs, dists, {}, mesh)

    try:
        ins, outs = paddle_infer("add_n", [Spec(shape, d) for d in dists])
    except PADDLE_REFUSES:
        assert split_hazards(letters, [shape] * count, dists, one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, list(range(count))), hazards, check)


# ---- partial inputs: a table of where the two rules differ -----------------------------------

MESH = ProcessMesh([0, 1], ["d"])
P, R = "[P(sum)]", "[R]"


def _spec_args(op, shapes_, texts):
    specs = [Spec(s, DistAttr.parse(t, MESH, len(s))) for s, t in zip(shapes_, texts)]
    if op == "add_n":
        return [specs]
    return specs + {"matmul": [False, False], "scale": [2.0, 0.0, True]}.get(op, [])


PARTIAL_CASES = [
    # op, shapes, given placements, same as Paddle?  (ours / Paddle required inputs -> output)
    ("add", [(4, 6), (4, 6)], [P, P], False),  # ours P,P -> P; Paddle R,R -> R
    ("add", [(4, 6), (4, 6)], [P, R], True),  # both reduce x
    ("subtract", [(4, 6), (6,)], [P, P], False),  # ours keeps both pending
    ("multiply", [(4, 6), (4, 6)], [P, R], True),  # x stays pending in both
    ("multiply", [(4, 6), (4, 6)], [P, P], False),  # ours R,R; Paddle P,R (reduces y only)
    ("divide", [(4, 6), (4, 6)], [P, R], False),  # ours keeps x pending (linear in x); Paddle reduces it
    ("divide", [(4, 6), (4, 6)], [R, P], True),  # both reduce the divisor
    ("maximum", [(4, 6), (4, 6)], [P, P], True),
    ("matmul", [(4, 6), (6, 8)], [P, R], False),  # ours keeps x pending; Paddle reduces it
    ("matmul", [(4, 6), (6, 8)], [P, P], True),
    ("add_n", [(4, 6)] * 3, [P, P, P], True),
    ("add_n", [(4, 6)] * 3, [P, R, R], True),  # one pending: reduced before, as Paddle does
    ("add_n", [(4, 6)] * 3, [P, R, P], False),  # ours P,P,P -> P (the whole one made partial locally: one reduction after); Paddle reduces both

    ("relu", [(4, 6)], [P], True),
    ("scale", [(4, 6)], [P], False),  # bias 0: linear, ours keeps x pending (-x.mean() under micro-batching); Paddle reduces
]


@pytest.mark.parametrize("op, shapes_, texts, same", PARTIAL_CASES)
def test_partial_inputs_vs_paddle(op, shapes_, texts, same):
    dists = [DistAttr.parse(t, MESH, len(s)) for s, t in zip(shapes_, texts)]
    attrs = {"scale": 2.0, "bias": 0.0, "bias_after_scale": True} if op == "scale" else {}
    operand_shapes = list(shapes_) + ([(1,)] if op == "scale" else [])
    ours = _ours(op, operand_shapes, dists + [None] * (len(operand_shapes) - len(dists)), attrs, MESH)
    ins, outs = paddle_infer(op, *_spec_args(op, shapes_, texts))
    diffs = nontrivial_differences(ours, ins, outs, list(range(len(shapes_))), input_partials=True)
    assert (not diffs) == same, diffs
    operands = [_rand(s, i, positive=op == "divide") for i, s in enumerate(shapes_)]
    fn = {"matmul": eager(matmul), "add_n": ADD_N}.get(op)
    if op in BINARY:
        fn = eager(BINARY[op])
    elif op in UNARY:
        fn = eager(UNARY[op])
    if op == "scale":
        operands.append(np.array([2.0], "float32"))
    attrs = {"transpose_x": False, "transpose_y": False} if op == "matmul" else attrs
    check_rule(op, fn, operands, dists + [None] * (len(operands) - len(dists)), attrs, MESH)


def test_scale_keeps_a_pending_sum_only_without_a_bias():
    """``scale * x + bias``: with a bias, each piece would add it once: the sum is reduced first."""
    pending = DistAttr.parse(P, MESH, 2)
    for bias, kept in ((0.0, True), (1.0, False)):
        attrs = {"scale": 2.0, "bias": bias, "bias_after_scale": True}
        ours = _ours("scale", [(4, 6), (1,)], [pending, None], attrs, MESH)
        assert bool(ours.outputs[0].partial) == kept and bool(ours.inputs[0].partial) == kept, (bias, ours)
