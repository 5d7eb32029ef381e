"""Rules of the ops that work along one axis, checked numerically (hypothesis): cumsum, flip,
roll, index_select / gather, one_hot, and the grads (cumsum_grad, roll_grad,
index_select_grad / gather_grad); and diff-tested against Paddle's own rules on clean cases.
cumsum's scanned dim keeps its split with a carry between shards the local kernel does not
compute (its lowering): here cumsum is checked with that dim whole, the carry in
tests/unit/test_scan_carry.py."""

import numpy as np
import paddle
from hypothesis import assume, given
from hypothesis import strategies as st
from paddle_oracle import Spec, nontrivial_differences, paddle_dists, paddle_infer

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _whole_along(dist, axis):
    """``dist`` with the dim ``axis`` whole (None stays None)."""
    return None if dist is None else dist.with_mapping([() if d == axis else m for d, m in enumerate(dist.mapping)])


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_cumsum_flip_roll_and_grads(mesh, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    x, g = _rand(shape), _rand(shape, 1)
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    axis_operand = np.array([axis], "int64")
    unscanned = _whole_along(dist, axis)
    check_rule("cumsum", eager(lambda t, a, axis: paddle.cumsum(t, axis=axis)), [x, axis_operand], [unscanned, None], {"axis": axis}, mesh)
    check_rule("flip", eager(lambda t, axis: paddle.flip(t, axis=axis)), [x], [dist], {"axis": [axis]}, mesh)
    roll = eager(lambda t, s, axis: paddle.roll(t, shifts=1, axis=axis))
    check_rule("roll", roll, [x, np.array([1], "int64")], [dist, None], {"axis": [axis]}, mesh)
    grads = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)) for _ in range(2)]
    cumsum_grad = lambda ins, a: [np.flip(np.cumsum(np.flip(ins[1], a["axis"]), a["axis"]), a["axis"])]  # noqa: E731
    check_rule("cumsum_grad", cumsum_grad, [x, g, axis_operand], [_whole_along(d, axis) for d in grads] + [None], {"axis": axis}, mesh)
    roll_grad = lambda ins, a: [np.roll(ins[1], -1, axis=a["axis"][0])]  # noqa: E731
    check_rule("roll_grad", roll_grad, [x, g, np.array([1], "int64")], grads + [None], {"axis": [axis]}, mesh)


@given(meshes(), shapes(2, 3, max_side=5), st.data())
def test_index_select_gather_and_grads(mesh, shape, data):
    x = _rand(shape)
    index = np.random.default_rng(2).integers(0, shape[0], 3).astype("int64")
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, 1))]
    select = eager(lambda t, i, axis: paddle.index_select(t, i, axis=axis))
    check_rule("index_select", select, [x, index], dists, {"axis": 0}, mesh)
    gather = eager(lambda t, i, a, axis: paddle.gather(t, i, axis=0))
    check_rule("gather", gather, [x, index, np.array([0], "int64")], dists + [None], {"axis": [0]}, mesh)
    out = select([x, index], {"axis": 0})[0]
    g = _rand(out.shape, 1)
    grad = eager_grad(lambda t, i, axis: paddle.index_select(t, i, axis=axis), [0])
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), None, data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    check_rule("index_select_grad", grad, [x, index, g], dists, {"axis": 0}, mesh)


@given(meshes(), shapes(1, 2, max_side=6), st.data())
def test_one_hot(mesh, shape, data):
    labels = np.random.default_rng(3).integers(0, 4, shape).astype("int64")
    dist = data.draw(maybe_dist_attrs(mesh, len(shape)))
    hot = eager(lambda t, n, num_classes: paddle.nn.functional.one_hot(t, num_classes))
    check = check_rule("one_hot", hot, [labels, np.array([4], "int64")], [dist, None], {"num_classes": 4}, mesh)
    assert not check.result.outputs[0].mapping[-1]


@given(meshes(), shapes(2, 3, max_side=6), st.data())
def test_cumsum_vs_paddle(mesh, shape, data):
    dist = data.draw(paddle_dists(mesh, len(shape)))
    assume(all(not dims or shape[i] % int(np.prod([mesh.shape[d] for d in dims])) == 0 and shape[i] > 1 for i, dims in enumerate(dist.mapping)))
    axis = data.draw(st.integers(0, len(shape) - 1))

    def ours(op, specs, attrs):
        return get_rule(op).infer_forward([None if s is None else TensorSpec(s.shape, s.dist) for s in specs], attrs, RuleContext(mesh))

    dist = _whole_along(dist, axis)  # (Paddle gathers a split scanned dim; ours carries between the shards)
    ins, outs = paddle_infer("cumsum", Spec(shape, dist), axis, False, False, False)
    assert not nontrivial_differences(ours("cumsum", [Spec(shape, dist), Spec((1,), None)], {"axis": axis}), ins, outs, [0])
