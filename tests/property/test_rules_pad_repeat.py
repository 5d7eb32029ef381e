"""pad, pad3d and repeat_interleave (an int or a tensor of repeats) and their grads checked
numerically (hypothesis) against Paddle's kernels: a padded dim and a repeated dim cut into
uneven pieces are whole, everything else keeps its split."""

import math

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@given(meshes(), shapes(1, 3, max_side=5), st.sampled_from([0.0, 1.5]), st.data())
def test_pad_and_grad(mesh, shape, value, data):
    paddings = [data.draw(st.sampled_from([0, 0, 1, 2])) for _ in range(2 * len(shape))]
    x = _rand(shape)
    attrs = {"paddings": paddings, "pad_value": value}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    pad = eager(lambda t, v, paddings, pad_value: _C_ops.pad(t, paddings, pad_value))
    check = check_rule("pad", pad, [x, np.array([value], "float32")], [dist, None], attrs, mesh)
    padded = [d for d in range(len(shape)) if paddings[2 * d] or paddings[2 * d + 1]]
    assert not any(check.result.inputs[0].mapping[d] for d in padded)
    assert value == 0.0 or not check.result.inputs[0].partial  # a constant added is not a sum of pieces
    out = pad([x, np.array([value], "float32")], attrs)[0]
    g = _rand(out.shape, 1)
    grad = eager_grad(lambda t, paddings, pad_value: _C_ops.pad(t, paddings, pad_value), [0])
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), None]
    check_rule("pad_grad", lambda ins, a: grad([ins[0], ins[1]], a), [x, g, np.array([value], "float32")], dists, attrs, mesh)


MODES = ["constant", "reflect", "replicate", "circular"]


@given(meshes(), st.sampled_from(MODES), st.sampled_from(["NCDHW", "NDHWC"]), st.data())
def test_pad3d_and_grad(mesh, mode, data_format, data):
    shape = data.draw(shapes(5, 5, min_side=2, max_side=4))
    paddings = [data.draw(st.sampled_from([0, 0, 1])) for _ in range(6)]
    x = _rand(shape)
    attrs = {"paddings": paddings, "mode": mode, "pad_value": 0.5, "data_format": data_format}
    dist = data.draw(maybe_dist_attrs(mesh, 5, partial=True))

    def pad3d(t, p, paddings, mode, pad_value, data_format):
        return _C_ops.pad3d(t, paddings, mode, pad_value, data_format)

    check = check_rule("pad3d", eager(pad3d), [x, np.array(paddings, "int64")], [dist, None], attrs, mesh)
    spatial = (4, 3, 2) if data_format == "NCDHW" else (3, 2, 1)
    assert not any(check.result.inputs[0].mapping[d] for i, d in enumerate(spatial) if paddings[2 * i] or paddings[2 * i + 1])
    out = eager(pad3d)([x, np.array(paddings, "int64")], attrs)[0]
    g = _rand(out.shape, 1)
    grad = eager_grad(pad3d, [0])
    dists = [data.draw(maybe_dist_attrs(mesh, 5)), data.draw(maybe_dist_attrs(mesh, 5, partial=True)), None]
    check_rule("pad3d_grad", lambda ins, a: grad([ins[0], ins[2], ins[1]], a), [x, g, np.array(paddings, "int64")], dists, attrs, mesh)


def test_pad3d_with_paddings_computed_at_run_time_keeps_every_spatial_dim_whole():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    x = TensorSpec((2, 3, 4, 4, 4), DistAttr(mesh, [(0,), (), (), (), (1,)]))
    result = get_rule("pad3d").infer_forward([x, TensorSpec((6,), None, "int64")], {"mode": "reflect", "data_format": "NCDHW"}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(0),R]"


@given(meshes(), shapes(1, 3, max_side=6), st.integers(1, 3), st.data())
def test_repeat_interleave_and_grad(mesh, shape, repeats, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = _rand(shape)
    attrs = {"repeats": repeats, "axis": axis, "output_size": -1}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    repeat = eager(lambda t, repeats, axis, output_size: paddle.repeat_interleave(t, repeats, axis))
    check = check_rule("repeat_interleave", repeat, [x], [dist], attrs, mesh)
    split = check.result.inputs[0].mapping[axis]
    assert shape[axis] % math.prod(mesh.shape[d] for d in split) == 0  # kept only where even
    out = repeat([x], attrs)[0]
    g = _rand(out.shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    grad = eager_grad(lambda t, repeats, axis, output_size: paddle.repeat_interleave(t, repeats, axis), [0])
    check_rule("repeat_interleave_grad", grad, [x, g], dists, attrs, mesh)


def test_repeat_interleave_keeps_an_even_head_split():
    """Grouped-query attention repeats the key heads: 2 heads split over 2 ranks, 4 copies each."""
    mesh = ProcessMesh([0, 1], ["mp"])
    k = TensorSpec((2, 8, 2, 4), DistAttr(mesh, [(), (), (0,), ()]))
    result = get_rule("repeat_interleave").infer_forward([k], {"repeats": 4, "axis": 2, "output_size": -1}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(2)]"
    odd = TensorSpec((2, 8, 3, 4), DistAttr(mesh, [(), (), (0,), ()]))
    assert get_rule("repeat_interleave").infer_forward([odd], {"repeats": 4, "axis": 2, "output_size": -1}, RuleContext(mesh)).outputs[0].is_replicated


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_repeat_interleave_with_tensor_index_and_grad(mesh, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = _rand(shape)
    repeats = np.random.default_rng(5).integers(0, 3, shape[axis]).astype("int64")
    attrs = {"axis": axis, "output_size": -1}
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, 1))]
    repeat = eager(lambda t, r, axis, output_size: paddle.repeat_interleave(t, r, axis))
    check = check_rule("repeat_interleave_with_tensor_index", repeat, [x, repeats], dists, attrs, mesh)
    assert not check.result.inputs[0].mapping[axis]
    out = repeat([x, repeats], attrs)[0]
    g = _rand(out.shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), None, data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    grad = eager_grad(lambda t, r, axis, output_size: paddle.repeat_interleave(t, r, axis), [0])
    check_rule("repeat_interleave_with_tensor_index_grad", grad, [x, repeats, g], dists, attrs, mesh)
