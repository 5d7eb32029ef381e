"""concat / split / split_with_num / slice rules and their grads checked numerically
(hypothesis), forward and backward inference. Operands are flattened as the graph view hands
them to rules: ``concat(x[0], ..., x[n-1], axis)``, split's results are the split tensors.
"""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _axis_value(axis):
    return np.array([axis], dtype="int32")


@st.composite
def concat_cases(draw):
    shape = draw(shapes(1, 3, max_side=6))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    count = draw(st.integers(1, 3))
    parts = []
    for _ in range(count):
        piece = list(shape)
        piece[axis] = draw(st.integers(1, 4))
        parts.append(tuple(piece))
    return parts, axis


def concat_fn(inputs, attrs):
    with dygraph():
        return [paddle.concat([paddle.to_tensor(x) for x in inputs[:-1]], axis=int(attrs["axis"])).numpy()]


@given(meshes(), concat_cases(), st.data())
def test_concat(mesh, case, data):
    parts, axis = case
    xs = [_rand(s, i) for i, s in enumerate(parts)]
    attrs = {"axis": float(axis)}  # a pd_op.full operand's value arrives as a float
    same_partial = data.draw(st.booleans())
    dists = [data.draw(maybe_dist_attrs(mesh, len(s), partial=not same_partial)) for s in parts]
    if same_partial:  # every operand partial alike: the output stays partial
        p = data.draw(dist_attrs(mesh, len(parts[0]), partial=True))
        dists = [p] * len(parts)
    check_rule("concat", concat_fn, [*xs, _axis_value(axis)], [*dists, None], attrs, mesh)
    out = data.draw(dist_attrs(mesh, len(parts[0])))
    check_rule("concat", concat_fn, [*xs, _axis_value(axis)], [None] * (len(xs) + 1), attrs, mesh, backward=[out])


@given(meshes(), concat_cases(), st.data())
def test_concat_grad(mesh, case, data):
    parts, axis = case
    xs = [_rand(s, i) for i, s in enumerate(parts)]
    out_shape = concat_fn([*xs, None], {"axis": axis})[0].shape
    grad = _rand(out_shape, 9)

    def fn(inputs, attrs):  # concat_grad: out_grad cut at the x sizes along axis
        sizes = np.cumsum([x.shape[axis] for x in inputs[:-2]])[:-1]
        return np.split(inputs[-2], sizes, axis=axis)

    dists = [data.draw(maybe_dist_attrs(mesh, len(s))) for s in parts]
    dists.append(data.draw(maybe_dist_attrs(mesh, len(out_shape), partial=True)))
    check_rule("concat_grad", fn, [*xs, grad, _axis_value(axis)], [*dists, None], {"axis": float(axis)}, mesh)
    # split_grad (a split's backward) is a concat of the output grads
    check_rule("split_grad", concat_fn, [*xs, _axis_value(axis)], [*dists[:-1], None], {"axis": float(axis)}, mesh)


@given(meshes(), shapes(1, 3, max_side=8), st.data())
def test_split_and_split_with_num(mesh, shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _rand(shape)
    size = shape[axis]
    num = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    attrs = {"num": num, "axis": float(axis)}
    fn = eager(lambda t, axis_value, num, axis: paddle.split(t, num, axis=int(axis)))
    check_rule("split_with_num", fn, [x, _axis_value(axis)], [dist, None], attrs, mesh)
    outs = [data.draw(dist_attrs(mesh, len(shape)))] * num
    check_rule("split_with_num", fn, [x, _axis_value(axis)], [None, None], attrs, mesh, backward=outs)

    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=2)))
    sections = [b - a for a, b in zip([0, *cuts], [*cuts, size])]
    nonzero = [i for i, n in enumerate(sections) if n > 0]
    if data.draw(st.booleans()):
        sections[data.draw(st.sampled_from(nonzero))] = -1
    fn2 = eager(lambda t, sec, axis_value, sections, axis: paddle.split(t, sections, axis=int(axis)))
    attrs2 = {"sections": sections, "axis": float(axis)}
    check_rule("split", fn2, [x, np.array(sections, "int64"), _axis_value(axis)], [dist, None, None], attrs2, mesh)


@st.composite
def slice_cases(draw):
    shape = draw(shapes(1, 3, max_side=8))
    axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    starts, ends, decrease = [], [], []
    for a in axes:
        start = draw(st.integers(0, shape[a] - 1))
        end = draw(st.integers(start + 1, shape[a]))
        starts.append(start)
        ends.append(end)
        if end == start + 1 and draw(st.booleans()) and len(decrease) < len(shape) - 1:
            decrease.append(a)
    return shape, {
        "axes": axes,
        "starts": starts,
        "ends": ends,
        "infer_flags": [1] * len(axes),
        "decrease_axis": decrease,
    }


def slice_fn(inputs, attrs):
    x = inputs[0]
    index = [slice(None)] * x.ndim
    for a, s, e in zip(attrs["axes"], attrs["starts"], attrs["ends"]):
        index[a] = slice(s, e)
    out = x[tuple(index)]
    return [out.squeeze(tuple(attrs["decrease_axis"])) if attrs["decrease_axis"] else out]


@given(meshes(), slice_cases(), st.data())
def test_slice_and_grad(mesh, case, data):
    shape, attrs = case
    x = _rand(shape)
    starts, ends = np.array(attrs["starts"], "int64"), np.array(attrs["ends"], "int64")
    with dygraph():  # the numpy reference is Paddle's slice
        want = paddle._C_ops.slice(
            paddle.to_tensor(x),
            attrs["axes"],
            attrs["starts"],
            attrs["ends"],
            attrs["infer_flags"],
            attrs["decrease_axis"],
        ).numpy()
    assert np.array_equal(want, slice_fn([x], attrs)[0])
    dist = data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))
    check_rule("slice", slice_fn, [x, starts, ends], [dist, None, None], attrs, mesh)
    out = data.draw(dist_attrs(mesh, want.ndim))
    check_rule("slice", slice_fn, [x, starts, ends], [None, None, None], attrs, mesh, backward=[out])

    def grad_fn(inputs, attrs):  # slice_grad: out_grad placed into zeros of input's shape
        x_grad = np.zeros_like(inputs[0])
        index = [slice(None)] * x_grad.ndim
        for a, s, e in zip(attrs["axes"], attrs["starts"], attrs["ends"]):
            index[a] = slice(s, e)
        x_grad[tuple(index)] = inputs[1].reshape(x_grad[tuple(index)].shape)
        return [x_grad]

    g = _rand(want.shape, 1)

    def forward(t, s, e, **a):
        return paddle.slice(t, a["axes"], a["starts"], a["ends"]).reshape(want.shape)

    want_grad = eager_grad(forward, [0])([x, starts, ends, g], attrs)[0]
    assert np.allclose(want_grad, grad_fn([x, g], attrs)[0])
    dists = [
        data.draw(maybe_dist_attrs(mesh, len(shape))),
        data.draw(maybe_dist_attrs(mesh, want.ndim, partial=True)),
        None,
        None,
    ]
    check_rule("slice_grad", grad_fn, [x, g, starts, ends], dists, attrs, mesh)


# ---- readable cases -----------------------------------------------------------------------


MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def _infer(op, shapes_, texts, attrs):
    specs = [TensorSpec(s, None if t is None else DistAttr.parse(t, MESH, len(s))) for s, t in zip(shapes_, texts)]
    result = get_rule(op).infer_forward(specs, attrs, RuleContext(MESH, op_name=op))
    return [str(d) for d in result.inputs], [str(d) for d in result.outputs]


def test_concat_axis_whole_others_merge():
    """ab[S(0),S(1)], ab[S(0),R] concat on 1 -> a1[S(0),R]: b is gathered, a stays split."""
    ins, outs = _infer("concat", [(4, 3), (4, 5), (1,)], ["[S(0),S(1)]", "[S(0),R]", None], {"axis": 1.0})
    assert ins == ["[S(0),R]", "[S(0),R]", "[R,R]"] and outs == ["[S(0),R]"]


def test_split_outputs_follow():
    ins, outs = _infer("split_with_num", [(4, 6), (1,)], ["[S(1),S(0)]", None], {"num": 3, "axis": 1.0})
    assert ins[0] == "[R,S(0)]" and outs == ["[R,S(0)]"] * 3


def test_slice_decrease_axis():
    """abc[S(0),S(2)] sliced on b with decrease: ac[S(0),S(1)]."""
    attrs = {"axes": [1], "starts": [1], "ends": [2], "infer_flags": [1], "decrease_axis": [1]}
    ins, outs = _infer("slice", [(4, 3, 6), (1,), (1,)], ["[S(0),S(2)]", None, None], attrs)
    assert outs == ["[S(0),S(1)]"]
