"""einsum and einsum_grad checked numerically (hypothesis) against Paddle's kernel, over the
equations real models write (matmul-like, batched attention, the rotary table's outer
product, transposes, reductions), broadcast letters (Paddle's spelling of ``...``), diagonals
and an ellipsis left in the attribute. The forward op's ``xshape`` outputs must lie like its
operands; the grad op's caches and ``x_shape`` operands are required as they are."""

import numpy as np
import paddle
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.errors import AutoparError
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.einsum import parse
from autopar.testing import check_rule, eager, eager_grad, maybe_dist_attrs, meshes

EQUATIONS = [
    "ij,jk->ik", "bij,bjk->bik", "bsh,hd->bsd", "i,j->ij", "ij->ji", "ij->j", "ij->", "i,i->",
    "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", "ij,ij->ij", "bij,bkj->bik", "ii->i", "jii->j", "ij,jj->i",
]  # fmt: skip


@st.composite
def einsum_cases(draw):
    """An equation, operands of random sizes per letter; sometimes a letter broadcast (size 1
    in one operand, as Paddle writes an unsqueezed ``...``)."""
    text = draw(st.sampled_from(EQUATIONS))
    lhs = text.split("->")[0].split(",")
    sizes = {c: draw(st.integers(1, 5)) for c in sorted(set("".join(lhs)))}
    shapes = [[sizes[c] for c in names] for names in lhs]
    if len(lhs) == 2 and draw(st.booleans()):
        shared = [c for c in lhs[0] if c in lhs[1] and lhs[0].count(c) == 1 and lhs[1].count(c) == 1 and c in text.split("->")[1]]
        if shared:
            letter, side = draw(st.sampled_from(shared)), draw(st.integers(0, 1))
            shapes[side][lhs[side].index(letter)] = 1
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    return text, [rng.standard_normal(s).astype("float32") for s in shapes]


def _forward(count):
    """The op's results: out, a [0] cache and the operand (its xshape) per operand."""
    run = eager(lambda *xs, equation: paddle.einsum(equation, *xs))

    def fn(inputs, attrs):
        return run(inputs, attrs) + [np.zeros((0,), "float32")] * count + list(inputs)

    return fn


@given(meshes(), einsum_cases(), st.data())
def test_einsum(mesh, case, data):
    text, operands = case
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)) for x in operands]
    check = check_rule("einsum", _forward(len(operands)), operands, dists, {"equation": text}, mesh)
    names, _ = parse(text, [x.shape for x in operands])
    for letters_, attr in zip(names, check.result.inputs):
        assert all(not dims for c, dims in zip(letters_, attr.mapping) if c == "1")
        assert not attr.partial  # the kernel caches its operands for the grad op


def test_einsum_equation_is_the_rule():
    """``bij,bjk->bik`` with j split: a pending sum; the diagonal ``ii->i`` whole; the rotary
    table ``i,j->ij`` keeps both splits."""
    mesh = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    rule, ctx = get_rule("pd_op.einsum"), RuleContext(mesh)
    a = TensorSpec((4, 6, 8), DistAttr(mesh, [(0,), (), (1,)]))
    b = TensorSpec((4, 8, 2), None)
    result = rule.infer_forward([a, b], {"equation": "bij,bjk->bik"}, ctx)
    assert [str(d) for d in result.outputs] == ["[S(0),P(sum)]", "[R,R]", "[R,R]", "[S(0),S(2)]", "[S(0),S(1)]"]
    diagonal = rule.infer_forward([TensorSpec((4, 4), DistAttr(mesh, [(0,), (1,)]))], {"equation": "ii->i"}, ctx)
    assert diagonal.outputs[0].is_replicated and diagonal.inputs[0].is_replicated
    outer = rule.infer_forward([TensorSpec((8,), DistAttr(mesh, [(0,)])), TensorSpec((4,), DistAttr(mesh, [(1,)]))], {"equation": "i,j->ij"}, ctx)
    assert str(outer.outputs[0]) == "[S(0),S(1)]"


def test_an_ellipsis_left_in_the_attribute_gets_broadcast_letters():
    names, out = parse("...ij,...jk->...ik", [(5, 2, 3), (1, 3, 4)])
    assert names[0][1:] == "ij" and names[1][0] == "1" and out[0] == names[0][0] and out[1:] == "ik"
    assert parse("ij,jk", [(2, 3), (3, 4)]) == (["ij", "jk"], "ik")
    with pytest.raises(AutoparError, match="cannot read the equation"):
        get_rule("einsum").infer_forward([TensorSpec((2, 3))], {"equation": "iJ->i"}, RuleContext(ProcessMesh([0, 1], ["x"])))


@given(meshes(), einsum_cases(), st.data())
def test_einsum_grad(mesh, case, data):
    """The grad op's x_shape operands carry the forward op's placements (drawn, then inferred
    by the forward rule); the output gradient arrives however it lies. The caches are modelled
    as the operands themselves, laid out like x_shape (in the program they are [0]-shaped
    values whose local contents the forward kernel wrote)."""
    text, operands = case
    forward = get_rule("einsum").infer_forward(
        [TensorSpec(x.shape, data.draw(maybe_dist_attrs(mesh, x.ndim))) for x in operands], {"equation": text}, RuleContext(mesh)
    )
    count = len(operands)
    out = eager(lambda *xs, equation: paddle.einsum(equation, *xs))(operands, {"equation": text})[0]
    g = np.random.default_rng(7).standard_normal(out.shape).astype("float32")
    grad = eager_grad(lambda *xs, equation: paddle.einsum(equation, *xs), list(range(count)))

    names, out_names = parse(text, [x.shape for x in operands])

    def fn(inputs, attrs):
        """The kernel: label sizes from the local x_shape dims, data from the caches (the
        forward op's local operands, here passed laid out like x_shape)."""
        shapes_, caches_, g_ = inputs[:count], inputs[count : 2 * count], inputs[-1]
        sizes = {c: n for letters_, x in zip(names, shapes_) for c, n in zip(letters_, x.shape) if c != "1"}
        assert all(sizes.get(c, n) == n for c, n in zip(out_names, g_.shape)), "out_grad's local shape disagrees with x_shape's"
        assert all(s.shape == c.shape for s, c in zip(shapes_, caches_)), "a cache does not match its x_shape"
        return grad([*caches_, g_], attrs)

    shapes_ = list(forward.outputs[1 + count :])
    dists = [*shapes_, *shapes_, data.draw(maybe_dist_attrs(mesh, g.ndim, partial=True))]  # caches laid out like their operands
    check = check_rule("einsum_grad", fn, [*operands, *operands, g], dists, {"equation": text}, mesh)
    assert list(check.result.inputs[: 2 * count]) == dists[: 2 * count]  # x_shape and caches as they are


def test_einsum_grad_refuses_x_shapes_that_disagree():
    mesh = ProcessMesh([0, 1], ["x"])
    a = TensorSpec((4, 6), DistAttr(mesh, [(0,), ()]))
    b = TensorSpec((4, 6), DistAttr.replicated(mesh, 2))
    cache = TensorSpec((0,), DistAttr.replicated(mesh, 1))
    with pytest.raises(AutoparError, match="disagree"):
        get_rule("einsum_grad").infer_forward([a, b, cache, cache, TensorSpec((4, 6))], {"equation": "ij,ij->ij"}, RuleContext(mesh))
