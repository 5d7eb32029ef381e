"""dropout (training and test), dropout_grad and the unary grads with extra operands
(clip_grad's min / max, silu_grad's x and out) checked numerically with hypothesis."""

import numpy as np
import paddle
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops

import autopar
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dygraph, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def dropout(inputs, attrs):
    """(x, seed_tensor, p) -> (out, mask): Paddle's kernel with the program's fixed seed."""
    with dygraph():
        x = paddle.to_tensor(inputs[0])
        out = _C_ops.dropout(x, None, float(inputs[2][0]), attrs["is_test"], "upscale_in_train", 3, True)
        return [out.numpy(), (out.numpy() != 0).astype("uint8")]


@given(meshes(), shapes(1, 3), st.data())
def test_dropout_at_test_time_is_an_elementwise_scale(mesh, shape, data):
    x, p = _rand(shape) + 3.0, np.array([0.4], "float32")
    attrs = {"is_test": True, "fix_seed": True, "seed": 3, "mode": "upscale_in_train"}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape)))
    check = check_rule("dropout", dropout, [x, None, p], [dist, None, None], attrs, mesh)
    if dist is not None and all(np.prod([mesh.shape[d] for d in dims]) <= n for dims, n in zip(dist.mapping, shape)):
        assert check.result.inputs[0].mapping == dist.mapping


@given(meshes(), shapes(1, 3), st.data())
def test_training_dropout_keeps_the_split_and_the_rewrite_draws_the_serial_mask(mesh, shape, data):
    """The rule keeps any split of x (made complete); Paddle's kernel on a piece would draw the
    serial mask's first rows, so the rank program draws the whole mask and takes its box
    (passes/dropout_slicing.py): here that box against the serial mask, numerically."""
    x, p = _rand(shape) + 3.0, np.array([0.4], "float32")
    attrs = {"is_test": False, "fix_seed": True, "seed": 3, "mode": "upscale_in_train"}
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    result = get_rule("dropout").infer_forward(
        [TensorSpec(shape, dist), None, TensorSpec((1,))], attrs, RuleContext(mesh, op_name="pd_op.dropout")
    )
    assert not result.inputs[0].is_partial and result.outputs[0] == result.inputs[0] == result.outputs[1]
    serial = dropout([x, None, p], attrs)[0]
    scaled = dropout([np.ones_like(x), None, p], attrs)[0]  # what every rank draws
    for rank in mesh.ranks:
        box = result.inputs[0].local_slices(shape, rank)
        np.testing.assert_allclose(x[box] * scaled[box], serial[box], rtol=1e-6)


def test_a_split_training_dropout_would_be_wrong_and_unseeded_dropout_is_refused():
    """Why x is whole: a rank's local draw is the serial mask's *first* rows, whatever rows it holds."""
    x = _rand((4, 6)) + 3.0
    full = dropout([x, None, np.array([0.5], "float32")], {"is_test": False})[0]
    second_half = dropout([x[2:], None, np.array([0.5], "float32")], {"is_test": False})[0]
    assert not np.array_equal(second_half, full[2:])
    mesh = autopar.ProcessMesh([0, 1], ["d"])
    with pytest.raises(autopar.AutoparError, match="without a fixed seed"):
        get_rule("dropout").infer_forward([TensorSpec((4, 6)), None, TensorSpec((1,))], {"fix_seed": False}, RuleContext(mesh, op_name="pd_op.dropout"))


def dropout_grad(inputs, attrs):
    with dygraph():
        mask, out_grad, p = (paddle.to_tensor(a) for a in inputs)
        return [_C_ops.dropout_grad(mask, out_grad, p, False, "upscale_in_train").numpy()]


@given(meshes(), shapes(1, 3), st.data())
def test_dropout_grad(mesh, shape, data):
    mask = (np.random.default_rng(1).random(shape) > 0.4).astype("uint8")
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), None]
    check_rule("dropout_grad", dropout_grad, [mask, _rand(shape, 2), np.array([0.4], "float32")], dists, {}, mesh)


@given(meshes(), shapes(1, 3), st.data())
def test_clip_grad_and_silu_grad_with_extra_operands(mesh, shape, data):
    x, g = _rand(shape), _rand(shape, 1)
    lo, hi = np.array([-0.5], "float32"), np.array([0.5], "float32")

    def clip_grad(inputs, attrs):
        with dygraph():
            return [_C_ops.clip_grad(*(paddle.to_tensor(a) for a in inputs)).numpy()]

    def silu_grad(inputs, attrs):
        with dygraph():
            return [_C_ops.silu_grad(*(paddle.to_tensor(a) for a in inputs)).numpy()]

    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    check_rule("clip_grad", clip_grad, [x, g, lo, hi], dists + [None, None], {}, mesh)
    out = x / (1 + np.exp(-x))
    check_rule("silu_grad", silu_grad, [x, out.astype("float32"), g], [dists[0], None, dists[1]], {}, mesh)
