"""matmul and the elementwise family checked numerically (hypothesis): forward, grad ops
(Paddle's own grad kernels) and backward inference, partial inputs included.

matmul: transpose_x / transpose_y, batch dims broadcast against each other, 1-D operands.
Elementwise: add / subtract / multiply / divide / maximum / minimum with broadcasting and
their grads; relu / gelu / tanh / sigmoid / exp / sqrt / square / scale / cast and their
grads; add_n. Grad operand orders are pinned by ``test_grad_operand_orders``.
"""

import numpy as np
import paddle
import paddle.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from paddle import _C_ops

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, eager, eager_grad, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0, positive=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype("float32")
    return np.abs(x) + 0.5 if positive else x


def _kernel(fn):
    """``fn(*tensors, **attrs)`` on numpy inputs -> list of numpy outputs (``_C_ops`` grads)."""

    def run(inputs, attrs):
        with dygraph():
            out = fn(*[paddle.to_tensor(x) for x in inputs], **attrs)
            return [o.numpy() for o in (out if isinstance(out, (list, tuple)) else [out])]

    return run


def _parts(mesh, dims):
    return int(np.prod([mesh.shape[d] for d in dims])) if dims else 1


def _kept_splits(given_dist, required, shape, mesh):
    """Dims of ``shape`` the rule had no reason to reshard keep ``given_dist``'s split."""
    for i, size in enumerate(shape):
        dims = given_dist.mapping[i]
        if size > 1 and _parts(mesh, dims) <= size:
            assert required.mapping[i] == dims, (i, str(given_dist), str(required))


# ---- matmul ----------------------------------------------------------------------------------


@st.composite
def matmul_cases(draw, for_grad=False, sides=None):
    """x, y shapes and transpose flags; batch dims broadcast (some 1), 1-D operands too.

    ``for_grad``: two operands of 3 or more dims get the same number of dims (leading 1s) and
    1-D operands no transpose flag: Paddle's matmul_grad kernel fails on the full tensors
    otherwise ((1, 2, 3) x (3, 2, 3, 4): "Input dimension size should be equal to 2";
    (2,) with transpose_x x (2, 1): "Tensor's dimension is out of bound").
    """
    sides = st.integers(1, 5) if sides is None else sides
    m, k, n = draw(sides), draw(sides), draw(sides)
    batch = tuple(draw(st.lists(sides, max_size=2)))
    attrs = {"transpose_x": draw(st.booleans()), "transpose_y": draw(st.booleans())}

    def operand(rows, cols, transpose):
        ndim = draw(st.integers(1, 2 + len(batch)))
        if ndim == 1:
            return (k,)
        lead = tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in batch[len(batch) - (ndim - 2) :])
        return lead + ((cols, rows) if transpose else (rows, cols))

    x, y = operand(m, k, attrs["transpose_x"]), operand(k, n, attrs["transpose_y"])
    if for_grad and min(len(x), len(y)) > 2:
        rank = max(len(x), len(y))
        x, y = (1,) * (rank - len(x)) + x, (1,) * (rank - len(y)) + y
    if for_grad:
        attrs = {"transpose_x": attrs["transpose_x"] and len(x) > 1, "transpose_y": attrs["transpose_y"] and len(y) > 1}
    return x, y, attrs


def matmul(x, y, transpose_x, transpose_y):
    return paddle.matmul(x, y, transpose_x=transpose_x, transpose_y=transpose_y)


@given(meshes(), matmul_cases(), st.data())
def test_matmul_forward_and_backward_inference(mesh, case, data):
    x_shape, y_shape, attrs = case
    x, y = _rand(x_shape), _rand(y_shape, 1)
    dx = data.draw(maybe_dist_attrs(mesh, len(x_shape), partial=True))
    dy = data.draw(maybe_dist_attrs(mesh, len(y_shape), partial=True))
    check = check_rule("matmul", eager(matmul), [x, y], [dx, dy], attrs, mesh)
    if dx is not None and dy is None:
        _kept_splits(dx, check.result.inputs[0], x_shape, mesh)
        # matmul is linear in x: a pending sum stays pending and reaches the output
        assert check.result.inputs[0].partial == dx.partial
        assert set(dx.partial_dims) <= set(check.result.outputs[0].partial_dims)
    out = eager(matmul)([x, y], attrs)[0]
    out_dist = data.draw(dist_attrs(mesh, out.ndim))
    back = check_rule("matmul", eager(matmul), [x, y], [None, None], attrs, mesh, backward=[out_dist])
    _kept_splits(out_dist, back.result.outputs[0], out.shape, mesh)


@given(meshes(), matmul_cases(for_grad=True), st.data())
def test_matmul_grad(mesh, case, data):
    """matmul_grad (x, y, out_grad) -> (x_grad, y_grad); broadcast batch dims sum in y_grad / x_grad."""
    x_shape, y_shape, attrs = case
    x, y = _rand(x_shape), _rand(y_shape, 1)
    out = eager(matmul)([x, y], attrs)[0]
    dists = [data.draw(maybe_dist_attrs(mesh, len(x_shape))), data.draw(maybe_dist_attrs(mesh, len(y_shape)))]
    dists.append(data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)))
    check = check_rule("matmul_grad", eager_grad(matmul, [0, 1]), [x, y, _rand(out.shape, 2)], dists, attrs, mesh)
    if dists[2] is not None and dists[0] is None and dists[1] is None:
        # backprop is linear in out_grad: its pending sums pass through to both grads
        for grad in check.result.outputs:
            assert set(dists[2].partial_dims) <= set(grad.partial_dims)


# ---- binary elementwise ----------------------------------------------------------------------

BINARY = {
    "add": paddle.add,
    "subtract": paddle.subtract,
    "multiply": paddle.multiply,
    "divide": paddle.divide,
    "maximum": paddle.maximum,
    "minimum": paddle.minimum,
}


@st.composite
def broadcast_cases(draw, sides=None):
    """Two shapes that broadcast: right-aligned suffixes of one shape, some dims set to 1."""
    full = tuple(draw(st.lists(st.integers(1, 6) if sides is None else sides, max_size=3)))

    def operand():
        ndim = draw(st.integers(0, len(full)))
        return tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in full[len(full) - ndim :])

    return operand(), operand()


def _binary_operands(name, x_shape, y_shape):
    return _rand(x_shape), _rand(y_shape, 1, positive=name == "divide")


def _check_partial_law(name, required):
    """Which operands may stay partial: add / subtract all alike, multiply one, others none."""
    partial = [set(d.partial_dims) for d in required]
    if name in ("add", "subtract"):
        assert partial[0] == partial[1], [str(d) for d in required]
    elif name == "multiply":
        assert not partial[0] & partial[1], [str(d) for d in required]
    elif name == "divide":  # linear in x over a whole y
        assert not partial[1], [str(d) for d in required]
    else:
        assert not partial[0] and not partial[1], [str(d) for d in required]


@given(meshes(), broadcast_cases(), st.sampled_from(sorted(BINARY)), st.data())
def test_binary_forward_and_backward_inference(mesh, case, name, data):
    x_shape, y_shape = case
    x, y = _binary_operands(name, x_shape, y_shape)
    fn = eager(BINARY[name])
    dists = [data.draw(maybe_dist_attrs(mesh, len(s), partial=True)) for s in case]
    check = check_rule(name, fn, [x, y], dists, {}, mesh)
    _check_partial_law(name, check.result.inputs)
    if dists[0] is not None and dists[1] is None and not dists[0].partial:
        _kept_splits(dists[0], check.result.inputs[0], x_shape, mesh)
    out = fn([x, y], {})[0]
    out_dist = data.draw(dist_attrs(mesh, out.ndim))
    back = check_rule(name, fn, [x, y], [None, None], {}, mesh, backward=[out_dist])
    _kept_splits(out_dist, back.result.outputs[0], out.shape, mesh)


def _binary_grad(name):
    """The grad op's kernel; divide_grad reads (x, y, out, out_grad), the others (x, y, out_grad)."""
    grad = eager_grad(BINARY[name], [0, 1])  # the op's ``axis`` attr is -1: plain broadcasting
    if name == "divide":
        return lambda inputs, attrs: grad([inputs[0], inputs[1], inputs[3]], {})
    return lambda inputs, attrs: grad(inputs, {})


@given(meshes(), broadcast_cases(), st.sampled_from(sorted(BINARY)), st.data())
def test_binary_grad(mesh, case, name, data):
    x_shape, y_shape = case
    x, y = _binary_operands(name, x_shape, y_shape)
    out = eager(BINARY[name])([x, y], {})[0]
    shape_only = name in ("add", "subtract")  # add_grad reads x and y for their shapes only
    operands = [x, y] + ([out] if name == "divide" else []) + [_rand(out.shape, 2)]
    dists = [data.draw(maybe_dist_attrs(mesh, len(s), partial=shape_only)) for s in case]
    dists += [data.draw(maybe_dist_attrs(mesh, out.ndim)) for _ in operands[2:-1]]
    dists.append(data.draw(maybe_dist_attrs(mesh, out.ndim, partial=True)))
    check = check_rule(f"{name}_grad", _binary_grad(name), operands, dists, {"axis": -1}, mesh)
    if shape_only and dists[0] is not None and all(d is None for d in dists[1:]):
        assert check.result.inputs[0].partial == dists[0].partial  # no reduction just for a shape


# ---- unary elementwise -----------------------------------------------------------------------

UNARY = {
    "relu": lambda x: F.relu(x),
    "gelu": lambda x, approximate: F.gelu(x, approximate=approximate),
    "tanh": paddle.tanh,
    "sigmoid": F.sigmoid,
    "exp": paddle.exp,
    "sqrt": paddle.sqrt,
    "square": paddle.square,
    "scale": lambda x, scale_operand, scale, bias, bias_after_scale: paddle.scale(x, scale, bias, bias_after_scale),
    "cast": lambda x, dtype: paddle.cast(x, dtype),
}
# grad ops reading the forward output (``out, out_grad``) or the input (``x, out_grad``)
GRAD_READS_OUT = {
    "relu": True,
    "tanh": True,
    "sigmoid": True,
    "exp": True,
    "sqrt": True,
    "gelu": False,
    "square": False,
}


@st.composite
def unary_cases(draw, name):
    shape = draw(shapes(0, 3, max_side=6))
    x = _rand(shape, positive=name == "sqrt")
    operands, attrs = [x], {}
    if name == "gelu":
        attrs = {"approximate": draw(st.booleans())}
    elif name == "scale":
        scale = draw(st.sampled_from([2.0, -0.5]))
        operands.append(np.array([scale], "float32"))  # a pd_op.full operand
        attrs = {"scale": scale, "bias": draw(st.sampled_from([0.0, 1.0])), "bias_after_scale": draw(st.booleans())}
    elif name == "cast":
        attrs = {"dtype": draw(st.sampled_from(["float64", "float16", "int32", paddle.float64, paddle.int64]))}
    return operands, attrs


@given(meshes(), st.sampled_from(sorted(UNARY)), st.data())
def test_unary_forward_and_backward_inference(mesh, name, data):
    operands, attrs = data.draw(unary_cases(name))
    x = operands[0]
    fn = eager(UNARY[name])
    dist = data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))
    tol = 2e-3 if attrs.get("dtype") == "float16" else 1e-4
    check = check_rule(name, fn, operands, [dist] + [None] * (len(operands) - 1), attrs, mesh, rtol=tol, atol=tol)
    required = check.result.inputs[0]
    if dist is not None:
        _kept_splits(dist, required, x.shape, mesh)
        # only a cast into a float dtype at least as precise is linear: every other op needs its
        # pending sums reduced (float16 pieces do not sum to the float32 whole within tolerance)
        linear = name == "cast" and str(attrs["dtype"]).endswith("float64")
        assert required.partial == (dist.partial if linear else ())
    assert all(d.is_replicated for d in check.result.inputs[1:])  # scale's scalar operand
    out_dist = data.draw(dist_attrs(mesh, x.ndim))
    back = check_rule(name, fn, operands, [None] * len(operands), attrs, mesh, backward=[out_dist], rtol=tol, atol=tol)
    _kept_splits(out_dist, back.result.outputs[0], x.shape, mesh)


@given(meshes(), st.sampled_from(sorted(GRAD_READS_OUT)), st.data())
def test_unary_grad(mesh, name, data):
    operands, attrs = data.draw(unary_cases(name))
    x = operands[0]
    first = eager(UNARY[name])([x], attrs)[0] if GRAD_READS_OUT[name] else x
    kernel = getattr(_C_ops, f"{name}_grad")
    fn = _kernel(lambda t, g, **a: kernel(t, g, *a.values()))  # _C_ops take attrs positionally
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim)), data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))]
    check = check_rule(f"{name}_grad", fn, [first, _rand(x.shape, 1)], dists, attrs, mesh)
    assert not check.result.inputs[0].partial  # out / x enter nonlinearly
    if dists[0] is None and dists[1] is not None:
        assert check.result.outputs[0].partial == dists[1].partial  # linear in out_grad


# ---- add_n -----------------------------------------------------------------------------------


@given(meshes(), shapes(0, 3, max_side=6), st.integers(1, 4), st.data())
def test_add_n(mesh, shape, count, data):
    xs = [_rand(shape, i) for i in range(count)]
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)) for _ in xs]
    check = check_rule("add_n", eager(lambda *ts: paddle.add_n(list(ts))), xs, dists, {}, mesh)
    partial = {tuple(sorted(d.partial_dims)) for d in check.result.inputs}
    assert len(partial) == 1  # pending sums are kept only where every operand has them
    if all(d is not None and d.partial == dists[0].partial for d in dists) and not any(
        d.sharded_mesh_dims() for d in dists
    ):
        assert check.result.outputs[0].partial == dists[0].partial
    out = data.draw(dist_attrs(mesh, len(shape)))
    back = check_rule("add_n", eager(lambda *ts: paddle.add_n(list(ts))), xs, [None] * count, {}, mesh, backward=[out])
    assert all(d.mapping == back.result.outputs[0].mapping for d in back.result.inputs)  # inputs lie like out


# ---- operand orders the tests above rely on --------------------------------------------------


def test_grad_operand_orders():
    with paddle.pir_utils.IrGuard():
        paddle.enable_static()
        main = paddle.static.Program()
        with paddle.static.program_guard(main):
            x = paddle.static.data("x", [4, 3], "float32")
            y = paddle.static.data("y", [3], "float32")
            w = paddle.static.data("w", [3, 5], "float32")
            for v in (x, y, w):
                v.stop_gradient = False
            outs = [paddle.matmul(x, w), x / y, x + y, x * y, paddle.maximum(x, y), F.relu(x), F.gelu(x)]
            outs += [paddle.tanh(x), F.sigmoid(x), paddle.exp(x), paddle.sqrt(x), paddle.square(x)]
            paddle.static.append_backward(paddle.add_n([o.sum() for o in outs]))
        names = {
            op.name(): list(op.get_input_names())
            for op in main.global_block().ops
            if op.name().endswith("_grad") and op.name() != "pd_op.sum_grad"
        }
        paddle.disable_static()
    assert names["pd_op.matmul_grad"] == ["x", "y", "out_grad"]
    assert names["pd_op.divide_grad"] == ["x", "y", "out", "out_grad"]
    for op in ("add", "multiply", "maximum"):
        assert names[f"pd_op.{op}_grad"] == ["x", "y", "out_grad"]
    for op, reads_out in GRAD_READS_OUT.items():
        assert names[f"pd_op.{op}_grad"] == ["out" if reads_out else "x", "out_grad"], op


# ---- readable cases (per mesh dim: S(i) = tensor dim i split, P(sum) = pending sum) -----------

MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def _infer(op, shapes_, texts, attrs=None, mesh=MESH):
    specs = [TensorSpec(s, None if t is None else DistAttr.parse(t, mesh, len(s))) for s, t in zip(shapes_, texts)]
    result = get_rule(op).infer_forward(specs, attrs or {}, RuleContext(mesh, op_name=op))
    return [str(d) for d in result.inputs], [str(d) for d in result.outputs]


def test_matmul_data_parallel():
    """mk[S(0),R], kn[R,R] -> mn[S(0),R]."""
    assert _infer("matmul", [(8, 4), (4, 6)], ["[S(0),R]", "[R,R]"]) == (["[S(0),R]", "[R,R]"], ["[S(0),R]"])


def test_matmul_column_and_row_parallel():
    """Column parallel kn[R,S(1)] -> mn[S(0),S(1)]; row parallel mk[R,S(1)], kn[R,S(0)] -> mn[R,P(sum)]."""
    assert _infer("matmul", [(8, 4), (4, 6)], ["[S(0),R]", "[R,S(1)]"])[1] == ["[S(0),S(1)]"]
    ins, outs = _infer("matmul", [(8, 4), (4, 6)], ["[R,S(1)]", "[R,S(0)]"])
    assert ins == ["[R,S(1)]", "[R,S(0)]"] and outs == ["[R,P(sum)]"]
    # the weight alone decides: x is resharded to split k the same way
    ins, outs = _infer("matmul", [(8, 4), (4, 6)], ["[S(0),R]", "[R,S(0)]"])
    assert ins == ["[S(0),S(1)]", "[R,S(0)]"] and outs == ["[S(0),P(sum)]"]


def test_matmul_transpose_y_and_batched():
    """bmk[S(0),R], bnk[R,S(2)] with transpose_y: k split -> bmn[S(0),P(sum)] (attention scores)."""
    ins, outs = _infer("matmul", [(4, 8, 6), (4, 5, 6)], ["[S(0),R]", "[R,S(2)]"], {"transpose_y": True})
    assert ins == ["[S(0),S(2)]", "[S(0),S(2)]"] and outs == ["[S(0),P(sum)]"]


def test_matmul_vector_times_matrix():
    """k[S(0)], kn[R,S(1)] -> n[P(sum),S(0)]: a 1-D x loses its m dim."""
    assert _infer("matmul", [(4,), (4, 6)], ["[S(0),R]", "[R,S(1)]"])[1] == ["[P(sum),S(0)]"]


def test_matmul_of_a_pending_sum_stays_pending():
    """mk[P(sum),R] x kn[R,R] -> mn[P(sum),R]; two pending operands on one mesh dim: one is reduced."""
    assert _infer("matmul", [(8, 4), (4, 6)], ["[P(sum),R]", None]) == (["[P(sum),R]", "[R,R]"], ["[P(sum),R]"])
    ins, outs = _infer("matmul", [(8, 4), (4, 6)], ["[P(sum),R]", "[P(sum),R]"])
    assert ins == ["[R,R]", "[R,R]"] and outs == ["[R,R]"]


def test_matmul_grad_data_parallel_and_column_parallel():
    """DP: y_grad [P(sum),R] (the gradient all-reduce); column parallel: x_grad [R,P(sum)]."""
    _, outs = _infer("matmul_grad", [(8, 4), (4, 6), (8, 6)], ["[S(0),R]", None, None])
    assert outs == ["[S(0),R]", "[P(sum),R]"]
    _, outs = _infer("matmul_grad", [(8, 4), (4, 6), (8, 6)], [None, "[R,S(1)]", None])
    assert outs == ["[R,P(sum)]", "[R,S(1)]"]


def test_bias_add_and_its_grad():
    """mn[S(0),S(1)] + n[R,R] -> mn[S(0),S(1)], n required [R,S(0)]; bias grad n[P(sum),S(0)]."""
    ins, outs = _infer("add", [(8, 6), (6,)], ["[S(0),S(1)]", None])
    assert ins == ["[S(0),S(1)]", "[R,S(0)]"] and outs == ["[S(0),S(1)]"]
    _, outs = _infer("add_grad", [(8, 6), (6,), (8, 6)], [None, None, "[S(0),S(1)]"])
    assert outs == ["[S(0),S(1)]", "[P(sum),S(0)]"]


def test_partial_rules_of_binary_ops():
    """add keeps two pending sums pending; multiply keeps one; divide keeps its numerator's
    over a whole divisor (a loss sum over micro-batches / a whole count) and reduces a divisor's;
    relu reduces them."""
    both = ["[P(sum),R]", "[P(sum),R]"]
    assert _infer("add", [(4, 6), (4, 6)], both) == (both, ["[P(sum),R]"])
    assert _infer("add", [(4, 6), (4, 6)], ["[P(sum),R]", None])[0] == ["[R,R]", "[R,R]"]
    assert _infer("multiply", [(4, 6), (4, 6)], ["[P(sum),R]", None]) == (["[P(sum),R]", "[R,R]"], ["[P(sum),R]"])
    assert _infer("divide", [(4, 6), (4, 6)], ["[P(sum),R]", None]) == (["[P(sum),R]", "[R,R]"], ["[P(sum),R]"])
    assert _infer("divide", [(4, 6), (4, 6)], [None, "[P(sum),R]"])[0] == ["[R,R]", "[R,R]"]
    assert _infer("relu", [(4, 6)], ["[S(1),P(sum)]"]) == (["[S(1),R]"], ["[S(1),R]"])


def test_cast_keeps_a_pending_sum_only_into_floats():
    """cast [P(sum)] to float64 stays pending; to int32 or float16 it is reduced first (rounded
    pieces do not sum to the rounded whole: the rule used to keep them, check_rule caught it)."""
    assert _infer("cast", [(4, 6)], ["[S(0),P(sum)]"], {"dtype": paddle.float64})[1] == ["[S(0),P(sum)]"]
    assert _infer("cast", [(4, 6)], ["[S(0),P(sum)]"], {"dtype": "int32"}) == (["[S(0),R]"], ["[S(0),R]"])
    assert _infer("cast", [(4, 6)], ["[S(0),P(sum)]"], {"dtype": "float16"}) == (["[S(0),R]"], ["[S(0),R]"])
    mesh = ProcessMesh([0, 1], ["d"])
    x = (np.random.default_rng(0).standard_normal((4, 3)) * 3).astype("float32")
    cast = eager(UNARY["cast"])
    check_rule("cast", cast, [x], [DistAttr.parse("[P(sum)]", mesh, 2)], {"dtype": "int32"}, mesh)


def test_competing_splits_are_reported():
    """x [S(0)] and y [S(1)] on one mesh dim: one wins, the other is resharded, a Conflict says so."""
    mesh = ProcessMesh([0, 1], ["d"])
    specs = [
        TensorSpec((4, 6), DistAttr.parse("[S(0)]", mesh, 2)),
        TensorSpec((4, 6), DistAttr.parse("[S(1)]", mesh, 2)),
    ]
    result = get_rule("add").infer_forward(specs, {}, RuleContext(mesh))
    assert [str(d) for d in result.inputs] == ["[S(0)]", "[S(0)]"] and result.conflicts
