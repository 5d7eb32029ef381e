"""Shape-op rules checked numerically (hypothesis): reshape, flatten, squeeze, unsqueeze,
transpose and their grads, forward and backward inference.

Local kernels get local target shapes the way the partition pass computes them
(:func:`autopar.spmd.shape_ops.local_target_shape`); the full op runs Paddle's own reshape
with the raw target (``0`` and ``-1`` included), so Paddle's shape semantics are checked too.
"""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.shape_ops import (
    flatten_shape,
    local_target_shape,
    reshape_groups,
    resolve_shape,
    squeeze_shape,
    unsqueeze_shape,
)  # fmt: skip
from autopar.testing import check_rule, dist_attrs, dygraph, maybe_dist_attrs, meshes

FACTORS = st.sampled_from([1, 2, 2, 3, 4, 6, 8])


@st.composite
def reshape_cases(draw):
    """(in_shape, raw target, out_shape): two groupings of one list of factors, with 0 / -1."""
    factors = draw(st.lists(FACTORS, min_size=1, max_size=5))

    def grouping():
        out, i = [], 0
        while i < len(factors):
            take = draw(st.integers(1, len(factors) - i))
            out.append(int(np.prod(factors[i : i + take])))
            i += take
        if draw(st.booleans()):
            out.insert(draw(st.integers(0, len(out))), 1)
        return tuple(out)

    in_shape, out_shape = grouping(), grouping()
    target = list(out_shape)
    if draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    for i in range(min(len(target), len(in_shape))):
        if target[i] == in_shape[i] and draw(st.booleans()):
            target[i] = 0
    return in_shape, target, out_shape


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def reshape_fn(in_shape, raw_target):
    out_shape = resolve_shape(in_shape, raw_target)

    def run(inputs, attrs):
        x = inputs[0]
        with dygraph():
            target = raw_target if x.shape == tuple(in_shape) else local_target_shape(in_shape, out_shape, x.shape)
            return [paddle.reshape(paddle.to_tensor(x), list(target)).numpy()]

    return run


def regrad_fn(inputs, attrs):
    """reshape_grad / flatten_grad / squeeze_grad / unsqueeze_grad: out_grad back to x's shape."""
    return [inputs[1].reshape(inputs[0].shape)]


@given(meshes(), reshape_cases(), st.data())
def test_reshape_forward_and_backward(mesh, case, data):
    in_shape, target, out_shape = case
    x = _rand(in_shape)
    shape = np.array(target, dtype="int64")
    attrs = {"shape": target}
    dist = data.draw(maybe_dist_attrs(mesh, len(in_shape), partial=True))
    check = check_rule("reshape", reshape_fn(in_shape, target), [x, shape], [dist, None], attrs, mesh)
    if dist is not None and not dist.partial:
        kept = check.result.inputs[0].mapping
        # a leading split that divides evenly is never dropped (size-1 dims are never split)
        for src, dst in reshape_groups(in_shape, out_shape):
            dims = dist.mapping[src[0]] if src else ()
            parts = int(np.prod([mesh.shape[d] for d in dims]))
            if (
                src
                and dst
                and dims
                and in_shape[src[0]] > 1
                and in_shape[src[0]] % parts == 0
                and out_shape[dst[0]] % parts == 0
            ):
                assert kept[src[0]] == dims
    out = data.draw(dist_attrs(mesh, len(out_shape)))
    check_rule("reshape", reshape_fn(in_shape, target), [x, shape], [None, None], attrs, mesh, backward=[out])


@given(meshes(), reshape_cases(), st.data())
def test_reshape_grad(mesh, case, data):
    in_shape, target, out_shape = case
    x, g = _rand(in_shape), _rand(out_shape, 1)
    dists = [
        data.draw(maybe_dist_attrs(mesh, len(in_shape))),
        data.draw(maybe_dist_attrs(mesh, len(out_shape), partial=True)),
    ]
    check_rule("reshape_grad", regrad_fn, [x, g], dists, {}, mesh)


@given(meshes(), st.lists(FACTORS, min_size=1, max_size=4), st.data())
def test_flatten(mesh, shape, data):
    shape = tuple(shape)
    start = data.draw(st.integers(0, len(shape) - 1))
    stop = data.draw(st.integers(start, len(shape) - 1))
    attrs = {"start_axis": start, "stop_axis": stop}
    out_shape = flatten_shape(shape, start, stop)
    x = _rand(shape)

    def fn(inputs, attrs):
        return [inputs[0].reshape(local_target_shape(shape, out_shape, inputs[0].shape))]

    full = paddle_flatten(x, start, stop)
    assert full.shape == out_shape and np.array_equal(full, fn([x], attrs)[0])
    check_rule("flatten", fn, [x], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh)
    check_rule("flatten", fn, [x], [None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, len(out_shape)))])
    dists = [
        data.draw(maybe_dist_attrs(mesh, len(shape))),
        data.draw(maybe_dist_attrs(mesh, len(out_shape), partial=True)),
    ]
    check_rule("flatten_grad", regrad_fn, [x, _rand(out_shape, 1)], dists, {}, mesh)


def paddle_flatten(x, start, stop):
    with dygraph():
        return paddle.flatten(paddle.to_tensor(x), start, stop).numpy()


@given(meshes(), st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=1, max_size=4), st.data())
def test_squeeze_unsqueeze(mesh, shape, data):
    shape = tuple(shape)
    ones = [i for i, s in enumerate(shape) if s == 1]
    axes = data.draw(st.lists(st.sampled_from(ones), unique=True)) if ones else []
    axes = [a - len(shape) if data.draw(st.booleans()) else a for a in axes]
    x = _rand(shape)
    with dygraph():
        squeezed = paddle.squeeze(paddle.to_tensor(x), axes).numpy()
    assert squeezed.shape == squeeze_shape(shape, axes)
    _check_reshape_like("squeeze", "squeeze_grad", mesh, x, axes, squeeze_shape(shape, axes), data)
    new_axes = data.draw(st.lists(st.integers(-len(shape) - 1, len(shape)), max_size=2))
    with dygraph():
        expanded = paddle.unsqueeze(paddle.to_tensor(x), new_axes).numpy() if new_axes else x
    assert expanded.shape == unsqueeze_shape(shape, new_axes)
    _check_reshape_like("unsqueeze", "unsqueeze_grad", mesh, x, new_axes, expanded.shape, data)


def _check_reshape_like(op, grad_op, mesh, x, axes, out_shape, data):
    axis = np.array(axes, dtype="int64")
    attrs = {"axis": axes}

    def fn(inputs, attrs):
        return [inputs[0].reshape(local_target_shape(x.shape, out_shape, inputs[0].shape))]

    check_rule(op, fn, [x, axis], [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)), None], attrs, mesh)
    check_rule(op, fn, [x, axis], [None, None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, len(out_shape)))])
    dists = [
        data.draw(maybe_dist_attrs(mesh, x.ndim)),
        data.draw(maybe_dist_attrs(mesh, len(out_shape), partial=True)),
        None,
    ]
    g = _rand(out_shape, 1)
    check_rule(grad_op, lambda ins, a: [ins[1].reshape(ins[0].shape)], [x, g, axis], dists, attrs, mesh)


@given(meshes(), st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_transpose(mesh, shape, data):
    shape = tuple(shape)
    perm = data.draw(st.permutations(range(len(shape))))
    attrs = {"perm": list(perm)}
    x = _rand(shape)

    def fn(inputs, attrs):
        with dygraph():
            return [paddle.transpose(paddle.to_tensor(inputs[0]), attrs["perm"]).numpy()]

    check_rule("transpose", fn, [x], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh)
    out_shape = tuple(shape[p] for p in perm)
    check_rule("transpose", fn, [x], [None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, len(shape)))])
    inverse = list(np.argsort(perm))
    grad = _rand(out_shape, 1)
    check_rule(
        "transpose_grad", lambda ins, a: [np.transpose(ins[0], inverse)], [grad],
        [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh,
    )  # fmt: skip


# ---- readable cases -----------------------------------------------------------------------


MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def _infer(op, shapes, texts, attrs):
    specs = [TensorSpec(s, None if t is None else DistAttr.parse(t, MESH, len(s))) for s, t in zip(shapes, texts)]
    result = get_rule(op).infer_forward(specs, attrs, RuleContext(MESH, op_name=op))
    return [str(d) for d in result.inputs], [str(d) for d in result.outputs]


def test_reshape_merges_leading_split():
    """[6,12,48,24][S(0),S(2)] -> [1,72,48,4,6]: 6 leads (6,12)->72, 48 stays: [S(1),S(2)]."""
    ins, outs = _infer("reshape", [(6, 12, 48, 24), (5,)], ["[S(0),S(2)]", None], {"shape": [1, 72, 48, 4, 6]})
    assert ins[0] == "[S(0),S(2)]" and outs == ["[S(1),S(2)]"]


def test_reshape_drops_inner_split():
    """[6,12] -> [72] with dim 1 split: not the leading dim of its group, so required whole."""
    ins, outs = _infer("reshape", [(6, 12), (1,)], ["[S(1),R]", None], {"shape": [72]})
    assert ins[0] == "[R,R]" and outs == ["[R,R]"]


def test_reshape_uneven_leading_split_dropped():
    """[3,4] -> [12] over 2 ranks: rows 0-1 | 2 are elements 0-7 | 8-11, not 12's halves 0-5 | 6-11."""
    ins, outs = _infer("reshape", [(3, 4), (1,)], ["[S(0),R]", None], {"shape": [12]})
    assert ins[0] == "[R,R]"
    ins, outs = _infer("reshape", [(3, 4), (2,)], ["[S(0),R]", None], {"shape": [3, 2, 2]})
    assert ins[0] == "[S(0),R]" and outs == ["[S(0),R]"]  # same-size dim: uneven is fine


def test_reshape_keeps_partial():
    ins, outs = _infer("reshape", [(4, 6), (1,)], ["[S(0),P(sum)]", None], {"shape": [24]})
    assert outs == ["[S(0),P(sum)]"]


def test_transpose_compact():
    """abc[S(0),S(2)] -> cab: [S(1),S(0)]."""
    ins, outs = _infer("transpose", [(4, 3, 6)], ["[S(0),S(2)]"], {"perm": [2, 0, 1]})
    assert outs == ["[S(1),S(0)]"]


def test_reshape_grad_requires_x_like_grad():
    """x is read for its shape: required split like x_grad; out_grad's partial passes through."""
    ins, outs = _infer("reshape_grad", [(4, 6), (24,)], [None, "[S(0),P(sum)]"], {})
    assert ins == ["[S(0),R]", "[S(0),P(sum)]"] and outs == ["[S(0),P(sum)]"]
