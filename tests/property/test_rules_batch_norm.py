"""batch_norm / batch_norm_grad rules with hypothesis (notation in autopar/spmd/batch_norm.py):

    batch_norm       nchw,c,c,c,c -> nchw,c,c,c,c,1      outputs complete
    batch_norm_grad  nchw,c,c,c,c,c,c,1,nchw -> nchw,c,c

With running statistics (eval) every split is checked numerically against Paddle's kernel on
each rank's piece; so is a training op whose x is split on channels only. A training op whose
statistic dims are split is exact only after the per-rank rewrite (passes/batch_norm_stats.py,
checked end to end in tests/equivalence/test_batch_norm.py): here its placements are checked,
and :func:`split_statistics` names exactly those ops.
"""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops

from autopar import DistAttr
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.batch_norm import channel_axis, split_statistics
from autopar.testing import check_rule, dist_attrs, dygraph, meshes, shapes

EPS, MOMENTUM = 1e-5, 0.9


def _rand(shape, seed=0, positive=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype("float32")
    return np.abs(x) + 0.5 if positive else x


def _attrs(data_format, is_test):
    return {"is_test": is_test, "momentum": MOMENTUM, "epsilon": EPS, "data_format": data_format,
            "use_global_stats": False, "trainable_statistics": False}  # fmt: skip


def batch_norm(inputs, attrs):
    """Paddle's kernel; in eval mode saved_mean / saved_variance are left uninitialized (zeros here)."""
    with dygraph():
        out = _C_ops.batch_norm(*map(paddle.to_tensor, inputs), attrs["is_test"], MOMENTUM, EPS,
                                attrs["data_format"], False, False)  # fmt: skip
        got = [t.numpy() for t in out]
    if attrs["is_test"]:
        got[3], got[4] = np.zeros_like(got[3]), np.zeros_like(got[4])
    got[5] = np.zeros((1,), "float32")  # reserve_space: empty on CPU
    return got


def batch_norm_grad(inputs, attrs):
    with dygraph():
        tensors = [paddle.to_tensor(x) for x in inputs]
        grads = _C_ops.batch_norm_grad(*tensors, MOMENTUM, EPS, attrs["data_format"], attrs["is_test"], False, False)
        return [g.numpy() for g in grads]


@st.composite
def cases(draw):
    shape = draw(shapes(2, 4, min_side=1, max_side=5))
    data_format = draw(st.sampled_from(["NCHW", "NHWC"])) if len(shape) > 2 else "NCHW"
    channels = shape[channel_axis(len(shape), {"data_format": data_format})]
    x = _rand(shape)
    stats = [_rand((channels,), 1), _rand((channels,), 2, positive=True), _rand((channels,), 3), _rand((channels,), 4)]
    return x, stats, data_format


@given(meshes(max_ranks=4), cases(), st.data())
def test_eval_batch_norm_any_split(mesh, case, data):
    x, stats, data_format = case
    attrs = _attrs(data_format, is_test=True)
    dists = [data.draw(dist_attrs(mesh, x.ndim, partial=True))] + [None] * 4
    result = check_rule("batch_norm", batch_norm, [x, *stats], dists, attrs, mesh).result
    assert all(not o.is_partial for o in result.outputs)
    assert not result.inputs[0].is_partial
    ch = channel_axis(x.ndim, attrs)
    assert all(r.mapping[0] == result.inputs[0].mapping[ch] for r in result.inputs[1:])
    assert split_statistics("batch_norm_", attrs, result.inputs, x.shape) is None  # no rewrite: running stats


@given(meshes(max_ranks=4), cases(), st.data())
def test_eval_batch_norm_grad_any_split(mesh, case, data):
    x, (mean, var, scale, bias), data_format = case
    attrs = _attrs(data_format, is_test=True)
    dy = _rand(x.shape, 5)
    inputs = [x, scale, bias, mean, var, mean, var, np.zeros((1,), "float32"), dy]
    dists = [data.draw(dist_attrs(mesh, x.ndim))] + [None] * 7 + [data.draw(dist_attrs(mesh, x.ndim))]
    check_rule("batch_norm_grad", batch_norm_grad, inputs, dists, attrs, mesh)


@given(meshes(max_ranks=4), cases(), st.data())
def test_training_batch_norm_channel_split_is_local(mesh, case, data):
    """Only the channel split: each rank's kernel is exact, nothing to all-reduce."""
    x, stats, data_format = case
    attrs = _attrs(data_format, is_test=False)
    ch = channel_axis(x.ndim, attrs)
    drawn = data.draw(dist_attrs(mesh, x.ndim))
    only_channel = DistAttr.of(mesh, tuple(dims if t == ch else () for t, dims in enumerate(drawn.mapping)))
    result = check_rule("batch_norm", batch_norm, [x, *stats], [only_channel] + [None] * 4, attrs, mesh).result
    assert split_statistics("batch_norm_", attrs, result.inputs, x.shape) is None


@given(meshes(max_ranks=4), cases(), st.data())
def test_training_batch_norm_keeps_batch_split(mesh, case, data):
    """A split batch (or spatial dim) is kept, outputs are complete, partial x is required
    complete, and split_statistics names the all_reduce's mesh dims."""
    x, stats, data_format = case
    attrs = _attrs(data_format, is_test=False)
    given_x = data.draw(dist_attrs(mesh, x.ndim, partial=True))
    specs = [TensorSpec(x.shape, given_x)] + [TensorSpec(s.shape) for s in stats]
    result = get_rule("pd_op.batch_norm_").infer_forward(specs, attrs, RuleContext(mesh))
    required = result.inputs[0]
    fits = tuple(
        dims if np.prod([mesh.shape[m] for m in dims]) <= n else () for dims, n in zip(given_x.mapping, x.shape)
    )
    assert not required.is_partial and required.mapping == fits  # a split into more pieces than elements is dropped
    assert all(not o.is_partial for o in result.outputs)
    ch = channel_axis(x.ndim, attrs)
    assert result.outputs[0].mapping == required.mapping
    assert all(o.mapping == (required.mapping[ch],) for o in result.outputs[1:5])
    split = split_statistics("batch_norm_", attrs, result.inputs, x.shape)
    stat_dims = sorted({m for t, dims in enumerate(required.mapping) if t != ch for m in dims})
    if np.prod([mesh.shape[m] for m in stat_dims]) > 1:
        assert split is not None and list(split.mesh_dims) == stat_dims and ch not in split.axes
        assert split.count == np.prod([n for t, n in enumerate(x.shape) if t != ch])
    else:
        assert split is None


@given(meshes(max_ranks=4), cases(), st.data())
def test_training_batch_norm_grad_outputs_complete(mesh, case, data):
    x, (mean, var, scale, bias), data_format = case
    attrs = _attrs(data_format, is_test=False)
    vec = TensorSpec(mean.shape)
    dy = data.draw(dist_attrs(mesh, x.ndim, partial=True))
    specs = (
        [TensorSpec(x.shape, data.draw(dist_attrs(mesh, x.ndim)))]
        + [vec] * 6
        + [TensorSpec((1,)), TensorSpec(x.shape, dy)]
    )
    result = get_rule("batch_norm_grad").infer_forward(specs, attrs, RuleContext(mesh))
    assert not any(r.is_partial for r in result.inputs if r is not None)
    assert result.inputs[0].mapping == result.inputs[8].mapping == result.outputs[0].mapping
    assert all(not o.is_partial for o in result.outputs)
