"""layer_norm and embedding rules (and their grads) checked numerically with hypothesis,
against Paddle's kernels; backward inference too. A vocabulary-split table is checked through
the masked lookup each rank runs instead (split_rows.check_split_rule)."""

import math

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops
from split_rows import check_split_rule

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, maybe_dist_attrs, meshes, shapes

EPS = 1e-5


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _tensor(x):
    return None if x is None else paddle.to_tensor(x)


def layer_norm(inputs, attrs):
    """(x, scale, bias) -> (out, mean, variance); mean / variance as Paddle's op returns them."""
    x, scale, bias = inputs
    begin = attrs["begin_norm_axis"]
    with dygraph():
        out = _C_ops.layer_norm(_tensor(x), _tensor(scale), _tensor(bias), EPS, begin).numpy()
    rows = x.reshape(x.shape[:begin] + (-1,)).astype("float64")
    return [out, rows.mean(-1).astype("float32"), rows.var(-1).astype("float32")]


def layer_norm_grad(inputs, attrs):
    with dygraph():
        grads = _C_ops.layer_norm_grad(*map(_tensor, inputs), EPS, attrs["begin_norm_axis"])
    return [g.numpy() if g is not None and g.shape == list(ref.shape) else np.zeros(0, "float32")
            for g, ref in zip(grads, [inputs[0], inputs[1] if inputs[1] is not None else np.zeros(0),
                                      inputs[2] if inputs[2] is not None else np.zeros(0)])]  # fmt: skip


@st.composite
def layer_norm_cases(draw):
    shape = draw(shapes(2, 3, max_side=6))
    begin = draw(st.integers(1, len(shape) - 1))
    affine = draw(st.booleans())
    norm = math.prod(shape[begin:])
    scale, bias = (_rand((norm,), 1), _rand((norm,), 2)) if affine else (None, None)
    return _rand(shape), scale, bias, {"begin_norm_axis": begin, "epsilon": EPS}


@given(meshes(), layer_norm_cases(), st.data())
def test_layer_norm_and_grad(mesh, case, data):
    x, scale, bias, attrs = case
    begin = attrs["begin_norm_axis"]
    x_dist = data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))
    vec = [None if v is None else data.draw(maybe_dist_attrs(mesh, 1)) for v in (scale, bias)]
    check = check_rule("layer_norm", layer_norm, [x, scale, bias], [x_dist, *vec], attrs, mesh)
    assert all(not dims for dims in check.result.inputs[0].mapping[begin:])  # normalized dims whole
    outs = [data.draw(dist_attrs(mesh, x.ndim)), *[data.draw(dist_attrs(mesh, begin))] * 2]
    check_rule("layer_norm", layer_norm, [x, scale, bias], [None] * 3, attrs, mesh, backward=outs)

    out, mean, var = layer_norm([x, scale, bias], attrs)
    operands = [x, scale, bias, mean, var, _rand(x.shape, 3)]
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim)), *vec]
    dists += [data.draw(maybe_dist_attrs(mesh, begin)) for _ in range(2)]
    dists.append(data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)))
    check_rule("layer_norm_grad", layer_norm_grad, operands, dists, attrs, mesh)


def test_layer_norm_grad_of_a_batch_split_gives_partial_scale_and_bias_grads():
    """x split on the batch over dp (``[S(0)]`` per mesh dim) -> scale_grad / bias_grad ``[P(sum)]``:
    the data-parallel gradient sum."""
    mesh = ProcessMesh([0, 1], ["dp"])
    x = TensorSpec((4, 6, 8), DistAttr(mesh, ["dp", None, None]))
    vec, stat = TensorSpec((8,)), TensorSpec((4, 6))
    result = get_rule("layer_norm_grad").infer_forward([x, vec, vec, stat, stat, x], {"begin_norm_axis": 2}, RuleContext(mesh))
    assert [str(d) for d in result.outputs] == ["[S(0)]", "[P(sum)]", "[P(sum)]"]
    assert [d.mapping for d in result.inputs[3:]] == [((0,), ()), ((0,), ()), ((0,), (), ())]


# ---- embedding -------------------------------------------------------------------------------


def embedding(inputs, attrs):
    with dygraph():
        return [_C_ops.embedding(_tensor(inputs[0]), _tensor(inputs[1]), attrs["padding_idx"], False).numpy()]


def embedding_grad(inputs, attrs):
    with dygraph():
        return [_C_ops.embedding_grad(*map(_tensor, inputs), attrs["padding_idx"], False).numpy()]


@st.composite
def embedding_cases(draw):
    ids_shape = draw(shapes(1, 2, max_side=6))
    vocab, hidden = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    ids = np.random.default_rng(4).integers(0, vocab, ids_shape).astype("int64")
    padding = draw(st.sampled_from([-1, int(ids.flat[0])]))
    return ids, _rand((vocab, hidden)), {"padding_idx": padding, "sparse": False}


@given(meshes(), embedding_cases(), st.data())
def test_embedding_and_grad(mesh, case, data):
    ids, weight, attrs = case
    dists = [data.draw(maybe_dist_attrs(mesh, ids.ndim)), data.draw(maybe_dist_attrs(mesh, 2))]
    check = check_split_rule("embedding", embedding, [ids, weight], dists, attrs, mesh)
    vocab = check.result.inputs[1].mapping[0]  # a vocabulary split is kept: the output pending over it
    assert set(vocab) <= set(check.result.outputs[0].partial_dims)
    out = embedding([ids, weight], attrs)[0]
    backward = [data.draw(dist_attrs(mesh, out.ndim))]
    check_split_rule("embedding", embedding, [ids, weight], [None, None], attrs, mesh, backward=backward)
    dists.append(data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)))
    check_split_rule("embedding_grad", embedding_grad, [ids, weight, _rand(out.shape, 5)], dists, attrs, mesh)


def test_embedding_of_split_ids_and_hidden_split_table():
    """ids split over dp, table's hidden dim over mp -> out ``[S(0),S(2)]`` (per mesh dim); the
    table's grad is partial over dp (``[P(sum),S(1)]``)."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    ids = TensorSpec((4, 6), DistAttr(mesh, ["dp", None]), "int64")
    table = TensorSpec((20, 8), DistAttr(mesh, [None, "mp"]))
    result = get_rule("embedding").infer_forward([ids, table], {}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(0),S(2)]" and str(result.inputs[1]) == "[R,S(1)]"
    grad = get_rule("embedding_grad").infer_forward([ids, table, TensorSpec((4, 6, 8), result.outputs[0])], {}, RuleContext(mesh))
    assert str(grad.outputs[0]) == "[P(sum),S(1)]"
