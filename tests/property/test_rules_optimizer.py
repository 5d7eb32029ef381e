"""Optimizer update rules (sgd_, momentum_, adam_, adamw_) checked numerically with Paddle's
own eager kernels (``paddle._C_ops.*_``): every rank updates its piece of the parameter and
states, the pieces must equal the same slices of the full update. Operands mirror the PIR
ops (built by ``optimizer.minimize``); beta1 / beta2 / epsilon are ``[1]`` operands there.
"""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, dist_attrs, dygraph, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed, positive=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype("float32")
    return np.abs(x) + 0.1 if positive else x


def _t(a):
    return None if a is None else paddle.to_tensor(a)


def _numpy(outs):
    return [np.zeros((), "float32") if o is None else o.numpy() for o in outs]


def sgd(inputs, attrs):
    with dygraph():
        p, lr, g, mp = map(_t, inputs)
        out = paddle._C_ops.sgd_(p, lr, g, mp, False)
        outs = list(out) if isinstance(out, (list, tuple)) else [out, None]
        return _numpy(outs[:1] + [None])


def momentum(inputs, attrs):
    with dygraph():
        p, g, v, lr, mp = map(_t, inputs)
        a = attrs
        out = paddle._C_ops.momentum_(
            p,
            g,
            v,
            lr,
            mp,
            a["mu"],
            a["use_nesterov"],
            a["regularization_method"],
            a["regularization_coeff"],
            False,
            1.0,
        )
        return _numpy(list(out)[:2] + [None])


def adam_like(name):
    def run(inputs, attrs):
        with dygraph():
            p, g, lr, m1, m2, m2max, b1p, b2p, mp, skip = map(_t, inputs[:10])
            b1, b2, eps = (float(v[0]) for v in inputs[10:])
            extra = (attrs["lr_ratio"], attrs["coeff"], attrs["with_decay"]) if name == "adamw_" else ()
            out = getattr(paddle._C_ops, name)(
                p, g, lr, m1, m2, m2max, b1p, b2p, mp, skip, b1, b2, eps, *extra, False, 1000, False, False, False
            )
            outs = list(out)
            outs[3] = outs[6] = None  # moment2_max_out, master_param_out: absent operands
            return _numpy(outs)

    return run


@st.composite
def param_dists(draw, mesh, ndim):
    """Placements of (param, grad, state): param maybe unknown, grad maybe partial."""
    return (
        draw(maybe_dist_attrs(mesh, ndim)),
        draw(maybe_dist_attrs(mesh, ndim, partial=True)),
        draw(maybe_dist_attrs(mesh, ndim)),
    )


def _scalars():
    return np.array(0.1, "float32"), np.array([0.9], "float32"), np.array([0.99], "float32")


@given(meshes(), shapes(1, 3), st.data())
def test_sgd(mesh, shape, data):
    p, g = _rand(shape, 0), _rand(shape, 1)
    lr = np.array(0.1, "float32")
    dp, dg, _ = data.draw(param_dists(mesh, len(shape)))
    check = check_rule("sgd_", sgd, [p, lr, g, None], [dp, None, dg, None], {"multi_precision": False}, mesh)
    _assert_param_decides(check.result, dp, dg, [0, 2])


@given(meshes(), shapes(1, 3), st.data())
def test_momentum(mesh, shape, data):
    p, g, v = _rand(shape, 0), _rand(shape, 1), _rand(shape, 2)
    lr = np.array(0.1, "float32")
    attrs = {
        "mu": 0.9,
        "use_nesterov": data.draw(st.booleans()),
        "regularization_method": "l2_decay",
        "regularization_coeff": 1e-2,
        "multi_precision": False,
        "rescale_grad": 1.0,
    }
    dp, dg, dv = data.draw(param_dists(mesh, len(shape)))
    check = check_rule("momentum_", momentum, [p, g, v, lr, None], [dp, dg, dv, None, None], attrs, mesh)
    _assert_param_decides(check.result, dp, dg, [0, 1, 2])
    out = data.draw(dist_attrs(mesh, len(shape)))
    check_rule("momentum_", momentum, [p, g, v, lr, None], [None] * 5, attrs, mesh, backward=[out, None, None])


@given(meshes(), shapes(1, 3), st.sampled_from(["adam_", "adamw_"]), st.data())
def test_adam_adamw(mesh, shape, name, data):
    p, g, m1, m2 = _rand(shape, 0), _rand(shape, 1), _rand(shape, 2), _rand(shape, 3, positive=True)
    lr, b1, b2 = _scalars()
    b1p, b2p, eps = np.array([0.9**3], "float32"), np.array([0.99**3], "float32"), np.array([1e-8], "float32")
    inputs = [p, g, lr, m1, m2, None, b1p, b2p, None, None, b1, b2, eps]
    attrs = {
        "lr_ratio": 1.0,
        "coeff": 0.01,
        "with_decay": True,
        "lazy_mode": False,
        "multi_precision": False,
        "amsgrad": False,
    }
    dp, dg, dm = data.draw(param_dists(mesh, len(shape)))
    dists = [
        dp,
        dg,
        None,
        dm,
        data.draw(maybe_dist_attrs(mesh, len(shape))),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    check = check_rule(name, adam_like(name), inputs, dists, attrs, mesh)
    _assert_param_decides(check.result, dp, dg, [0, 1, 3, 4])
    assert check.result.outputs[3] is None and check.result.outputs[6] is None
    assert check.result.outputs[4].is_replicated and check.result.inputs[2].is_replicated


def _assert_param_decides(result, dp, dg, like_param):
    want = dp.mapping if dp is not None else (dg.mapping if dg is not None else None)
    for i in like_param:
        assert not result.inputs[i].partial  # a partial grad is reduced by the planner
        if want is not None:
            assert result.inputs[i].mapping == want


# ---- readable cases -----------------------------------------------------------------------

MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def test_zero_style_split_param_partial_grad():
    """p[S(0),R], g[P(sum),R] -> g required [S(0),R]: the planner's reduce_scatter."""
    p = TensorSpec((8, 4), DistAttr.parse("[S(0),R]", MESH, 2))
    g = TensorSpec((8, 4), DistAttr.parse("[P(sum),R]", MESH, 2))
    lr = TensorSpec(())
    result = get_rule("sgd_").infer_forward([p, lr, g, None], {}, RuleContext(MESH))
    assert [str(d) if d else None for d in result.inputs] == ["[S(0),R]", "[R,R]", "[S(0),R]", None]
    assert [str(d) if d else None for d in result.outputs] == ["[S(0),R]", None]


def test_unknown_param_takes_grad_split_without_partial():
    g = TensorSpec((8, 4), DistAttr.parse("[P(sum),S(1)]", MESH, 2))
    result = get_rule("momentum_").infer_forward(
        [TensorSpec((8, 4)), g, TensorSpec((8, 4)), TensorSpec(()), None], {}, RuleContext(MESH)
    )
    assert str(result.outputs[0]) == "[R,S(1)]" and str(result.inputs[1]) == "[R,S(1)]"
