"""Differential tests of the reduction, softmax, cross-entropy, layer_norm and embedding rules
against Paddle's own (forward and reverse inference).

Paddle names: ``sum``, ``max``, ``min`` (their reduction rule), ``softmax``, ``log_softmax``,
``cross_entropy_with_softmax``, ``layer_norm``, ``embedding``. Paddle 3.3.1 has no ``mean``
rule: our ``mean`` (a pending sum scaled by n_local / n, see reduction.py) is compared with
Paddle's ``sum``, whose placements it shares. No grad op has a Paddle rule (``sum_grad``,
``softmax_grad``, ``layer_norm_grad``, ``embedding_grad``, ...: "Spmd rules is not
registered"): those are checked numerically only (test_rules_reduction_softmax,
test_rules_norm_embedding).

On a clean case (even splits, no competing splits: ``split_hazards``) the rules must agree
exactly, one-rank mesh dims aside; where they differ ours is checked numerically. Known,
deliberate differences:
- cross_entropy_with_softmax: both keep a class split of a hard label (vocabulary-parallel:
  our vocab_parallel pass rewrites the op per rank); Paddle refuses a class split with a soft
  label (ours gathers the classes) or on a class axis that is not the last (ours keeps it),
  and its reverse rule gathers such splits;
- embedding: both make the output partial for a vocab-split table (our pass emits the masked
  lookup); Paddle refuses a vocab split with a padding_idx, ours keeps it (the padding row
  is local to one rank);
- softmax / log_softmax: Paddle gathers the normalized axis, ours keeps its split (all_reduces
  of the row max and the sum of exponentials); such cases are checked numerically through the
  decomposition each rank runs (split_rows.check_split_rule);
- layer_norm: both keep the normalized dims whole (Paddle's reverse layer_norm rule refuses two
  split normalized dims, we drop both splits);
- partial inputs (``test_partial_inputs_vs_paddle``): Paddle's sum reduces a pending sum
  first; sum and mean are linear, so ours keeps it pending;
- max / min over a split dim: both make the output partial over its mesh dim, but Paddle's
  registered ``max`` / ``min`` rule (``ReductionInferSpmd``) labels that partial SUM, which
  would add the per-rank maxima; ours is a pending max (``test_max_partial_kind``);
- uneven splits or more parts than elements, and competing splits: as in
  test_paddle_diff_matmul_elementwise.
"""

import math

import numpy as np
import paddle.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from paddle.base import core
from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec
from paddle_oracle import (
    Spec,
    agree_or_explained,
    nontrivial_differences,
    paddle_dists,
    paddle_infer,
    paddle_infer_backward,
    split_hazards,
)
from split_rows import check_split_rule
from test_rules_norm_embedding import EPS, embedding, layer_norm
from test_rules_reduction_softmax import _ce, _kernel, _rand, _reduce, cross_entropy_cases

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.operands import letters
from autopar.spmd.reduction import reduction_letters
from autopar.testing import check_rule, eager, meshes

PADDLE_REFUSES = (ValueError, NotImplementedError, RuntimeError)

# ---- cases: sides that mesh sizes often divide, so that clean cases (where the rules must
# agree exactly) are common; odd sides still give the uneven ones -----------------------------

SIDES = st.sampled_from([1, 2, 3, 4, 6, 8])


def even_shapes(min_dims, max_dims):
    return st.lists(SIDES, min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def reduce_cases(draw):
    shape = draw(even_shapes(0, 3))
    ndim = len(shape)
    axes = draw(st.lists(st.integers(-ndim, ndim - 1), unique_by=lambda a: a % ndim, max_size=ndim)) if ndim else []
    return shape, {"axis": axes, "keepdim": draw(st.booleans())}


@st.composite
def softmax_cases(draw):
    shape = draw(even_shapes(1, 3))
    return shape, {"axis": draw(st.integers(-len(shape), len(shape) - 1))}




@st.composite
def layer_norm_cases(draw):
    shape = draw(even_shapes(2, 3))
    begin = draw(st.integers(1, len(shape) - 1))
    norm = math.prod(shape[begin:])
    scale, bias = (_rand((norm,), 1), _rand((norm,), 2)) if draw(st.booleans()) else (None, None)
    return _rand(shape), scale, bias, {"begin_norm_axis": begin, "epsilon": EPS}


@st.composite
def embedding_cases(draw):
    ids_shape = draw(even_shapes(1, 2))
    vocab, hidden = draw(SIDES), draw(SIDES)
    ids = np.random.default_rng(4).integers(0, vocab, ids_shape).astype("int64")
    padding = draw(st.sampled_from([-1, int(ids.flat[0])]))
    return ids, _rand((vocab, hidden)), {"padding_idx": padding, "sparse": False}


def _ours(op, shapes_, dists, attrs, mesh):
    specs = [None if s is None else TensorSpec(tuple(s), d) for s, d in zip(shapes_, dists)]
    return get_rule(op).infer_forward(specs, attrs, RuleContext(mesh, op_name=op))


def _ours_backward(op, in_shapes, out_shapes, out_dists, attrs, mesh):
    specs = [None if s is None else TensorSpec(tuple(s)) for s in in_shapes]
    outs = [TensorSpec(tuple(s), d) for s, d in zip(out_shapes, out_dists)]
    return get_rule(op).infer_backward(specs, outs, attrs, RuleContext(mesh, op_name=op))


def _whole(mesh, shape):
    return Spec(tuple(shape), DistAttr.replicated(mesh, len(shape)))


def _paddle_or_refused(call, refusal_explained, check):
    """Paddle's answer, or None when it refuses a case we can explain (ours is then checked)."""
    try:
        return call()
    except PADDLE_REFUSES as err:
        assert refusal_explained, err
        check()
        return None


# ---- reductions ------------------------------------------------------------------------------


@given(meshes(), reduce_cases(), st.sampled_from(["sum", "mean", "max", "min"]), st.data())
def test_reduction_vs_paddle(mesh, case, name, data):
    """Forward and reverse; our mean against Paddle's sum (Paddle has no mean rule)."""
    shape, attrs = case
    x, axis = _rand(shape, ties=name in ("max", "min")), np.array(attrs["axis"], "int64")
    paddle_name = "sum" if name == "mean" else name
    dist = data.draw(paddle_dists(mesh, len(shape)))
    ours = _ours(name, [shape, axis.shape], [dist, None], attrs, mesh)
    ins, outs = paddle_infer(paddle_name, Spec(shape, dist), list(attrs["axis"]), attrs["keepdim"])
    x_letters, out_letters = reduction_letters(len(shape), attrs)

    def check():
        check_rule(name, _reduce(name), [x, axis], [dist, None], attrs, mesh)

    agree_or_explained(
        nontrivial_differences(ours, ins, outs, [0]), split_hazards([x_letters], [shape], [dist]), check
    )

    out = _reduce(name)([x, axis], attrs)[0]
    out_dist = data.draw(paddle_dists(mesh, out.ndim))
    ours = _ours_backward(name, [shape, axis.shape], [out.shape], [out_dist], attrs, mesh)
    args = list(attrs["axis"]), attrs["keepdim"]
    hazards = split_hazards([out_letters], [out.shape], [out_dist])

    def check_backward():
        check_rule(name, _reduce(name), [x, axis], [None, None], attrs, mesh, backward=[out_dist])

    answer = _paddle_or_refused(
        lambda: paddle_infer_backward(paddle_name, [_whole(mesh, shape)], [Spec(out.shape, out_dist)], *args),
        split_hazards([out_letters], [out.shape], [out_dist], one_rank_dims=True),
        check_backward,
    )
    if answer is None:
        return
    ins, outs = answer
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0]), hazards, check_backward)


def test_max_partial_kind():
    """Max over a split dim: ours P(max), Paddle's registered rule P(SUM) (summing per-rank maxima)."""
    mesh = ProcessMesh([0, 1], ["d"])
    dist = DistAttr.parse("[S(0)]", mesh, 2)
    attrs = {"axis": [0], "keepdim": False}
    theirs = core.get_phi_spmd_rule("max").infer_forward(_paddle_spec((4, 6), dist), [0], False)
    assert "SUM" in str(theirs[1][0])
    x = _rand((4, 6))
    check = check_rule("max", _reduce("max"), [x, np.array([0], "int64")], [dist, None], attrs, mesh)
    assert str(check.result.outputs[0]) == "[P(max)]"


def _paddle_spec(shape, dist):
    return DistTensorSpec(list(shape), dist.to_paddle())


# ---- softmax / log_softmax -------------------------------------------------------------------


@given(meshes(), softmax_cases(), st.sampled_from(["softmax", "log_softmax"]), st.data())
def test_softmax_vs_paddle(mesh, case, name, data):
    shape, attrs = case
    x = _rand(shape)
    fn = eager(lambda t, axis: getattr(F, name)(t, axis=axis))
    names = letters(len(shape))
    for direction in ("forward", "backward"):
        dist = data.draw(paddle_dists(mesh, len(shape)))
        if direction == "forward":
            ours = _ours(name, [shape], [dist], attrs, mesh)
            ins, outs = paddle_infer(name, Spec(shape, dist), attrs["axis"])
            given_dists, backward = [dist], None
        else:
            ours = _ours_backward(name, [shape], [shape], [dist], attrs, mesh)
            ins, outs = paddle_infer_backward(name, [_whole(mesh, shape)], [Spec(shape, dist)], attrs["axis"])
            given_dists, backward = [None], [dist]
        hazards = split_hazards([names], [shape], [dist])
        if _class_split(dist, attrs["axis"] % len(shape)):
            hazards.append("normalized axis split (Paddle gathers it, ours keeps it)")
        agree_or_explained(
            nontrivial_differences(ours, ins, outs, [0]),
            hazards,
            lambda given=given_dists, back=backward: check_split_rule(name, fn, [x], given, attrs, mesh, backward=back),
        )


# ---- cross_entropy_with_softmax --------------------------------------------------------------

CE_ATTRS = ("soft_label", "use_softmax", "numeric_stable_mode", "ignore_index", "axis")


def _ce_letters(shape, label, axis):
    logits = letters(len(shape))
    label_letters = logits if label.shape == tuple(shape) else logits.replace(logits[axis], "z")
    return logits, label_letters


def _class_split(dist, axis, one_rank_dims=False):
    """``dist`` splits tensor dim ``axis`` (over a mesh dim of several ranks, or any)."""
    return dist is not None and any(one_rank_dims or dist.mesh.shape[d] > 1 for d in dist.mapping[axis])


@given(meshes(), cross_entropy_cases(even_shapes(1, 3)), st.data())
def test_cross_entropy_with_softmax_vs_paddle(mesh, case, data):
    """Both keep a class split of a hard label (vocabulary-parallel); Paddle refuses one with a
    soft label or a class axis that is not the last."""
    shape, label, attrs = case
    axis = attrs["axis"] % len(shape)
    logits = _rand(shape)
    dists = [data.draw(paddle_dists(mesh, len(shape))), data.draw(paddle_dists(mesh, label.ndim))]
    ours = _ours("cross_entropy_with_softmax", [shape, label.shape], dists, attrs, mesh)
    hazards = split_hazards(list(_ce_letters(shape, label, axis)), [shape, label.shape], dists)
    if attrs["soft_label"] and any(_class_split(d, axis) for d in dists):
        hazards.append("class axis split of a soft label (ours gathers it)")

    def check():
        check_split_rule("cross_entropy_with_softmax", _kernel(_ce), [logits, label], dists, attrs, mesh)

    try:
        ins, outs = paddle_infer(
            "cross_entropy_with_softmax",
            Spec(shape, dists[0]),
            Spec(label.shape, dists[1]),
            *(attrs[k] for k in CE_ATTRS),
        )
    except PADDLE_REFUSES:  # a split class axis (even over one rank) with a soft label or not last
        class_split = any(_class_split(d, axis, one_rank_dims=True) for d in dists)
        unsupported = attrs["soft_label"] or axis != len(shape) - 1
        letters_ = list(_ce_letters(shape, label, axis))
        assert (class_split and unsupported) or split_hazards(letters_, [shape, label.shape], dists, one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


@given(meshes(), cross_entropy_cases(even_shapes(1, 3)), st.data())
def test_cross_entropy_with_softmax_backward_vs_paddle(mesh, case, data):
    shape, label, attrs = case
    axis = attrs["axis"] % len(shape)
    logits = _rand(shape)
    softmax, loss = _kernel(_ce)([logits, label], attrs)
    out_dists = [data.draw(paddle_dists(mesh, len(shape))), data.draw(paddle_dists(mesh, loss.ndim))]
    ours = _ours_backward(
        "cross_entropy_with_softmax", [shape, label.shape], [shape, loss.shape], out_dists, attrs, mesh
    )
    names = letters(len(shape))
    loss_letters = names.replace(names[axis], "z")
    hazards = split_hazards([names, loss_letters], [shape, loss.shape], out_dists)
    if _class_split(out_dists[0], axis) and (attrs["soft_label"] or axis != len(shape) - 1):
        # Paddle keeps a class split for a hard label on the last axis only; ours for any hard label
        hazards.append("class axis split of a soft label or on an axis that is not the last")

    def check():
        check_split_rule(
            "cross_entropy_with_softmax", _kernel(_ce), [logits, label], [None, None], attrs, mesh, backward=out_dists
        )

    try:
        ins, outs = paddle_infer_backward(
            "cross_entropy_with_softmax",
            [_whole(mesh, shape), _whole(mesh, label.shape)],
            [Spec(shape, out_dists[0]), Spec(loss.shape, out_dists[1])],
            *(attrs[k] for k in CE_ATTRS),
        )
    except PADDLE_REFUSES:
        assert split_hazards([names, loss_letters], [shape, loss.shape], out_dists, one_rank_dims=True)
        return check()
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)


# ---- layer_norm ------------------------------------------------------------------------------


@given(meshes(), layer_norm_cases(), st.data())
def test_layer_norm_vs_paddle(mesh, case, data):
    """Both keep the normalized dims (and scale / bias) whole. Paddle's rule needs scale and
    bias operands: absent ones (no affine) are given to it replicated and not compared."""
    x, scale, bias, attrs = case
    begin = attrs["begin_norm_axis"]
    norm = (math.prod(x.shape[begin:]),)
    x_dist = data.draw(paddle_dists(mesh, x.ndim))
    vec = [None if v is None else data.draw(paddle_dists(mesh, 1)) for v in (scale, bias)]
    shapes_ = [x.shape, None if scale is None else norm, None if bias is None else norm]
    ours = _ours("layer_norm", shapes_, [x_dist, *vec], attrs, mesh)
    vec_specs = [Spec(norm, d if d is not None else DistAttr.replicated(mesh, 1)) for d in vec]
    ins, outs = paddle_infer("layer_norm", Spec(x.shape, x_dist), *vec_specs, attrs["epsilon"], begin)
    compared = [0] + [i for i in (1, 2) if vec[i - 1] is not None]
    x_letters = letters(x.ndim)
    hazards = split_hazards([x_letters, "z", "z"], [x.shape, norm, norm], [x_dist, *vec])

    def check():
        check_rule("layer_norm", layer_norm, [x, scale, bias], [x_dist, *vec], attrs, mesh)

    agree_or_explained(nontrivial_differences(ours, ins, outs, compared), hazards, check)

    out_dists = [data.draw(paddle_dists(mesh, x.ndim))] + [data.draw(paddle_dists(mesh, begin))] * 2
    ours = _ours_backward("layer_norm", shapes_, [x.shape, x.shape[:begin], x.shape[:begin]], out_dists, attrs, mesh)
    outs_specs = [Spec(x.shape, out_dists[0])] + [Spec(x.shape[:begin], d) for d in out_dists[1:]]
    whole = [_whole(mesh, x.shape), _whole(mesh, norm), _whole(mesh, norm)]
    try:
        ins, outs = paddle_infer_backward("layer_norm", whole, outs_specs, attrs["epsilon"], begin)
    except PADDLE_REFUSES:
        ins = outs = None
    lead = x_letters[:begin]
    hazards = split_hazards([x_letters, lead, lead], [x.shape, x.shape[:begin], x.shape[:begin]], out_dists)

    def check_backward():
        check_rule("layer_norm", layer_norm, [x, scale, bias], [None] * 3, attrs, mesh, backward=out_dists)

    if ins is None:  # Paddle's reverse rule gives all normalized dims one letter: two splits clash
        clash = sum(1 for dims in out_dists[0].mapping[begin:] if dims) > 1
        lead_shapes = [x.shape] + [x.shape[:begin]] * 2
        assert clash or split_hazards([x_letters, lead, lead], lead_shapes, out_dists, one_rank_dims=True)
        return check_backward()
    agree_or_explained(nontrivial_differences(ours, ins, outs, compared), hazards, check_backward)


# ---- embedding -------------------------------------------------------------------------------


@given(meshes(), embedding_cases(), st.data())
def test_embedding_vs_paddle(mesh, case, data):
    """Both make the output partial over a vocabulary split (ours through the masked lookup the
    vocab_parallel pass emits); Paddle refuses one with a padding_idx."""
    ids, weight, attrs = case
    dists = [data.draw(paddle_dists(mesh, ids.ndim)), data.draw(paddle_dists(mesh, 2))]
    ours = _ours("embedding", [ids.shape, weight.shape], dists, attrs, mesh)
    ids_letters = letters(ids.ndim)
    hazards = split_hazards([ids_letters, "vz"], [ids.shape, weight.shape], dists)

    def check():
        check_split_rule("embedding", embedding, [ids, weight], dists, attrs, mesh)

    # Paddle refuses a vocab split with a padding_idx, and competing splits, even over one rank
    refused = split_hazards([ids_letters, "vz"], [ids.shape, weight.shape], dists, one_rank_dims=True)
    if _class_split(dists[1], 0, one_rank_dims=True) and attrs["padding_idx"] >= 0:
        refused.append("vocabulary split with a padding_idx")
    answer = _paddle_or_refused(
        lambda: paddle_infer(
            "embedding", Spec(ids.shape, dists[0]), Spec(weight.shape, dists[1]), attrs["padding_idx"], False
        ),
        refused,
        check,
    )
    if answer is None:
        return
    ins, outs = answer
    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check)

    out = embedding([ids, weight], attrs)[0]
    out_dist = data.draw(paddle_dists(mesh, out.ndim))
    ours = _ours_backward("embedding", [ids.shape, weight.shape], [out.shape], [out_dist], attrs, mesh)
    whole = [_whole(mesh, ids.shape), _whole(mesh, weight.shape)]
    ins, outs = paddle_infer_backward("embedding", whole, [Spec(out.shape, out_dist)], attrs["padding_idx"], False)
    hazards = split_hazards([ids_letters + "z"], [out.shape], [out_dist])

    def check_backward():
        check_split_rule("embedding", embedding, [ids, weight], [None, None], attrs, mesh, backward=[out_dist])

    agree_or_explained(nontrivial_differences(ours, ins, outs, [0, 1]), hazards, check_backward)


# ---- partial inputs and readable cases -------------------------------------------------------

MESH = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_partial_inputs_vs_paddle():
    """sum / mean of a pending sum: ours keeps it pending (linear), Paddle reduces it first;
    max / softmax / layer_norm / cross-entropy: both reduce it first."""
    p = DistAttr.parse("[S(0),P(sum)]", MESH, 2)
    x = _rand((4, 6))
    attrs = {"axis": [1], "keepdim": False}
    for name in ("sum", "mean", "max"):
        ours = _ours(name, [(4, 6), (1,)], [p, None], attrs, MESH)
        ins, outs = paddle_infer("sum" if name == "mean" else name, Spec((4, 6), p), [1], False)
        diffs = nontrivial_differences(ours, ins, outs, [0], input_partials=True)
        assert bool(diffs) == (name != "max"), (name, diffs)
        check_rule(name, _reduce(name), [x, np.array([1], "int64")], [p, None], attrs, MESH)
    ours = _ours("softmax", [(4, 6)], [p], {"axis": -1}, MESH)
    ins, outs = paddle_infer("softmax", Spec((4, 6), p), -1)
    assert not nontrivial_differences(ours, ins, outs, [0], input_partials=True)
    assert str(ours.inputs[0]) == "[S(0),R]"


def test_readable_agreements():
    """Cases both rules answer alike: ``ab[S(0),S(1)] sum(axis=1) -> a[S(0),P(sum)]``; layer_norm
    ``abc[S(0),S(2)] -> x [S(0),R]``; embedding ids ``ab[S(0),R]``, table ``vh[R,S(1)] ->
    abh[S(0),S(2)]``; vocabulary-parallel embedding, table ``vh[S(0),R] -> abh[P(sum),R]``;
    class-split cross-entropy ``bc[S(0),S(1)] -> softmax [S(0),S(1)]``."""
    dist = DistAttr.parse("[S(0),S(1)]", MESH, 2)
    cases = [("sum", [(4, 6), (1,)], [dist, None], {"axis": [1], "keepdim": False}, [Spec((4, 6), dist), [1], False])]
    ln = DistAttr.parse("[S(0),S(2)]", MESH, 3)
    vec = DistAttr.replicated(MESH, 1)
    cases.append(
        (
            "layer_norm",
            [(4, 6, 8), (8,), (8,)],
            [ln, None, None],
            {"begin_norm_axis": 2, "epsilon": 1e-5},
            [Spec((4, 6, 8), ln), Spec((8,), vec), Spec((8,), vec), 1e-5, 2],
        )
    )
    ids, table = DistAttr.parse("[S(0),R]", MESH, 2), DistAttr.parse("[R,S(1)]", MESH, 2)
    cases.append(
        ("embedding", [(4, 6), (10, 8)], [ids, table], {}, [Spec((4, 6), ids), Spec((10, 8), table), -1, False])
    )
    whole, vocab = DistAttr.replicated(MESH, 2), DistAttr.parse("[S(0),R]", MESH, 2)
    cases.append(
        ("embedding", [(4, 6), (10, 8)], [whole, vocab], {}, [Spec((4, 6), whole), Spec((10, 8), vocab), -1, False])
    )
    ce = {"soft_label": False, "use_softmax": True, "numeric_stable_mode": True, "ignore_index": -100, "axis": -1}
    label = DistAttr.replicated(MESH, 2)
    cases.append(
        (
            "cross_entropy_with_softmax",
            [(8, 10), (8, 1)],
            [dist, label],
            ce,
            [Spec((8, 10), dist), Spec((8, 1), label), *(ce[k] for k in CE_ATTRS)],
        )
    )
    expected = ["[S(0),P(sum)]", "[S(0),R]", "[S(0),S(2)]", "[P(sum),R]", "[S(0),S(1)]"]
    for (op, shapes_, dists, attrs, paddle_args), want in zip(cases, expected):
        ours = _ours(op, shapes_, dists, attrs, MESH)
        ins, outs = paddle_infer(op, *paddle_args)
        assert str(ours.outputs[0]) == want == str(outs[0]), (op, str(ours.outputs[0]), str(outs[0]))
    assert str(ours.outputs[1]) == "[S(0),R]" == str(outs[1])  # the class-split loss: whole over mp


def test_readable_differences():
    """softmax ``ab[S(0),S(1)]`` over axis 1: Paddle gathers the axis (``[S(0),R]``), ours keeps
    it (``[S(0),S(1)]``: all_reduces of the row max and sum); a vocab-split table with a
    padding_idx: Paddle refuses, ours keeps the split (the padding row is one rank's)."""
    dist = DistAttr.parse("[S(0),S(1)]", MESH, 2)
    ours = _ours("softmax", [(4, 6)], [dist], {"axis": -1}, MESH)
    ins, outs = paddle_infer("softmax", Spec((4, 6), dist), -1)
    assert str(ours.outputs[0]) == "[S(0),S(1)]" and str(outs[0]) == "[S(0),R]"
    check_split_rule("softmax", eager(lambda t, axis: F.softmax(t, axis=axis)), [_rand((4, 6))], [dist], {"axis": -1}, MESH)
    table = DistAttr.parse("[S(0),R]", MESH, 2)
    ids = DistAttr.replicated(MESH, 2)
    ours = _ours("embedding", [(4, 6), (10, 8)], [ids, table], {"padding_idx": 3}, MESH)
    try:
        paddle_infer("embedding", Spec((4, 6), ids), Spec((10, 8), table), 3, False)
        raise AssertionError("Paddle accepted a vocabulary split with a padding_idx")
    except PADDLE_REFUSES:
        pass
    assert str(ours.outputs[0]) == "[P(sum),R]"
