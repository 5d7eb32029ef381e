"""conv2d / pool2d rules and their grads checked numerically (hypothesis), forward and
backward inference, NCHW and NHWC, groups 1 and 2."""

import numpy as np
import paddle
import paddle.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, eager, eager_grad, maybe_dist_attrs, meshes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@st.composite
def conv_cases(draw, mesh):
    """Batch and channels at least the mesh size: Paddle's kernels reject the empty pieces of
    a dim split over more ranks than it has elements (uneven splits are still drawn)."""
    groups = draw(st.sampled_from([1, 1, 2]))
    m = mesh.size
    n, c, o = draw(st.integers(m, m + 2)), draw(st.integers(m, m + 2)) * groups, draw(st.integers(m, m + 2)) * groups
    k, stride, pad, dil = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 2)),
        draw(st.integers(0, 1)),
        draw(st.integers(1, 2)),
    )
    side = draw(st.integers(max(1, (k - 1) * dil + 1 - 2 * pad), 6))
    nhwc = draw(st.booleans())
    x_shape = (n, side, side, c) if nhwc else (n, c, side, side)
    attrs = {
        "strides": [stride] * 2, "paddings": [pad] * 2, "dilations": [dil] * 2, "padding_algorithm": "EXPLICIT",
        "groups": groups, "data_format": "NHWC" if nhwc else "NCHW",
    }  # fmt: skip
    return x_shape, (o, c // groups, k, k), attrs


def conv(x, w, strides, paddings, dilations, groups, data_format, **_):
    return F.conv2d(x, w, stride=strides, padding=paddings, dilation=dilations, groups=groups, data_format=data_format)


@given(meshes(), st.data())
def test_conv2d(mesh, data):
    case = data.draw(conv_cases(mesh))
    x_shape, w_shape, attrs = case
    x, w = _rand(x_shape), _rand(w_shape, 1)
    dists = [data.draw(maybe_dist_attrs(mesh, 4, partial=True)), data.draw(maybe_dist_attrs(mesh, 4, partial=True))]
    check = check_rule("conv2d", eager(conv), [x, w], dists, attrs, mesh)
    if attrs["groups"] == 1 and dists[0] is not None and not dists[0].partial:
        batch = check.result.inputs[0].mapping[0]
        assert batch == dists[0].mapping[0] or not dists[0].mapping[0] or dists[1] is not None
    out = data.draw(dist_attrs(mesh, 4))
    check_rule("conv2d", eager(conv), [x, w], [None, None], attrs, mesh, backward=[out])


@given(meshes(), st.data())
def test_conv2d_grad(mesh, data):
    case = data.draw(conv_cases(mesh))
    x_shape, w_shape, attrs = case
    x, w = _rand(x_shape), _rand(w_shape, 1)
    out = eager(conv)([x, w], attrs)[0]
    dists = [
        data.draw(maybe_dist_attrs(mesh, 4)),
        data.draw(maybe_dist_attrs(mesh, 4)),
        data.draw(maybe_dist_attrs(mesh, 4, partial=True)),
    ]
    check_rule("conv2d_grad", eager_grad(conv, [0, 1]), [x, w, _rand(out.shape, 2)], dists, attrs, mesh, atol=1e-3)


@st.composite
def pool_cases(draw, mesh):
    n, c = draw(st.integers(mesh.size, mesh.size + 2)), draw(st.integers(mesh.size, mesh.size + 2))
    k, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    side = draw(st.integers(k, 6))
    nhwc = draw(st.booleans())
    attrs = {
        "strides": [stride] * 2, "paddings": [0, 0], "pooling_type": draw(st.sampled_from(["max", "avg"])),
        "ceil_mode": False, "exclusive": True, "data_format": "NHWC" if nhwc else "NCHW", "global_pooling": False,
        "adaptive": False, "padding_algorithm": "EXPLICIT", "kernel_size": [k, k],
    }  # fmt: skip
    return ((n, side, side, c) if nhwc else (n, c, side, side)), attrs


def pool(x, kernel_operand, kernel_size, strides, paddings, pooling_type, data_format, **_):
    f = F.max_pool2d if pooling_type == "max" else F.avg_pool2d
    return f(x, kernel_size, strides, paddings, data_format=data_format)


def pool_grad_forward(x, out, kernel_operand, **attrs):
    return pool(x, kernel_operand, **attrs)


@given(meshes(), st.data())
def test_pool2d_and_grad(mesh, data):
    case = data.draw(pool_cases(mesh))
    x_shape, attrs = case
    x = _rand(x_shape)
    kernel = np.array(attrs["kernel_size"], "int64")
    dist = data.draw(maybe_dist_attrs(mesh, 4, partial=True))
    check_rule("pool2d", eager(pool), [x, kernel], [dist, None], attrs, mesh)
    out = eager(pool)([x, kernel], attrs)[0]
    check_rule("pool2d", eager(pool), [x, kernel], [None, None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, 4))])
    dists = [
        data.draw(maybe_dist_attrs(mesh, 4)),
        data.draw(maybe_dist_attrs(mesh, 4)),
        data.draw(maybe_dist_attrs(mesh, 4, partial=True)),
        None,
    ]
    check_rule("pool2d_grad", pool_grad, [x, out, _rand(out.shape, 1), kernel], dists, attrs, mesh)


def pool_grad(inputs, attrs):
    """pool2d_grad (x, out, out_grad, kernel_size) through eager_grad (out_grad last there)."""
    x, out, out_grad, kernel = inputs
    return eager_grad(pool_grad_forward, [0])([x, out, kernel, out_grad], attrs)


def test_pool_grad_operand_order():
    """pool2d_grad's operands are (x, out, out_grad, kernel_size) (pool_grad above relies on it)."""
    with paddle.pir_utils.IrGuard():
        paddle.enable_static()
        main = paddle.static.Program()
        with paddle.static.program_guard(main):
            x = paddle.static.data("x", [2, 3, 4, 4], "float32")
            x.stop_gradient = False
            loss = F.max_pool2d(x, 2).sum()
            paddle.static.append_backward(loss)
        ops = [op for op in main.global_block().ops if op.name() == "pd_op.pool2d_grad"]
        paddle.disable_static()
    assert list(ops[0].get_input_names()) == ["x", "out", "out_grad", "kernel_size"]


# ---- readable cases -----------------------------------------------------------------------

MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
NCHW = {"groups": 1, "data_format": "NCHW"}


def _infer(op, shapes_, texts, attrs):
    specs = [TensorSpec(s, None if t is None else DistAttr.parse(t, MESH, len(s))) for s, t in zip(shapes_, texts)]
    result = get_rule(op).infer_forward(specs, attrs, RuleContext(MESH, op_name=op))
    return [str(d) for d in result.inputs], [str(d) for d in result.outputs]


def test_conv_batch_and_out_channel_split():
    """nchw[S(0),R], ockl[R,S(0)] -> nohw[S(0),S(1)]: data parallel x output-channel parallel."""
    ins, outs = _infer("conv2d", [(4, 3, 8, 8), (6, 3, 3, 3)], ["[S(0),R]", "[R,S(0)]"], NCHW)
    assert ins == ["[S(0),R]", "[R,S(0)]"] and outs == ["[S(0),S(1)]"]


def test_conv_in_channel_split_is_partial():
    """nchw[R,S(1)], ockl[R,S(1)] -> [R,P(sum)]: the contracted channels leave a pending sum."""
    ins, outs = _infer("conv2d", [(4, 4, 8, 8), (6, 4, 3, 3)], ["[R,S(1)]", "[R,S(1)]"], NCHW)
    assert outs == ["[R,P(sum)]"]


def test_conv_spatial_whole_and_grouped():
    ins, outs = _infer(
        "conv2d", [(4, 4, 8, 8), (6, 2, 3, 3)], ["[S(0),S(2)]", "[R,S(0)]"], {"groups": 2, "data_format": "NCHW"}
    )
    assert ins == ["[S(0),R]", "[R,R]"] and outs == ["[S(0),R]"]


def test_conv_grad_filter_partial_over_batch():
    """Data parallel: filter_grad is P(sum) over the batch's mesh dim."""
    ins, outs = _infer("conv2d_grad", [(4, 3, 8, 8), (6, 3, 3, 3), (4, 6, 8, 8)], ["[S(0),R]", None, None], NCHW)
    assert outs == ["[S(0),R]", "[P(sum),R]"]
