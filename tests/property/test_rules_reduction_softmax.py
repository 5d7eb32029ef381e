"""Reductions, softmax / log_softmax and cross_entropy_with_softmax rules checked numerically
(hypothesis): forward, grad ops (Paddle's own grad kernels) and backward inference. A split
normalized axis is checked through the decomposition each rank runs (split_rows.check_split_rule)."""

import numpy as np
import paddle
import paddle.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops
from split_rows import check_split_rule

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, eager, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    if ties:  # small integers: rows with several equal maxima
        return rng.integers(0, 3, shape).astype("float32")
    return rng.standard_normal(shape).astype("float32")


def _kernel(fn):
    """``fn(*tensors, **attrs)`` on numpy inputs (None stays None) -> list of numpy outputs.

    ``fn`` must pass attrs to a ``_C_ops`` kernel positionally: keywords crash some kernels.
    """

    def run(inputs, attrs):
        with dygraph():
            out = fn(*[None if x is None else paddle.to_tensor(x) for x in inputs], **attrs)
            outs = out if isinstance(out, (list, tuple)) else [out]
            return [o.numpy() for o in outs]

    return run


# ---- reductions ----------------------------------------------------------------------------

REDUCE = {"sum": paddle.sum, "mean": paddle.mean, "max": paddle.max, "min": paddle.min}


@st.composite
def reduce_cases(draw):
    shape = draw(shapes(0, 3, max_side=6))
    ndim = len(shape)
    axes = draw(st.lists(st.integers(-ndim, ndim - 1), unique_by=lambda a: a % ndim, max_size=ndim)) if ndim else []
    return shape, {"axis": axes, "keepdim": draw(st.booleans())}


def _reduce(name):
    return eager(lambda x, axis_operand, axis, keepdim: REDUCE[name](x, axis=axis or None, keepdim=keepdim))


@given(meshes(), reduce_cases(), st.sampled_from(sorted(REDUCE)), st.data())
def test_reduction_forward_and_backward_inference(mesh, case, name, data):
    shape, attrs = case
    x, axis = _rand(shape, ties=name in ("max", "min")), np.array(attrs["axis"], "int64")
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=name in ("sum", "mean")))
    check = check_rule(name, _reduce(name), [x, axis], [dist, None], attrs, mesh)
    if name in ("sum", "mean") and dist is not None:
        assert check.result.inputs[0].partial == dist.partial  # linear: a pending sum stays pending
    out = _reduce(name)([x, axis], attrs)[0]
    check_rule(name, _reduce(name), [x, axis], [None, None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, out.ndim))])


GRAD_KERNELS = {
    "sum_grad": lambda x, g, axis_operand, axis, keepdim: _C_ops.sum_grad(x, g, axis, keepdim, False),
    "mean_grad": lambda x, g, axis_operand, axis, keepdim: _C_ops.mean_grad(x, g, axis, keepdim, False),
}


@given(meshes(), reduce_cases(), st.sampled_from(sorted(GRAD_KERNELS)), st.data())
def test_sum_mean_grad(mesh, case, name, data):
    shape, attrs = case
    x, axis = _rand(shape), np.array(attrs["axis"], "int64")
    out_grad = _rand(_reduce("sum")([x, axis], attrs)[0].shape, 1)
    x_dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    dists = [x_dist, data.draw(maybe_dist_attrs(mesh, out_grad.ndim, partial=True)), None]
    check = check_rule(name, _kernel(GRAD_KERNELS[name]), [x, out_grad, axis], dists, attrs, mesh)
    if x_dist is not None and dists[1] is None:
        assert check.result.inputs[0].partial == x_dist.partial  # x is read for its shape: sums stay pending


@given(meshes(), reduce_cases(), st.sampled_from(["max", "min"]), st.data())
def test_max_min_grad_with_ties(mesh, case, name, data):
    shape, attrs = case
    x, axis = _rand(shape, ties=True), np.array(attrs["axis"], "int64")
    out = _reduce(name)([x, axis], attrs)[0]
    grad = getattr(_C_ops, f"{name}_grad")
    kernel = _kernel(lambda x, o, g, axis_operand, axis, keepdim: grad(x, o, g, axis, keepdim, False))
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, out.ndim))]
    dists += [data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)), None]
    check_rule(f"{name}_grad", kernel, [x, out, _rand(out.shape, 1), axis], dists, attrs, mesh)


def test_mean_over_split_batch_is_a_scaled_pending_sum():
    """``n[S(0)] -> P(sum)`` with each rank's mean scaled by n_local / n (uneven split: 5 = 3 + 2)."""
    mesh = ProcessMesh([0, 1], ["dp"])
    x = TensorSpec((5, 3), DistAttr(mesh, [0, -1]))
    rule = get_rule("mean")
    result = rule.infer_forward([x, TensorSpec((0,))], {"axis": [], "keepdim": False}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[P(sum)]"
    required = [x, TensorSpec((0,), result.inputs[1])]
    assert [rule.local_scale(required, {"axis": []}, r) for r in (0, 1)] == [3 / 5, 2 / 5]
    assert rule.local_scale(required, {"axis": [1]}, 0) == 1.0  # the split dim is not reduced


# ---- softmax / log_softmax -----------------------------------------------------------------


@st.composite
def softmax_cases(draw):
    shape = draw(shapes(1, 3, max_side=6))
    return shape, {"axis": draw(st.integers(-len(shape), len(shape) - 1))}


@given(meshes(), softmax_cases(), st.sampled_from(["softmax", "log_softmax"]), st.data())
def test_softmax_and_grad(mesh, case, name, data):
    shape, attrs = case
    x = _rand(shape)
    forward = eager(lambda t, axis: getattr(F, name)(t, axis=axis))
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    check = check_split_rule(name, forward, [x], [dist], attrs, mesh)
    assert check.result.outputs[0].mapping == check.result.inputs[0].mapping  # every split kept, the axis's too
    check_split_rule(name, forward, [x], [None], attrs, mesh, backward=[data.draw(dist_attrs(mesh, len(shape)))])
    out = forward([x], attrs)[0]
    kernel = getattr(_C_ops, f"{name}_grad")
    grad = _kernel(lambda out, out_grad, axis: kernel(out, out_grad, axis))  # _C_ops take no keywords
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    check_split_rule(f"{name}_grad", grad, [out, _rand(shape, 1)], dists, attrs, mesh)


# ---- cross_entropy_with_softmax ------------------------------------------------------------


@st.composite
def cross_entropy_cases(draw, shape_strategy=None):
    """Logits shape, a hard (int64, size 1 on the class axis, maybe an ignored row) or soft
    label, and the op's attrs."""
    shape = draw(shape_strategy if shape_strategy is not None else shapes(1, 3, max_side=6))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    soft = draw(st.booleans())
    attrs = {"soft_label": soft, "use_softmax": True, "numeric_stable_mode": True, "ignore_index": -100, "axis": axis}
    rng = np.random.default_rng(2)
    if soft:
        label = rng.random(shape).astype("float32")
        label /= label.sum(axis=axis, keepdims=True)
    else:
        label_shape = list(shape)
        label_shape[axis] = 1
        label = rng.integers(0, shape[axis], label_shape).astype("int64")
        if label.size and draw(st.booleans()):
            label.flat[0] = -100  # an ignored row
    return shape, label, attrs


ATTR_ORDER = ("soft_label", "use_softmax", "numeric_stable_mode", "ignore_index", "axis")


def _ce(logits, label, **a):
    return _C_ops.cross_entropy_with_softmax(logits, label, *(a[k] for k in ATTR_ORDER))


def _ce_grad(label, softmax, loss_grad, **a):
    return _C_ops.cross_entropy_with_softmax_grad(label, softmax, loss_grad, *(a[k] for k in ATTR_ORDER))


@given(meshes(), cross_entropy_cases(), st.data())
def test_cross_entropy_with_softmax_and_grad(mesh, case, data):
    shape, label, attrs = case
    logits = _rand(shape)
    # class-sharded logits are drawn too: kept for a hard label (vocabulary-parallel), gathered for a soft one
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, label.ndim))]
    check = check_split_rule("cross_entropy_with_softmax", _kernel(_ce), [logits, label], dists, attrs, mesh)
    classes = check.result.inputs[0].mapping[attrs["axis"]]
    assert not (classes and attrs["soft_label"])
    assert not set(classes) & set(check.result.outputs[1].partial_dims)  # the loss comes out whole over them
    outs = [data.draw(dist_attrs(mesh, len(shape)))] * 2
    check_split_rule("cross_entropy_with_softmax", _kernel(_ce), [logits, label], [None, None], attrs, mesh, backward=outs)
    softmax, loss = _kernel(_ce)([logits, label], attrs)
    dists = [data.draw(maybe_dist_attrs(mesh, label.ndim)), data.draw(maybe_dist_attrs(mesh, len(shape)))]
    dists.append(data.draw(maybe_dist_attrs(mesh, loss.ndim, partial=True)))
    grad_operands = [label, softmax, _rand(loss.shape, 1)]
    check_split_rule("cross_entropy_with_softmax_grad", _kernel(_ce_grad), grad_operands, dists, attrs, mesh)


def test_cross_entropy_keeps_the_batch_and_class_splits_of_a_hard_label():
    """``bc[S(0),S(1)]`` with a hard label -> softmax ``[S(0),S(1)]``, loss ``b1[S(0),R]`` (the class
    split finished by all_reduces of one value per row); with a soft label the classes are gathered."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    logits = TensorSpec((8, 10), DistAttr(mesh, ["dp", "mp"]))
    label = TensorSpec((8, 1), None, "int64")
    result = get_rule("cross_entropy_with_softmax").infer_forward([logits, label], {"axis": -1}, RuleContext(mesh))
    assert [str(d) for d in result.inputs] == ["[S(0),S(1)]", "[S(0),R]"]
    assert [str(d) for d in result.outputs] == ["[S(0),S(1)]", "[S(0),R]"]
    soft = TensorSpec((8, 10), None)
    result = get_rule("cross_entropy_with_softmax").infer_forward([logits, soft], {"axis": -1, "soft_label": True}, RuleContext(mesh))
    assert [str(d) for d in result.inputs] == ["[S(0),R]", "[S(0),R]"]
    assert [str(d) for d in result.outputs] == ["[S(0),R]", "[S(0),R]"]
