"""Differential test of topk against Paddle's rule (accuracy, fills and optimizer updates
have no Paddle SPMD rule in 3.3.1: ``get_phi_spmd_rule`` raises NotFound for accuracy,
full_like, full, sgd_, momentum_, adam_, adamw_, pool2d; they are checked numerically only).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from paddle_oracle import Spec, differences, paddle_dists, paddle_infer
from test_rules_metrics_fill import _rand, topk, topk_cases

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, meshes


@given(meshes(), topk_cases(), st.data())
def test_topk_vs_paddle(mesh, case, data):
    shape, attrs = case
    dist = data.draw(paddle_dists(mesh, len(shape)))
    ours = get_rule("topk").infer_forward(
        [TensorSpec(shape, dist), TensorSpec((1,), None, "int32")], attrs, RuleContext(mesh)
    )
    ins, outs = paddle_infer(
        "topk", Spec(shape, dist), int(attrs["k"]), attrs["axis"], attrs["largest"], attrs["sorted"]
    )
    if differences(ours, ins, outs, [0]):
        import numpy as np

        k = np.array([int(attrs["k"])], "int32")
        check_rule("topk", eager(topk), [_rand(shape), k], [dist, None], attrs, mesh)
        assert any(dist.mapping[i] and s % mesh.shape[dist.mapping[i][0]] for i, s in enumerate(shape))


@pytest.mark.parametrize("name", ["accuracy", "full_like", "full", "sgd_", "momentum_", "adam_", "adamw_", "pool2d"])
def test_paddle_has_no_rule(name):
    """If Paddle gains a rule for one of these, add a differential test for it."""
    from paddle.base import core

    with pytest.raises(Exception, match="not registered"):
        core.get_phi_spmd_rule(name)
