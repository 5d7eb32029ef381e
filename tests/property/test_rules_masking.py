"""Mask and broadcast-table rules checked numerically (hypothesis): expand and its grad, tril /
triu and their grads, where and its grad, logical / bitwise ops, arange."""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@st.composite
def expand_cases(draw):
    """x's shape (some dims 1), the raw target (leading new dims, 1s widened, -1 kept)."""
    x_shape = draw(shapes(1, 3, max_side=5))
    lead = draw(st.lists(st.integers(1, 5), max_size=2))
    target = list(lead)
    for size in x_shape:
        if size == 1:
            target.append(draw(st.sampled_from([1, 2, 3, 4, -1])))
        else:
            target.append(draw(st.sampled_from([size, -1])))
    return x_shape, target


def _expand_local(x_shape):
    """A rank's expand of an ``x_shape`` tensor: broadcast dims to the global size, the others
    x's local size."""

    def run(inputs, attrs):
        x, target = inputs[0], list(attrs["shape"])
        offset = len(target) - x.ndim
        local = [x.shape[i - offset] if i >= offset and (x_shape[i - offset] != 1 or t == -1) else t for i, t in enumerate(target)]
        return [np.broadcast_to(x, local).copy()]

    return run


def _sum_to(g, shape):
    while g.ndim > len(shape):
        g = g.sum(0)
    return g.sum(axis=tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1), keepdims=True)


@given(meshes(), expand_cases(), st.data())
def test_expand_and_grad(mesh, case, data):
    x_shape, target = case
    x = _rand(x_shape)
    attrs = {"shape": target}
    shape_operand = np.array(target, "int64")
    dist = data.draw(maybe_dist_attrs(mesh, len(x_shape), partial=True))
    check = check_rule("expand", _expand_local(x_shape), [x, shape_operand], [dist, None], attrs, mesh)
    (out,) = _expand_local(x_shape)([x], attrs)
    assert out.shape == tuple(np.broadcast_shapes(x.shape, out.shape))
    # grad: (x, out_grad, shape) -> x_grad, the sum over the broadcast dims
    g = _rand(out.shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, len(x_shape))), data.draw(maybe_dist_attrs(mesh, g.ndim, partial=True)), None]
    check_rule("expand_grad", lambda ins, a: [_sum_to(ins[1], ins[0].shape)], [x, g, shape_operand], dists, attrs, mesh)
    assert check.result.outputs[0].ndim == len(target)


def test_expand_takes_the_split_its_reader_wants_on_a_broadcast_dim():
    """Backward: a [1, S] table expanded to [B, S] and read split over the batch is expanded to
    each rank's rows, not made whole and sliced (the mask of a data-parallel or micro-batched
    batch)."""
    mesh = ProcessMesh([0, 1], ["dp"])
    rule = get_rule("pd_op.expand")
    x, shape = TensorSpec((1, 6)), TensorSpec((2,), None, "int64")
    out = TensorSpec((4, 6), DistAttr.parse("[S(0)]", mesh, 2))
    result = rule.infer_backward([x, shape], [out], {"shape": [4, 6]}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(0)]" and result.inputs[0].is_replicated
    forward = rule.infer_forward([TensorSpec((1, 6), DistAttr.parse("[R]", mesh, 2)), shape], {"shape": [4, 6]}, RuleContext(mesh))
    assert forward.outputs[0].is_replicated  # a fresh broadcast dim is whole unless a reader asks


@given(meshes(), shapes(1, 4, max_side=5), st.integers(-2, 2), st.data())
def test_tril_triu_and_grads(mesh, shape, diagonal, data):
    x = _rand(shape)
    attrs = {"diagonal": diagonal}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    for name in ("tril", "triu"):
        fn = eager(lambda t, diagonal, name=name: getattr(paddle, name)(t, diagonal))
        if len(shape) < 2:
            continue  # Paddle's tril needs two dims
        result = check_rule(name, fn, [x], [dist], attrs, mesh).result
        assert all(not result.inputs[0].mapping[d] for d in (len(shape) - 2, len(shape) - 1))
        check_rule(f"{name}_grad", fn, [x], [dist], attrs, mesh)  # the grad is the same masking of out_grad


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_where_and_grad(mesh, shape, data):
    rng = np.random.default_rng(2)
    cond = rng.random(shape) > 0.5
    x, y, g = _rand(shape), _rand(shape, 1), _rand(shape, 3)
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))) for _ in range(3)]
    check_rule("where", eager(paddle.where), [cond, x, y], dists, {}, mesh)
    dists.append(data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)))
    grads = lambda ins, a: [np.where(ins[0], ins[3], 0), np.where(ins[0], 0, ins[3])]  # noqa: E731
    check_rule("where_grad", grads, [cond, x, y, g], dists, {}, mesh)


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_logical_and_bitwise(mesh, shape, data):
    rng = np.random.default_rng(4)
    a, b = rng.random(shape) > 0.5, rng.random(shape) > 0.3
    i, j = rng.integers(0, 8, shape).astype("int32"), rng.integers(0, 8, shape).astype("int32")
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))) for _ in range(2)]
    for name in ("logical_and", "logical_or", "logical_xor"):
        check_rule(name, eager(getattr(paddle, name)), [a, b], dists, {}, mesh)
    for name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        check_rule(name, eager(getattr(paddle, name)), [i, j], dists, {}, mesh)
    check_rule("bitwise_not", eager(paddle.bitwise_not), [i], dists[:1], {}, mesh)


def test_arange_is_whole_both_ways():
    mesh = ProcessMesh([0, 1], ["dp"])
    scalars = [TensorSpec((1,), None, "int64")] * 3
    rule = get_rule("pd_op.arange")
    assert rule.infer_forward(scalars, {}, RuleContext(mesh)).outputs[0].is_replicated
    wanted = TensorSpec((8,), DistAttr.parse("[S(0)]", mesh, 1))
    assert rule.infer_backward(scalars, [wanted], {}, RuleContext(mesh)).outputs[0].is_replicated


@given(meshes(), shapes(2, 3, max_side=4), st.data())
def test_unbind(mesh, shape, data):
    """``unbind`` (timm's ``q, k, v = qkv.unbind(0)``): the axis whole, the rest as it lies."""
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = _rand(shape)
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    check = check_rule("unbind", eager(lambda t, axis: paddle.unbind(t, axis)), [x], [dist], {"axis": axis}, mesh)
    assert not check.result.inputs[0].mapping[axis]


@given(meshes(), shapes(1, 3, max_side=4), st.data())
def test_tile_and_grad(mesh, shape, data):
    repeats = data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape) + 1))
    x = _rand(shape)
    attrs = {"repeat_times": repeats}
    operand = np.array(repeats, "int64")
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    tile = eager(lambda t, r, repeat_times: paddle.tile(t, repeat_times))
    out = tile([x, operand], attrs)[0]
    check_rule("tile", tile, [x, operand], [dist, None], attrs, mesh)
    g = _rand(out.shape, 1)

    def grad(inputs, attrs):  # each rank sums its piece's copies
        x_, g_, _ = inputs
        reps = [1] * (g_.ndim - len(attrs["repeat_times"])) + list(attrs["repeat_times"])
        lead = g_.ndim - x_.ndim
        folded = g_.reshape([d for i in range(g_.ndim) for d in ((reps[i], g_.shape[i] // reps[i]) if i >= lead else (g_.shape[i], 1))])
        return [folded.sum(axis=tuple(range(0, 2 * g_.ndim, 2))).reshape(x_.shape)]

    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)), None]
    check_rule("tile_grad", grad, [x, g, operand], dists, attrs, mesh)


def test_linspace_is_whole_both_ways():
    mesh = ProcessMesh([0, 1], ["dp"])
    scalars = [TensorSpec((1,), None, "float32")] * 2 + [TensorSpec((1,), None, "int32")]
    rule = get_rule("pd_op.linspace")
    assert rule.infer_forward(scalars, {}, RuleContext(mesh)).outputs[0].is_replicated
    wanted = TensorSpec((8,), DistAttr.parse("[S(0)]", mesh, 1))
    assert rule.infer_backward(scalars, [wanted], {}, RuleContext(mesh)).outputs[0].is_replicated


@given(meshes(), shapes(1, 3, max_side=4), st.integers(1, 3), st.data())
def test_expand_as_and_grad(mesh, shape, lead, data):
    """``expand_as(x, y)``: x broadcast to y's shape (ViT's class token to the batch); y is read
    for its shape only, so it may lie split as the output does."""
    x_shape = [1 if data.draw(st.booleans()) else s for s in shape]
    target = [lead, *shape]
    x, y = _rand(x_shape), _rand(target, 1)
    attrs = {"target_shape": target}
    dists = [data.draw(maybe_dist_attrs(mesh, len(x_shape), partial=True)), data.draw(maybe_dist_attrs(mesh, len(target)))]

    def local(inputs, attrs):  # each rank broadcasts to its piece of y
        return [np.broadcast_to(inputs[0], inputs[1].shape).copy()]

    check_rule("expand_as", local, [x, y], dists, attrs, mesh)
    g = _rand(target, 2)
    dists = [data.draw(maybe_dist_attrs(mesh, len(x_shape))), data.draw(maybe_dist_attrs(mesh, len(target), partial=True))]
    check_rule("expand_as_grad", lambda ins, a: [_sum_to(ins[1], ins[0].shape)], [x, g], dists, attrs, mesh)


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_label_smooth_and_grad(mesh, shape, data):
    label = np.random.default_rng(5).random(shape).astype("float32")
    attrs = {"epsilon": 0.1}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape)))
    result = check_rule("label_smooth", lambda ins, a: [(1 - 0.1) * ins[0] + 0.1 / ins[0].shape[-1]], [label, None], [dist, None], attrs, mesh).result
    assert not result.inputs[0].mapping[-1]  # the class count the kernel divides by is whole
    g = _rand(shape, 1)
    check_rule("label_smooth_grad", lambda ins, a: [(1 - 0.1) * ins[0]], [g], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh)
