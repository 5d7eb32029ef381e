"""Differential tests of the LLM / ViT op rules against Paddle's own SPMD rules (einsum,
take_along_axis, put_along_axis, gather_nd, scatter, pad, swiglu, fused_rms_norm,
fused_rotary_position_embedding, flash_attention), forward inference on clean cases (even
splits, one mesh dim per tensor dim, no mesh dim wanted by two dims). Where the answers
differ, ours is checked numerically and the difference is one of three kinds, each asserted:

- Paddle keeps a subset of our splits (einsum's outer product with both operands split,
  flash_attention reading only the query's splits, scatter reading only the updates'): it
  gathers what we keep, and ours is exact (``test_rules_*``);
- Paddle's placements are numerically wrong for a kernel that runs on each rank's pieces:
  scatter with the updates' rows split (Paddle: a pending sum of overwrites, which counts the
  untouched rows of x once per rank), swiglu of one tensor with its last dim split (each rank
  would pair halves of its own columns). Shown by running the kernel on Paddle's placements.
"""

import numpy as np
import paddle
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec
from paddle_oracle import Spec, drop_trivial, paddle_dists, paddle_infer, split_hazards

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, RuleResult, SpmdRule, TensorSpec, get_rule
from autopar.spmd.gather_scatter import _along_axis, _gather_nd_letters, _put_letters
from autopar.testing import check_rule, checker, eager, meshes

ABSENT = DistTensorSpec()


def _ours(op, specs, attrs, mesh):
    specs = [None if s is None else TensorSpec(tuple(s.shape), s.dist) for s in specs]
    return get_rule(op).infer_forward(specs, attrs, RuleContext(mesh, op_name=op))


def _even(shape, dist):
    return all(not dims or (size % int(np.prod([dist.mesh.shape[d] for d in dims])) == 0 and size > 1) for size, dims in zip(shape, dist.mapping))


def _clean(letters, specs):
    """Even splits, no hazards (letters written ``1`` get unique names: a split of a whole dim is
    dropped by both rules alike)."""
    present = [s for s in specs if s is not None]
    spare = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unique = ["".join(c if c != "1" else next(spare) for c in names) for names in letters]
    return all(_even(s.shape, s.dist) for s in present) and not split_hazards(unique, [s.shape for s in present], [s.dist for s in present])


def _pairs(ours, theirs):
    """(ours, Paddle's) placements with one-rank mesh dims dropped, None where either is absent."""
    return [(drop_trivial(a), drop_trivial(b)) for a, b in zip(ours, theirs) if a is not None and b is not None]


def _same(ours: RuleResult, ins, outs, inputs):
    """Our required inputs (at ``inputs``, in Paddle's order) and outputs equal Paddle's."""
    pairs = _pairs([ours.inputs[i] for i in inputs], ins) + _pairs(ours.outputs, outs)
    return all(a.mapping == b.mapping and set(a.partial_dims) == set(b.partial_dims) for a, b in pairs)


def _coarser(ours: RuleResult, ins, outs, inputs):
    """Paddle keeps a subset of our splits on every tensor dim, and no pending sum we lack."""
    pairs = _pairs([ours.inputs[i] for i in inputs], ins) + _pairs(ours.outputs, outs)
    return all(
        all(set(p) <= set(o) for o, p in zip(a.mapping, b.mapping)) and set(b.partial_dims) <= set(a.partial_dims) for a, b in pairs
    )  # fmt: skip


def _sizes(draw, letters):
    return {c: draw(st.sampled_from([4, 8])) for c in sorted(set("".join(letters)))}


# ---- einsum ----------------------------------------------------------------------------------

EQUATIONS = ["ij,jk->ik", "bij,bjk->bik", "bsh,hd->bsd", "i,j->ij", "ij->ji", "ij->j", "bhqd,bhkd->bhqk", "ij,ij->ij"]


@given(meshes(), st.sampled_from(EQUATIONS), st.data())
def test_einsum_vs_paddle(mesh, text, data):
    lhs = text.split("->")[0].split(",")
    sizes = _sizes(data.draw, lhs)
    specs = [Spec(tuple(sizes[c] for c in names), data.draw(paddle_dists(mesh, len(names)))) for names in lhs]
    assume(_clean(lhs, specs))
    ours = _ours("einsum", specs, {"equation": text}, mesh)
    ins, outs = paddle_infer("einsum", specs, text)
    outer = len(lhs) == 2 and not set(lhs[0]) & set(lhs[1])
    if outer and all(drop_trivial(s.dist).sharded_mesh_dims() for s in specs):
        assert _coarser(ours, ins, outs[:1], [0, 1])  # Paddle replicates one operand of an outer product
    else:
        assert _same(ours, ins, outs[:1], list(range(len(specs))))


# ---- index-driven ops ------------------------------------------------------------------------


@st.composite
def along_axis(draw, mesh, count):
    shape = tuple(draw(st.sampled_from([4, 8])) for _ in range(3))
    axis = draw(st.integers(0, 2))
    index = tuple(draw(st.sampled_from([4, 8])) if d == axis else draw(st.sampled_from([size, size // 2])) for d, size in enumerate(shape))
    return axis, [Spec(shape, draw(paddle_dists(mesh, 3)))] + [Spec(index, draw(paddle_dists(mesh, 3))) for _ in range(count - 1)]


@given(meshes(), st.data())
def test_take_along_axis_vs_paddle(mesh, data):
    axis, specs = data.draw(along_axis(mesh, 2))
    assume(_clean(list(_along_axis(specs[0].shape, specs[1].shape, axis, axis_split=True)), specs))
    ours = _ours("take_along_axis", specs, {"axis": axis}, mesh)
    assert _same(ours, *paddle_infer("take_along_axis", *specs, axis), [0, 1])


@given(meshes(), st.sampled_from(["assign", "add", "mul"]), st.data())
def test_put_along_axis_vs_paddle(mesh, reduce, data):
    axis, specs = data.draw(along_axis(mesh, 3))
    attrs = {"axis": axis, "reduce": reduce, "include_self": True}
    assume(_clean(_put_letters([TensorSpec(s.shape) for s in specs], attrs), specs))
    ours = _ours("put_along_axis", specs, attrs, mesh)
    assert _same(ours, *paddle_infer("put_along_axis", *specs, axis, reduce, True), [0, 1, 2])


@given(meshes(), st.data())
def test_gather_nd_vs_paddle(mesh, data):
    x_shape = tuple(data.draw(st.sampled_from([4, 8])) for _ in range(3))
    index_shape = (data.draw(st.sampled_from([4, 8])),) * data.draw(st.integers(1, 2)) + (data.draw(st.integers(1, 3)),)
    specs = [Spec(x_shape, data.draw(paddle_dists(mesh, 3))), Spec(index_shape, data.draw(paddle_dists(mesh, len(index_shape))))]
    assume(_clean(list(_gather_nd_letters(x_shape, index_shape)[:2]), specs))
    assert _same(_ours("gather_nd", specs, {}, mesh), *paddle_infer("gather_nd", *specs), [0, 1])


@given(meshes(), st.data())
def test_scatter_vs_paddle(mesh, data):
    """Paddle follows the updates' splits only: a split of x alone is gathered (coarser), and
    a split of the updates' rows makes its output a pending sum (wrong: see below)."""
    rows, cols = data.draw(st.sampled_from([4, 8])), data.draw(st.sampled_from([4, 8]))
    specs = [Spec((8, cols), data.draw(paddle_dists(mesh, 2))), Spec((rows,), data.draw(paddle_dists(mesh, 1))), Spec((rows, cols), data.draw(paddle_dists(mesh, 2)))]
    assume(_clean(["ab", "c", "cb"], specs))
    ours = _ours("scatter", specs, {"overwrite": True}, mesh)
    ins, outs = paddle_infer("scatter", *specs, True)
    assert not ours.outputs[0].partial
    if drop_trivial(outs[0]).partial:
        assert drop_trivial(ins[2]).mapping[0]  # Paddle's pending sum comes from splitting the updates' rows
    else:
        assert _coarser(ours, ins, outs, [0, 1, 2])


class _Answer(SpmdRule):
    """A fixed answer, to run the numerical checker on Paddle's placements."""

    def __init__(self, result):
        self.result = result

    def infer_forward(self, inputs, attrs, ctx):
        return self.result


def _check_answer(monkeypatch, op, fn, inputs, answer, attrs, mesh):
    monkeypatch.setattr(checker, "get_rule", lambda name: _Answer(answer))
    return check_rule(op, fn, inputs, [None] * len(inputs), attrs, mesh)


def test_paddles_scatter_placements_count_untouched_rows_once_per_rank(monkeypatch):
    mesh = ProcessMesh([0, 1], ["x"])
    rng = np.random.default_rng(0)
    x, index, updates = rng.standard_normal((8, 4)).astype("float32"), np.array([6, 1, 3, 0], "int64"), rng.standard_normal((4, 4)).astype("float32")
    specs = [Spec((8, 4), DistAttr.replicated(mesh, 2)), Spec((4,), DistAttr(mesh, [(0,)])), Spec((4, 4), DistAttr(mesh, [(0,), ()]))]
    ins, outs = paddle_infer("scatter", *specs, True)
    assert outs[0].partial  # Paddle: each rank scatters its rows into x, the pieces summed
    scatter = eager(lambda t, i, u, overwrite: paddle.scatter(t, i, u, overwrite=overwrite))
    with pytest.raises(checker.RuleCheckError):
        _check_answer(monkeypatch, "scatter", scatter, [x, index, updates], RuleResult(tuple(ins), tuple(outs)), {"overwrite": True}, mesh)
    monkeypatch.undo()
    check_rule("scatter", scatter, [x, index, updates], [s.dist for s in specs], {"overwrite": True}, mesh)


# ---- pad, swiglu -----------------------------------------------------------------------------


@given(meshes(), st.data())
def test_pad_vs_paddle(mesh, data):
    shape = tuple(data.draw(st.sampled_from([4, 8])) for _ in range(3))
    paddings = [data.draw(st.sampled_from([0, 0, 1])) for _ in range(6)]
    spec = Spec(shape, data.draw(paddle_dists(mesh, 3)))
    assume(_even(shape, spec.dist))
    ours = _ours("pad", [spec, Spec((1,), None)], {"paddings": paddings, "pad_value": 0.0}, mesh)
    assert _same(ours, *paddle_infer("pad", [spec], paddings, 0), [0])


@given(meshes(), st.data())
def test_swiglu_vs_paddle(mesh, data):
    shape = tuple(data.draw(st.sampled_from([4, 8])) for _ in range(3))
    specs = [Spec(shape, data.draw(paddle_dists(mesh, 3))) for _ in range(2)]
    assume(_clean(["abc", "abc"], specs))
    assert _same(_ours("swiglu", specs, {}, mesh), *paddle_infer("swiglu", *specs), [0, 1])


def test_paddles_swiglu_of_one_tensor_pairs_the_wrong_halves(monkeypatch):
    mesh = ProcessMesh([0, 1], ["mp"])
    x = np.random.default_rng(1).standard_normal((4, 8)).astype("float32")
    ins, outs = paddle_infer("swiglu", Spec((4, 8), DistAttr(mesh, [(), (0,)])), ABSENT)
    assert ins[0].mapping[1] and outs[0].mapping[1]  # Paddle keeps the column split
    swiglu = eager(lambda t: paddle.nn.functional.swiglu(t))
    answer = RuleResult((ins[0], None), tuple(outs))
    with pytest.raises(checker.RuleCheckError):
        _check_answer(monkeypatch, "swiglu", lambda i, a: swiglu(i[:1], a), [x, None], answer, {}, mesh)


# ---- fused Llama ops (Paddle's rules exist; the kernels are GPU-only but for fused_rms_norm's forward) --


@given(meshes(), st.data())
def test_rms_norm_vs_paddle(mesh, data):
    """Paddle's ``fused_rms_norm`` rule (x, scale) normalizes the last dim: our rms_norm and
    fused_rms_norm_quant with the last dim normalized must agree with it."""
    shape = tuple(data.draw(st.sampled_from([4, 8])) for _ in range(3))
    x, scale = Spec(shape, data.draw(paddle_dists(mesh, 3))), Spec((shape[-1],), data.draw(paddle_dists(mesh, 1)))
    assume(_clean(["ab1", "1"], [x, scale]))
    ins, outs = paddle_infer("fused_rms_norm", x, scale, 1e-6)
    assert _same(_ours("rms_norm", [x, scale], {"normalized_shape": [shape[-1]]}, mesh), ins, outs, [0, 1])
    quant = _ours("fused_rms_norm_quant", [x, None, None, scale, None], {"begin_norm_axis": 2}, mesh)
    assert _same(RuleResult((quant.inputs[0], quant.inputs[3]), (quant.outputs[0], quant.outputs[2])), ins, outs, [0, 1])


@given(meshes(), st.data())
def test_fused_rope_vs_paddle(mesh, data):
    b, s, h = (data.draw(st.sampled_from([4, 8])) for _ in range(3))
    q, k = (Spec((b, s, h, 8), data.draw(paddle_dists(mesh, 4))) for _ in range(2))
    sin, cos = (Spec((1, s, 1, 8), DistAttr.replicated(mesh, 4)) for _ in range(2))
    assume(_clean(["bsh1", "bsh1"], [q, k]))
    ours = _ours("fused_rotary_position_embedding", [q, k, None, sin, cos, None], {"use_neox_rotary_style": True}, mesh)
    ins, outs = paddle_infer("fused_rotary_position_embedding", q, k, ABSENT, sin, cos, ABSENT, True, False, 10000.0)
    mine = RuleResult((ours.inputs[0], ours.inputs[1], ours.inputs[3], ours.inputs[4]), ours.outputs[:2])
    assert _same(mine, [ins[0], ins[1], ins[3], ins[4]], outs[:2], [0, 1, 2, 3])


@given(meshes(), st.booleans(), st.data())
def test_flash_attention_vs_paddle(mesh, causal, data):
    """Paddle takes the batch / head splits of the query only; ours merges q, k and v's."""
    b, s, h = (data.draw(st.sampled_from([4, 8])) for _ in range(3))
    specs = [Spec((b, s, h, 8), data.draw(paddle_dists(mesh, 4))) for _ in range(3)]
    assume(_clean(["b1h1"] * 3, specs))
    ours = _ours("flash_attn", [*specs, None, None], {"dropout": 0.0, "causal": causal}, mesh)
    ins, outs = paddle_infer("flash_attention", *specs, ABSENT, ABSENT, 0.0, causal, False, False, "")
    assert _coarser(ours, ins[:3], outs[:3], [0, 1, 2])
    if all(s.dist == specs[0].dist for s in specs):
        assert _same(ours, ins[:3], outs[:3], [0, 1, 2])
