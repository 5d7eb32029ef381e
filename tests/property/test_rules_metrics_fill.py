"""topk / topk_grad / accuracy and the fill ops checked numerically (hypothesis)."""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def topk(x, k_operand, k, axis, largest, sorted):
    return paddle.topk(x, int(k), axis=axis, largest=largest, sorted=sorted)


@st.composite
def topk_cases(draw):
    shape = draw(shapes(1, 3, max_side=6))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    k = draw(st.integers(1, shape[axis]))
    return shape, {"k": float(k), "axis": axis, "largest": draw(st.booleans()), "sorted": True}


@given(meshes(), topk_cases(), st.data())
def test_topk_and_grad(mesh, case, data):
    shape, attrs = case
    x = _rand(shape)
    k = np.array([int(attrs["k"])], "int32")
    check_rule(
        "topk", eager(topk), [x, k], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), None], attrs, mesh
    )
    values, indices = eager(topk)([x, k], attrs)
    outs = [data.draw(dist_attrs(mesh, len(shape)))] * 2
    check_rule("topk", eager(topk), [x, k], [None, None], attrs, mesh, backward=outs)

    def grad(inputs, attrs):  # topk_grad: (x, indices, out_grad, k)
        x_, idx, out_grad, k_ = inputs
        return eager_grad(lambda t, i, kk, **a: topk(t, kk, **a)[0], [0])([x_, idx, k_, out_grad], attrs)

    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))) for _ in range(2)]
    dists += [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), None]
    check_rule("topk_grad", grad, [x, indices, _rand(values.shape, 1), k], dists, attrs, mesh)


def accuracy(inputs, attrs):
    with dygraph():
        return [o.numpy() for o in paddle._C_ops.accuracy(*[paddle.to_tensor(a) for a in inputs])]


@given(meshes(), st.data())
def test_accuracy(mesh, data):
    n = data.draw(st.sampled_from([mesh.size * data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))]))
    classes, k = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 2))
    logits = _rand((n, classes))
    values, indices = eager(lambda t: paddle.topk(t, k))([logits], {})
    label = np.random.default_rng(1).integers(0, classes, (n, 1)).astype("int64")
    dists = [data.draw(maybe_dist_attrs(mesh, 2)) for _ in range(3)]
    check = check_rule("accuracy", accuracy, [values, indices, label], dists, {}, mesh)
    split = check.result.inputs[0].mapping[0]
    assert not split or n % int(np.prod([mesh.shape[d] for d in split])) == 0


# ---- fills -------------------------------------------------------------------------------


@given(meshes(), shapes(0, 3), st.data())
def test_full_like_fill_full_(mesh, shape, data):
    x = _rand(shape)
    value = np.array([2.5], "float32")
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    like = eager(lambda t, v, **a: paddle.full_like(t, 2.5))
    check = check_rule("full_like", like, [x, value], [dist, None], {"dtype": "float32"}, mesh)
    assert not check.result.outputs[0].partial
    if dist is not None:
        assert check.result.inputs[0] == dist  # read for its shape only: no reshard
    check_rule("fill", like, [x, value], [dist, None], {}, mesh)
    check_rule(
        "full_", lambda ins, a: [np.full_like(ins[0], 1.0)], [x], [dist], {"shape": list(shape), "value": 1.0}, mesh
    )
    out = data.draw(dist_attrs(mesh, len(shape)))
    check_rule("full_like", like, [x, value], [None, None], {}, mesh, backward=[out])
    check_rule("empty_like", like, [x, value], [dist, None], {}, mesh)  # same rule; values are 2.5 here


@given(meshes(), shapes(1, 3), st.data())
def test_full_batch_size_like(mesh, shape, data):
    x = _rand(shape)
    in_idx = data.draw(st.integers(0, len(shape) - 1))
    out_shape = data.draw(shapes(1, 3))
    out_idx = data.draw(st.integers(0, len(out_shape) - 1))
    attrs = {"shape": list(out_shape), "input_dim_idx": in_idx, "output_dim_idx": out_idx, "value": 1.0}

    def fn(inputs, attrs):
        target = list(attrs["shape"])
        target[attrs["output_dim_idx"]] = inputs[0].shape[attrs["input_dim_idx"]]
        return [np.full(target, 1.0, "float32")]

    check_rule(
        "full_batch_size_like", fn, [x], [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))], attrs, mesh
    )


@given(meshes(), shapes(0, 3), st.data())
def test_full_and_constants(mesh, shape, data):
    attrs = {"shape": list(shape), "value": 3.0}
    check_rule("full", lambda ins, a: [np.full(a["shape"], a["value"], "float32")], [], [], attrs, mesh)
    check_rule("full_int_array", lambda ins, a: [np.array(a["value"], "int64")], [], [], {"value": [1, 2]}, mesh)
    values = {"shape": list(shape), "values": list(range(int(np.prod(shape))))}
    run = lambda ins, a: [np.array(a["values"], "float32").reshape(a["shape"])]  # noqa: E731
    check_rule(
        "assign_value_",
        run,
        [np.zeros(shape, "float32")],
        [data.draw(maybe_dist_attrs(mesh, len(shape)))],
        values,
        mesh,
    )
    # backward: a fill produces whatever splits its consumer wants, never a partial
    out = data.draw(dist_attrs(mesh, len(shape), partial=True))
    result = get_rule("full").infer_backward([], [TensorSpec(shape, out)], attrs, RuleContext(mesh))
    assert result.outputs[0].mapping == out.mapping and not result.outputs[0].partial
    shape_operand = TensorSpec((len(shape),), None, "int64")
    result = get_rule("full_with_tensor").infer_forward([TensorSpec((1,)), shape_operand], {}, RuleContext(mesh))
    assert result.outputs[0].ndim == len(shape) and result.outputs[0].is_replicated


# ---- readable cases -----------------------------------------------------------------------

MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def test_accuracy_even_batch_split():
    """n1[S(0),R] x3 with n = 8: accuracy [P(avg),R], correct / total [P(sum),R]."""
    specs = [
        TensorSpec((8, 2), DistAttr.parse("[S(0),R]", MESH, 2)),
        TensorSpec((8, 2), None, "int64"),
        TensorSpec((8, 1), None, "int64"),
    ]
    result = get_rule("accuracy").infer_forward(specs, {}, RuleContext(MESH))
    assert [str(d) for d in result.outputs] == ["[P(avg),R]", "[P(sum),R]", "[P(sum),R]"]
    specs[0] = TensorSpec((7, 2), DistAttr.parse("[S(0),R]", MESH, 2))
    specs[1:] = [TensorSpec((7, 2), None, "int64"), TensorSpec((7, 1), None, "int64")]
    result = get_rule("accuracy").infer_forward(specs, {}, RuleContext(MESH))
    assert [str(d) for d in result.inputs] == ["[R,R]"] * 3  # uneven: gathered


def test_full_like_drops_partial():
    specs = [TensorSpec((4, 6), DistAttr.parse("[S(1),P(sum)]", MESH, 2)), TensorSpec((1,))]
    result = get_rule("full_like").infer_forward(specs, {}, RuleContext(MESH))
    assert str(result.inputs[0]) == "[S(1),P(sum)]" and str(result.outputs[0]) == "[S(1),R]"
