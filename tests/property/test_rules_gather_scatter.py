"""Index-driven reads and writes checked numerically (hypothesis) against Paddle's kernels:
take_along_axis, put_along_axis (every reduce mode), gather_nd, scatter, masked_select and
their grads. Indices may be smaller than the tensor they address (``broadcast=False``), which
is where a careless rule splits a dim the kernel addresses by local position."""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@st.composite
def along_axis_cases(draw):
    """arr's shape, an axis, and an index shape no larger than arr off the axis."""
    shape = draw(shapes(1, 3, min_side=1, max_side=5))
    axis = draw(st.integers(0, len(shape) - 1))
    index_shape = tuple(
        draw(st.integers(1, 5)) if d == axis else draw(st.sampled_from([size, max(1, size - 1)])) for d, size in enumerate(shape)
    )  # fmt: skip
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    return _rand(shape), axis, rng.integers(0, shape[axis], index_shape).astype("int64")


@given(meshes(), along_axis_cases(), st.data())
def test_take_along_axis_and_grad(mesh, case, data):
    arr, axis, index = case
    dists = [data.draw(maybe_dist_attrs(mesh, arr.ndim, partial=True)), data.draw(maybe_dist_attrs(mesh, index.ndim))]
    take = eager(lambda a, i, axis: paddle.take_along_axis(a, i, axis, broadcast=False))
    check = check_rule("take_along_axis", take, [arr, index], dists, {"axis": axis}, mesh)
    assert not check.result.inputs[0].mapping[axis]
    g = _rand(index.shape, 1)
    grad = eager_grad(lambda a, i, axis: paddle.take_along_axis(a, i, axis, broadcast=False), [0])
    dists = [data.draw(maybe_dist_attrs(mesh, arr.ndim)), data.draw(maybe_dist_attrs(mesh, index.ndim)), data.draw(maybe_dist_attrs(mesh, g.ndim, partial=True))]
    check_rule("take_along_axis_grad", grad, [arr, index, g], dists, {"axis": axis}, mesh)


def test_take_along_axis_splits_the_lookups_along_the_axis():
    """Each rank looks up its own rows of indices along the axis against the whole arr; a grad
    from those rows is a pending sum (two ranks may add into one row of arr)."""
    mesh = ProcessMesh([0, 1], ["dp"])
    split = DistAttr(mesh, [(0,), ()])
    arr, index = TensorSpec((4, 6)), TensorSpec((8, 6), split, "int64")
    result = get_rule("take_along_axis").infer_forward([arr, index], {"axis": 0}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(0)]" and result.inputs[0].is_replicated
    grad = get_rule("take_along_axis_grad").infer_forward([arr, index, TensorSpec((8, 6), split)], {"axis": 0}, RuleContext(mesh))
    assert str(grad.outputs[0]) == "[P(sum)]"


REDUCES = ["assign", "add", "mul", "mean", "amin", "amax"]


@given(meshes(), along_axis_cases(), st.sampled_from(REDUCES), st.booleans(), st.data())
def test_put_along_axis_and_grad(mesh, case, reduce, include_self, data):
    arr, axis, index = case
    values = _rand(index.shape, 2)
    attrs = {"axis": axis, "reduce": reduce, "include_self": include_self}
    dists = [data.draw(maybe_dist_attrs(mesh, arr.ndim, partial=True)) for _ in range(3)]

    def put(a, i, v, axis, reduce, include_self):
        return paddle.put_along_axis(a, i, v, axis, reduce=reduce, include_self=include_self, broadcast=False)

    check = check_rule("put_along_axis", eager(put), [arr, index, values], dists, attrs, mesh)
    assert not any(check.result.inputs[k].mapping[axis] for k in range(3))
    if reduce not in ("assign", "add"):
        return  # Paddle's grad kernel covers assign and add only
    out = eager(put)([arr, index, values], attrs)[0]
    g = _rand(arr.shape, 3)

    def grads(inputs, attrs):  # (arr, indices, values, out, out_grad) -> (arr_grad, values_grad)
        a, i, v, _, gv = inputs
        return eager_grad(put, [0, 2])([a, i, v, gv], attrs)

    dists = [data.draw(maybe_dist_attrs(mesh, arr.ndim)) for _ in range(4)] + [data.draw(maybe_dist_attrs(mesh, arr.ndim, partial=True))]
    check_rule("put_along_axis_grad", grads, [arr, index, values, out, g], dists, attrs, mesh)


@st.composite
def gather_nd_cases(draw):
    x_shape = draw(shapes(1, 3, max_side=4))
    k = draw(st.integers(0, len(x_shape)))
    batch = draw(shapes(1, 2, max_side=4))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    index = np.stack([rng.integers(0, x_shape[d], batch) for d in range(k)], -1) if k else np.zeros(batch + (0,))
    return _rand(x_shape), index.astype("int64")


@given(meshes(), gather_nd_cases(), st.data())
def test_gather_nd_and_grad(mesh, case, data):
    x, index = case
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)), data.draw(maybe_dist_attrs(mesh, index.ndim))]
    check = check_rule("gather_nd", eager(paddle.gather_nd), [x, index], dists, {}, mesh)
    assert not any(check.result.inputs[0].mapping[: index.shape[-1]])
    out = eager(paddle.gather_nd)([x, index], {})[0]
    g = _rand(out.shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)), data.draw(maybe_dist_attrs(mesh, index.ndim)), data.draw(maybe_dist_attrs(mesh, g.ndim, partial=True))]
    check_rule("gather_nd_grad", eager_grad(paddle.gather_nd, [0]), [x, index, g], dists, {}, mesh)


@st.composite
def scatter_cases(draw):
    shape = draw(shapes(1, 3, min_side=2, max_side=5))
    count = draw(st.integers(1, shape[0]))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    index = rng.permutation(shape[0])[:count].astype("int64")  # unique: an overwrite is then well defined
    return _rand(shape), index, _rand((count,) + shape[1:], 1)


@given(meshes(), scatter_cases(), st.booleans(), st.data())
def test_scatter_and_grad(mesh, case, overwrite, data):
    x, index, updates = case
    attrs = {"overwrite": overwrite}
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)), data.draw(maybe_dist_attrs(mesh, 1)), data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))]
    scatter = eager(lambda t, i, u, overwrite: paddle.scatter(t, i, u, overwrite=overwrite))
    check = check_rule("scatter", scatter, [x, index, updates], dists, attrs, mesh)
    assert not check.result.inputs[0].mapping[0] and not check.result.inputs[2].mapping[0]
    g = _rand(x.shape, 2)

    def grads(inputs, attrs):  # (index, updates, out_grad) -> (x_grad, updates_grad)
        i, u, gv = inputs
        forward = lambda t, i, u, overwrite: paddle.scatter(t, i, u, overwrite=overwrite)  # noqa: E731
        return eager_grad(forward, [0, 2])([np.zeros_like(gv), i, u, gv], attrs)

    dists = [data.draw(maybe_dist_attrs(mesh, 1)), data.draw(maybe_dist_attrs(mesh, x.ndim)), data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))]
    check_rule("scatter_grad", grads, [index, updates, g], dists, attrs, mesh)


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_masked_select_is_whole_and_exact(mesh, shape, data):
    """masked_select's 1-d output has a data-dependent length: every operand whole, even when
    x arrives split (the pending sum of a partial x passes: selection is linear)."""
    x = _rand(shape)
    mask = np.random.default_rng(4).random(shape) > 0.5
    dists = [data.draw(dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, len(shape)))]
    check = check_rule("masked_select", eager(paddle.masked_select), [x, mask], dists, {}, mesh)
    assert all(not any(d.mapping) for d in (*check.result.inputs, *check.result.outputs))
    out = eager(paddle.masked_select)([x, mask], {})[0]
    g = _rand(out.shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), None, data.draw(maybe_dist_attrs(mesh, 1, partial=True))]
    check_rule("masked_select_grad", eager_grad(paddle.masked_select, [0]), [x, mask, g], dists, {}, mesh)
