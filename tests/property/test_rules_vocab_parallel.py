"""Rules that keep a split row (vocabulary-parallel embedding, class-split cross-entropy,
softmax over a split axis) checked numerically with hypothesis: each rank runs the
decomposition the rewrite pass emits (:func:`split_rows.check_split_rule`), and the
outputs rebuilt from the inferred placements equal Paddle's kernels on the full tensors
(rtol 1e-5)."""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops
from split_rows import check_split_rule
from test_rules_reduction_softmax import _ce, _ce_grad, _kernel

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.vocab_parallel import split_row
from autopar.testing import dist_attrs, dygraph, eager, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def splitting(mesh, ndim, dim, data, partial=False):
    """A placement that splits tensor dim ``dim`` over a mesh dim of several ranks (others random)."""
    pick = data.draw(st.sampled_from([d for d in range(mesh.ndim) if mesh.shape[d] > 1]))
    base = data.draw(dist_attrs(mesh, ndim, partial))
    mapping = [tuple(d for d in dims if d != pick) for dims in base.mapping]
    mapping[dim] = mapping[dim] + (pick,)
    return DistAttr(mesh, mapping, {d: k for d, k in base.partial if d != pick})


SPLIT_MESHES = meshes().filter(lambda mesh: mesh.size > 1)


def row_shapes(data, min_dims=1):
    """A shape and an axis whose row has at least two elements (so that it can be split)."""
    shape = list(data.draw(shapes(min_dims, 3, max_side=6)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    shape[axis] = data.draw(st.integers(2, 12))
    return tuple(shape), axis


# ---- embedding -------------------------------------------------------------------------------


def embedding(inputs, attrs):
    with dygraph():
        return [
            _C_ops.embedding(
                paddle.to_tensor(inputs[0]), paddle.to_tensor(inputs[1]), attrs["padding_idx"], False
            ).numpy()
        ]


def embedding_grad(inputs, attrs):
    with dygraph():
        return [_C_ops.embedding_grad(*map(paddle.to_tensor, inputs), attrs["padding_idx"], False).numpy()]


@st.composite
def vocab_cases(draw):
    ids_shape = draw(shapes(1, 2, max_side=6))
    vocab, hidden = draw(st.integers(2, 12)), draw(st.integers(1, 5))
    ids = np.random.default_rng(draw(st.integers(0, 9))).integers(0, vocab, ids_shape).astype("int64")
    padding = draw(st.sampled_from([-1, int(ids.flat[0]), vocab - 1]))
    return ids, _rand((vocab, hidden)), {"padding_idx": padding, "sparse": False}


@given(SPLIT_MESHES, vocab_cases(), st.data())
def test_vocab_split_embedding_and_grad(mesh, case, data):
    """A vocabulary split is kept: out partial (sum) over its mesh dims, weight_grad split like
    the table (uneven splits and padding rows included)."""
    ids, weight, attrs = case
    table = splitting(mesh, 2, 0, data)
    dists = [data.draw(maybe_dist_attrs(mesh, ids.ndim)), table]
    check = check_split_rule("embedding", embedding, [ids, weight], dists, attrs, mesh)
    vocab_dims = check.result.inputs[1].mapping[0]
    assert set(vocab_dims) <= set(check.result.outputs[0].partial_dims)
    out = embedding([ids, weight], attrs)[0]
    grad_dists = [
        check.result.inputs[0],
        check.result.inputs[1],
        data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)),
    ]
    grad = check_split_rule(
        "embedding_grad", embedding_grad, [ids, weight, _rand(out.shape, 5)], grad_dists, attrs, mesh
    )
    if not grad.result.conflicts:  # (an out_grad split over the table's mesh dims wins them: the data split first)
        assert grad.result.outputs[0].mapping[0] == vocab_dims


def test_vocab_parallel_embedding_readable():
    """ids ``ab[S(0),R]``, table ``vh[R,S(0)]`` -> out ``abh[S(0),P(sum)]``; weight_grad
    ``vh[P(sum),S(0)]`` (data-parallel sum pending, vocabulary split kept)."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    ids = TensorSpec((4, 6), DistAttr(mesh, ["dp", None]), "int64")
    table = TensorSpec((20, 8), DistAttr(mesh, ["mp", None]))
    result = get_rule("embedding").infer_forward([ids, table], {}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(0),P(sum)]" and str(result.inputs[1]) == "[R,S(0)]"
    out_grad = TensorSpec((4, 6, 8), DistAttr(mesh, ["dp", None, None]))
    grad = get_rule("embedding_grad").infer_forward([ids, table, out_grad], {}, RuleContext(mesh))
    assert str(grad.outputs[0]) == "[P(sum),S(0)]"


# ---- cross-entropy over split classes ----------------------------------------------------------


def class_split_case(data):
    """Logits shape, a hard label (size 1 on the class axis, maybe an ignored row), the attrs."""
    shape, axis = row_shapes(data)
    attrs = {"soft_label": False, "use_softmax": True, "numeric_stable_mode": True, "ignore_index": -100, "axis": axis}
    label_shape = list(shape)
    label_shape[axis] = 1
    label = np.random.default_rng(2).integers(0, shape[axis], label_shape).astype("int64")
    if data.draw(st.booleans()):
        label.flat[0] = -100  # an ignored row
    return shape, label, attrs


@given(SPLIT_MESHES, st.data())
def test_class_split_cross_entropy_and_grad(mesh, data):
    """Class-split logits keep the split: softmax split like them, loss whole over the class
    split's mesh dims; the grad split like the softmax. Ignored rows and any class axis."""
    shape, label, attrs = class_split_case(data)
    axis = attrs["axis"] % len(shape)
    logits = _rand(shape)
    dists = [splitting(mesh, len(shape), axis, data), data.draw(maybe_dist_attrs(mesh, label.ndim))]
    check = check_split_rule("cross_entropy_with_softmax", _kernel(_ce), [logits, label], dists, attrs, mesh)
    classes = check.result.inputs[0].mapping[axis]
    softmax_dist, loss_dist = check.result.outputs
    assert softmax_dist.mapping[axis] == classes and not set(classes) & set(loss_dist.partial_dims)
    softmax, loss = _kernel(_ce)([logits, label], attrs)
    grad_dists = [check.result.inputs[1], softmax_dist, data.draw(maybe_dist_attrs(mesh, loss.ndim, partial=True))]
    operands = [label, softmax, _rand(loss.shape, 1)]
    grad = check_split_rule("cross_entropy_with_softmax_grad", _kernel(_ce_grad), operands, grad_dists, attrs, mesh)
    if not grad.result.conflicts:
        assert grad.result.outputs[0].mapping[axis] == classes


def test_class_split_cross_entropy_with_a_rank_of_masked_classes():
    """Classes masked with -inf over one rank's whole range (a constrained vocabulary): that
    rank's row max is -inf, and the one gathered max / sum / target still give the serial
    softmax and loss (the rank's exponentials are shifted by 0, not by -inf: no NaN)."""
    mesh = ProcessMesh([0, 1], ["mp"])
    logits = _rand((4, 6))
    logits[:, 3:] = -np.inf  # rank 1's classes
    label = np.array([[0], [2], [1], [-100]], "int64")
    attrs = {"soft_label": False, "use_softmax": True, "numeric_stable_mode": True, "ignore_index": -100, "axis": -1}
    check = check_split_rule("cross_entropy_with_softmax", _kernel(_ce), [logits, label], [DistAttr(mesh, [None, "mp"]), None], attrs, mesh)
    assert check.result.inputs[0].mapping[1] == (0,)


def test_class_split_cross_entropy_readable():
    """logits ``bv[S(0),S(1)]`` (batch over dp, classes over mp) -> softmax ``[S(0),S(1)]``,
    loss ``b1[S(0),R]``: three all_reduces of one value per row instead of a gather."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    logits = TensorSpec((8, 10), DistAttr(mesh, ["dp", "mp"]))
    label = TensorSpec((8, 1), None, "int64")
    attrs = {"axis": -1, "soft_label": False, "use_softmax": True}
    result = get_rule("cross_entropy_with_softmax").infer_forward([logits, label], attrs, RuleContext(mesh))
    assert [str(d) for d in result.inputs] == ["[S(0),S(1)]", "[S(0),R]"]
    assert [str(d) for d in result.outputs] == ["[S(0),S(1)]", "[S(0),R]"]
    split = split_row("pd_op.cross_entropy_with_softmax", attrs, result.inputs)
    assert (split.op, split.axis, split.mesh_dims) == ("cross_entropy", 1, (1,))


def test_soft_labels_and_one_rank_splits_need_no_rewrite():
    mesh = ProcessMesh([[0, 1]], ["dp", "mp"])  # dp has one rank
    logits = DistAttr(mesh, [None, "dp"])
    attrs = {"axis": -1, "soft_label": False, "use_softmax": True}
    assert split_row("pd_op.cross_entropy_with_softmax", attrs, [logits, None]) is None  # one rank: exact
    mp = DistAttr(mesh, [None, "mp"])
    assert split_row("pd_op.cross_entropy_with_softmax", dict(attrs, soft_label=True), [mp, None]) is None
    assert split_row("pd_op.softmax_", {"axis": -1}, [mp]).op == "softmax"  # inplace variants too
    result = get_rule("cross_entropy_with_softmax").infer_forward(
        [TensorSpec((8, 10), mp), TensorSpec((8, 10))], dict(attrs, soft_label=True), RuleContext(mesh)
    )
    assert str(result.inputs[0]) == "[R,R]"  # a soft label gathers the classes


# ---- softmax / log_softmax over a split axis ---------------------------------------------------


@given(SPLIT_MESHES, st.sampled_from(["softmax", "log_softmax"]), st.data())
def test_softmax_over_split_axis_and_grad(mesh, name, data):
    """The normalized axis keeps its split: two all_reduces (row max, sum of exponentials)
    forward, one (a row sum) backward."""
    shape, axis = row_shapes(data)
    attrs = {"axis": axis}
    x = _rand(shape)
    forward = eager(lambda t, axis: getattr(paddle.nn.functional, name)(t, axis=axis))
    check = check_split_rule(
        name, forward, [x], [splitting(mesh, len(shape), axis % len(shape), data, partial=False)], attrs, mesh
    )
    assert check.result.outputs[0].mapping == check.result.inputs[0].mapping
    out = forward([x], attrs)[0]
    kernel = getattr(_C_ops, f"{name}_grad")
    grad = _kernel(lambda out, out_grad, axis: kernel(out, out_grad, axis))
    dists = [check.result.outputs[0], data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    check_split_rule(f"{name}_grad", grad, [out, _rand(shape, 1)], dists, attrs, mesh)
