"""The fused Llama ops checked numerically (hypothesis): swiglu and fused_rms_norm_quant
against Paddle's CPU kernels (fused_rms_norm's where it runs: it dies of SIGILL on CPUs without
AVX-512, where a numpy reference of it stands in); rms_norm, fused_rotary_position_embedding and flash_attn (no CPU
kernel in Paddle 3.3.1: they do not even build on CPU) and the grads against numpy references
of the kernels. A reference computes each (batch, head) on its own, as the kernels do, so
the checks say which splits the rules may keep, not how Paddle rounds."""

import functools
import math
import subprocess
import sys

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, eager_grad, maybe_dist_attrs, meshes, shapes

EPS = 1e-6


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# ---- swiglu -------------------------------------------------------------------------------


@given(meshes(), shapes(1, 3, min_side=2, max_side=6), st.booleans(), st.data())
def test_swiglu_and_grad(mesh, shape, two_inputs, data):
    shape = shape[:-1] + (2 * (shape[-1] // 2),)
    x, y = _rand(shape), (_rand(shape, 1) if two_inputs else None)
    swiglu = eager(lambda *t: paddle.nn.functional.swiglu(*t))
    inputs = [x, y] if two_inputs else [x]
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)), data.draw(maybe_dist_attrs(mesh, len(shape))) if two_inputs else None]
    check = check_rule("swiglu", lambda ins, a: swiglu([t for t in ins if t is not None], a), [x, y], dists, {}, mesh)
    assert two_inputs or not check.result.inputs[0].mapping[-1]  # x holds both halves
    out = swiglu(inputs, {})[0]
    g = _rand(out.shape, 2)
    grad = eager_grad(lambda *t: paddle.nn.functional.swiglu(*t), [0, 1] if two_inputs else [0])

    def grads(ins, attrs):  # (x, y, out_grad) -> (x_grad, y_grad)
        got = grad([t for t in ins if t is not None], attrs)
        return got if two_inputs else got + [np.zeros(0, "float32")]

    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))), dists[1], data.draw(maybe_dist_attrs(mesh, len(shape), partial=True))]
    check_rule("swiglu_grad", grads, [x, y, g], dists, {}, mesh)


def test_swiglu_of_one_tensor_gathers_its_halves():
    """``swiglu(x)`` splits x's last dim into halves itself: a rank holding columns of x would
    pair the wrong halves, so a column split of x is undone (and checked numerically)."""
    mesh = ProcessMesh([0, 1], ["mp"])
    x = _rand((3, 8))
    swiglu = eager(lambda t: paddle.nn.functional.swiglu(t))
    check = check_rule("swiglu", lambda ins, a: swiglu(ins[:1], a), [x, None], [DistAttr(mesh, [(), (0,)]), None], {}, mesh)
    assert check.result.inputs[0].is_replicated


# ---- rms_norm -----------------------------------------------------------------------------


def _rms(x, count):
    axes = tuple(range(x.ndim - count, x.ndim))
    return 1.0 / np.sqrt((x.astype("float64") ** 2).mean(axis=axes, keepdims=True) + EPS)


def rms_norm(inputs, attrs):
    """(x, scale) -> (out, invvar): invvar over the leading dims."""
    x, scale = inputs
    count = len(attrs["normalized_shape"])
    inv = _rms(x, count)
    out = x * inv * (1.0 if scale is None else scale)
    return [out.astype("float32"), inv.reshape(x.shape[: x.ndim - count]).astype("float32")]


def _rms_norm_paddle(x, scale, normalized_shape, epsilon):
    axes = list(range(x.ndim - len(normalized_shape), x.ndim))
    return x * paddle.rsqrt((x * x).mean(axis=axes, keepdim=True) + epsilon) * scale


@st.composite
def rms_norm_cases(draw):
    shape = draw(shapes(2, 3, max_side=5))
    count = draw(st.integers(1, len(shape) - 1))
    return _rand(shape), _rand(shape[len(shape) - count :], 1), {"normalized_shape": list(shape[len(shape) - count :]), "epsilon": EPS}


@given(meshes(), rms_norm_cases(), st.data())
def test_rms_norm_and_grad(mesh, case, data):
    x, scale, attrs = case
    lead = x.ndim - len(attrs["normalized_shape"])
    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True)), data.draw(maybe_dist_attrs(mesh, scale.ndim))]
    check = check_rule("rms_norm", rms_norm, [x, scale], dists, attrs, mesh)
    assert not any(check.result.inputs[0].mapping[lead:]) and not check.result.inputs[0].partial
    invvar = rms_norm([x, scale], attrs)[1]
    g = _rand(x.shape, 2)
    grad = eager_grad(_rms_norm_paddle, [0, 1])

    def grads(ins, a):  # (x, scale, invvar, out_grad) -> (x_grad, scale_grad)
        return grad([ins[0], ins[1], ins[3]], a)

    dists = [data.draw(maybe_dist_attrs(mesh, x.ndim)), None, data.draw(maybe_dist_attrs(mesh, invvar.ndim)), data.draw(maybe_dist_attrs(mesh, x.ndim, partial=True))]
    check = check_rule("rms_norm_grad", grads, [x, scale, invvar, g], dists, attrs, mesh, rtol=1e-3, atol=1e-3)
    split = {d for dims in check.result.inputs[0].mapping[:lead] for d in dims}
    assert set(check.result.outputs[1].partial_dims) >= split  # the scale gradient sums over the rows


@given(meshes(), shapes(2, 3, max_side=5), st.booleans(), st.booleans(), st.data())
def test_fused_rms_norm_quant(mesh, shape, with_bias, with_residual, data):
    """``paddle.incubate.nn.functional.fused_rms_norm`` on CPU (forward only). Its kernel adds
    the first row's worth of ``bias`` to every row (only with a residual): a bias of x's shape
    split with x would add each rank's own first row."""
    from paddle.incubate.nn.functional import fused_rms_norm

    begin = data.draw(st.integers(1, len(shape) - 1))
    norm = (math.prod(shape[begin:]),)
    x, weight, norm_bias = _rand(shape), _rand(norm, 1), _rand(norm, 2)
    bias = _rand(shape, 3) if with_bias else None
    residual = _rand(shape, 4) if with_residual else None
    attrs = {"begin_norm_axis": begin, "epsilon": EPS, "quant_scale": -1.0}

    def fused(inputs, attrs):  # (x, bias, residual, norm_weight, norm_bias) -> (out, residual_out, inv_var)
        begin = attrs["begin_norm_axis"]
        if _fused_rms_norm_runs():
            with paddle.base.dygraph.guard():
                t = [None if a is None else paddle.to_tensor(a) for a in inputs]
                out, h = fused_rms_norm(t[0], t[3], t[4], EPS, begin, bias=t[1], residual=t[2])
                out, h = out.numpy(), h.numpy()
        else:
            out, h = _fused_rms_norm_reference(*inputs, begin)
        h = h if inputs[2] is not None else inputs[0]  # the kernel adds bias only with a residual
        rows = h.reshape(h.shape[:begin] + (-1,))
        inv = 1.0 / np.sqrt((rows.astype("float64") ** 2).mean(-1) + EPS)
        return [out, h, inv.astype("float32")]

    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))) for _ in range(3)] + [None, None]
    check = check_rule("fused_rms_norm_quant", fused, [x, bias, residual, weight, norm_bias], dists, attrs, mesh, rtol=1e-3, atol=1e-3)
    assert not any(check.result.inputs[0].mapping[begin:])
    assert (check.result.outputs[1] is None) == (residual is None)


@functools.cache
def _fused_rms_norm_runs() -> bool:
    """Whether Paddle's CPU fused_rms_norm kernel runs on this CPU (measured: it dies of SIGILL
    on CPUs without AVX-512, e.g. an AMD EPYC with AVX2 only): probed in a child process."""
    probe = (
        "import numpy as np, paddle\n"
        "from paddle.incubate.nn.functional import fused_rms_norm\n"
        "t = paddle.to_tensor(np.ones((2, 4), 'float32'))\n"
        "fused_rms_norm(t, paddle.ones([4]), paddle.zeros([4]), 1e-6, 1, residual=t)\n"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode == 0


def _fused_rms_norm_reference(x, bias, residual, weight, norm_bias, begin):
    """numpy's fused_rms_norm as the CPU kernel computes it where it cannot run: with a residual,
    ``h = x + residual + bias``'s first row (the kernel adds the first row's worth of ``bias`` to
    every row), else ``h = x``; ``out = h / rms(h) * weight + norm_bias`` over the dims from ``begin``."""
    h = x.astype("float64")
    if residual is not None:
        h = h + residual
        if bias is not None:
            h = h + bias.reshape(-1)[: math.prod(x.shape[begin:])].reshape(x.shape[begin:])
    rows = h.reshape(x.shape[:begin] + (-1,))
    normed = rows / np.sqrt((rows**2).mean(-1, keepdims=True) + EPS) * weight + norm_bias
    return normed.reshape(x.shape).astype("float32"), h.astype("float32")


# ---- rotary position embedding -----------------------------------------------------------


def _rotate(x, neox):
    if neox:
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], -1)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    return out


def _tables(sin, cos, position_ids, like):
    """sin / cos per [batch, seq, 1, dim] (gathered by position_ids when given)."""
    if position_ids is not None:
        return sin[0, :, 0][position_ids][:, :, None], cos[0, :, 0][position_ids][:, :, None]
    seq = like.shape[1]
    return sin[:, :seq], cos[:, :seq]


def rope(inputs, attrs):
    """(q, k, v, sin, cos, position_ids) -> (out_q, out_k, out_v), q [batch, seq, heads, dim]."""
    q, k, v, sin, cos, position_ids = inputs
    s, c = _tables(sin, cos, position_ids, q)
    neox = attrs["use_neox_rotary_style"]
    return [None if t is None else (t * c + _rotate(t, neox) * s).astype("float32") for t in (q, k, v)]


def rope_grad(inputs, attrs):
    """(sin, cos, position_ids, out_q_grad, out_k_grad, out_v_grad) -> (q_grad, k_grad, v_grad):
    the rotation's transpose."""
    sin, cos, position_ids, *grads = inputs
    s, c = _tables(sin, cos, position_ids, grads[0])
    neox = attrs["use_neox_rotary_style"]
    return [None if g is None else (g * c - _rotate(g * s, neox)).astype("float32") for g in grads]


@st.composite
def rope_cases(draw):
    batch, seq, heads, dim = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4)), 2 * draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([heads, 1]))
    q, k = _rand((batch, seq, heads, dim)), _rand((batch, seq, kv_heads, dim), 1)
    v = _rand((batch, seq, kv_heads, dim), 2) if draw(st.booleans()) else None
    by_ids = draw(st.booleans())
    angles = _rand((1, seq + 2 if by_ids else seq, 1, dim), 3)  # a longer table is read through position ids
    position_ids = np.random.default_rng(4).integers(0, seq + 2, (batch, seq)).astype("int64") if by_ids else None
    return [q, k, v, np.sin(angles), np.cos(angles), position_ids]


@given(meshes(), rope_cases(), st.booleans(), st.data())
def test_fused_rope_and_grad(mesh, case, neox, data):
    attrs = {"use_neox_rotary_style": neox, "time_major": False, "rotary_emb_base": 10000.0}
    dists = [None if t is None else data.draw(maybe_dist_attrs(mesh, t.ndim)) for t in case]
    check = check_rule("fused_rotary_position_embedding", rope, case, dists, attrs, mesh)
    q_attr, sin_attr, ids_attr = check.result.inputs[0], check.result.inputs[3], check.result.inputs[5]
    assert not q_attr.mapping[3]  # head_dim whole
    if q_attr.mapping[1]:  # a sequence split reads the tables' rows (or the ids) split alike
        assert (ids_attr.mapping[1] if ids_attr is not None else sin_attr.mapping[1]) == q_attr.mapping[1]
    grads = [None if t is None else _rand(t.shape, 5 + i) for i, t in enumerate(case[:3])]
    inputs = [*case[3:], *grads]
    dists = [None if t is None else data.draw(maybe_dist_attrs(mesh, t.ndim, partial=i >= 3)) for i, t in enumerate(inputs)]
    check_rule("fused_rotary_position_embedding_grad", rope_grad, inputs, dists, attrs, mesh)


def test_time_major_rope_splits_its_batch_at_dim_one():
    mesh = ProcessMesh([0, 1], ["dp"])
    q = TensorSpec((8, 4, 2, 6), DistAttr(mesh, [(), (0,), (), ()]))
    result = get_rule("fused_rotary_position_embedding").infer_forward([q, None, None, None, None, None], {"time_major": True}, RuleContext(mesh))
    assert str(result.outputs[0]) == "[S(1)]"


def test_rope_without_tables_keeps_the_sequence_whole():
    """Without sin / cos the kernel computes the angles from the local sequence index."""
    mesh = ProcessMesh([0, 1], ["sp"])
    q = TensorSpec((2, 8, 2, 6), DistAttr(mesh, [(), (0,), (), ()]))
    result = get_rule("fused_rotary_position_embedding").infer_forward([q, None, None, None, None, None], {}, RuleContext(mesh))
    assert result.outputs[0].is_replicated


# ---- flash attention ---------------------------------------------------------------------


def _round(n):
    return (n + 127) // 128 * 128


def _attention(q, k, v, mask, causal):
    """Probabilities [b, h, sq, sk] and log-sum-exp [b, h, sq]; grouped key heads repeated."""
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bihd,bjhd->bhij", q.astype("float64"), kk) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    if causal:
        sq, sk = scores.shape[-2:]
        scores = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + sk - sq, -np.inf, scores)
    top = scores.max(-1, keepdims=True)
    lse = top + np.log(np.exp(scores - top).sum(-1, keepdims=True))
    return np.exp(scores - lse), lse[..., 0], kk, vv, group


def flash_attn(inputs, attrs):
    """(q, k, v, fixed_seed_offset, attn_mask) -> (out, softmax, softmax_lse, seed_offset)."""
    q, k, v, _, mask = inputs
    probs, lse, _, vv, _ = _attention(q, k, v, mask, attrs["causal"])
    out = np.einsum("bhij,bjhd->bihd", probs, vv)
    b, h, sq, sk = probs.shape
    softmax = np.zeros((b, h, _round(sq), _round(sk)), "float32")
    softmax[:, :, :sq, :sk] = probs
    return [out.astype("float32"), softmax, lse.astype("float32"), np.array([7, 3], "int64")]  # a seed pair is not a sum


def flash_attn_grad(inputs, attrs):
    """(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad) -> (q_grad, k_grad, v_grad)."""
    q, k, v, out, _, _, mask, g = inputs
    probs, _, kk, vv, group = _attention(q, k, v, mask, attrs["causal"])
    g = g.astype("float64")
    dv = np.einsum("bhij,bihd->bjhd", probs, g)
    dp = np.einsum("bihd,bjhd->bhij", g, vv)
    ds = probs * (dp - (dp * probs).sum(-1, keepdims=True)) / math.sqrt(q.shape[-1])
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q)

    def fold(t):  # sum the repeated key heads back into their group
        return t.reshape(t.shape[:2] + (k.shape[2], group) + t.shape[3:]).sum(3)

    return [dq.astype("float32"), fold(dk).astype("float32"), fold(dv).astype("float32")]


@st.composite
def attention_cases(draw):
    batch, sq, heads, dim = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    sk = draw(st.sampled_from([sq, sq + 1]))
    kv_heads = draw(st.sampled_from([heads, 1]))
    q, k, v = _rand((batch, sq, heads, dim)), _rand((batch, sk, kv_heads, dim), 1), _rand((batch, sk, kv_heads, dim), 2)
    mask_shape = draw(st.sampled_from([None, (1, 1, sq, sk), (batch, 1, sq, sk), (batch, heads, sq, sk)]))
    mask = None if mask_shape is None else np.where(np.random.default_rng(3).random(mask_shape) > 0.8, -1e4, 0.0).astype("float32")
    return [q, k, v, None, mask]


@given(meshes(), attention_cases(), st.booleans(), st.data())
def test_flash_attn_and_grad(mesh, case, causal, data):
    attrs = {"dropout": 0.0, "causal": causal, "return_softmax": False, "is_test": False, "rng_name": ""}
    dists = [None if t is None else data.draw(maybe_dist_attrs(mesh, t.ndim)) for t in case]
    check = check_rule("flash_attn", flash_attn, case, dists, attrs, mesh, rtol=1e-3, atol=1e-4)
    assert not check.result.inputs[0].mapping[1] and not check.result.inputs[1].mapping[1]  # sequences whole
    out, _, lse, seed = flash_attn(case, attrs)
    g = _rand(out.shape, 4)
    inputs = [case[0], case[1], case[2], out, lse, seed, case[4], g]
    dists = [None if t is None else data.draw(maybe_dist_attrs(mesh, t.ndim, partial=i == 7)) for i, t in enumerate(inputs)]
    check_rule("flash_attn_grad", flash_attn_grad, inputs, dists, {"dropout": 0.0, "causal": causal}, mesh, rtol=1e-3, atol=1e-4)


def test_flash_attn_with_a_training_dropout_runs_whole():
    """Each rank would draw its dropout mask over its own shape: no split equals serial."""
    mesh = ProcessMesh([0, 1], ["dp"])
    q = TensorSpec((4, 8, 2, 16), DistAttr(mesh, [(0,), (), (), ()]))
    rule = get_rule("flash_attn")
    training = rule.infer_forward([q, q, q, None, None], {"dropout": 0.1, "is_test": False}, RuleContext(mesh))
    assert all(d is None or d.is_replicated for d in (*training.inputs, *training.outputs))
    inference = rule.infer_forward([q, q, q, None, None], {"dropout": 0.1, "is_test": True}, RuleContext(mesh))
    assert str(inference.outputs[0]) == "[S(0)]" and str(inference.outputs[2]) == "[S(0)]"
