"""passes/ring_attention.py (and passes/ring_blocks.py, its emission): each attention core of a
context-parallel program becomes a ring over the dim in every rank's program (stage:
comm-inserted -> ring-attention). Read from the plan and the rank programs the compile produces.
(Equal to serial: tests/equivalence/test_ring_attention.py, tests/property/test_ring_attention_property.py.)"""

import math

import paddle
import pytest
from pass_programs import count

import autopar
from autopar.passes.results import RingPlan

RING = autopar.Strategy(context_parallel=autopar.ContextParallel(dim="sep", method="ring"))


def _compile(cp, strategy=RING, seq=8, heads=2, head_dim=4):
    """x -> q, k, v -> one causal attention core -> mean(out ** 2), x split by sequence over sep."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh(list(range(cp)), ["sep"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, seq, 8], "float32")
        q, k, v = (
            paddle.static.nn.fc(x, heads * head_dim, num_flatten_dims=2).reshape([2, seq, heads, head_dim]).transpose([0, 2, 1, 3])
            for _ in range(3)
        )
        att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim)
        att = att + paddle.triu(paddle.full([seq, seq], float("-inf"), "float32"), diagonal=1)
        out = paddle.matmul(paddle.nn.functional.softmax(att, axis=-1), v)
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(out * out))
        autopar.shard_tensor(x, mesh, [autopar.Shard(1)])
    return autopar.compile(main, mesh, startup_program=startup, strategy=strategy)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_plan_has_one_ring_a_core_and_its_shifts(cp):
    dist = _compile(cp)
    (ring,) = dist.state.result(RingPlan).cores
    assert (ring.parts, ring.keys, ring.middle.coefficient) == (cp, 8, pytest.approx(0.5))
    assert [str(step.kind) for step in ring.shifts] == ["permute"] * 4 and {step.shift for step in ring.shifts} == {1}
    assert [v.shape for v in ring.values] == [(2, 2, 8, 8), (2, 2, 8, 16), (2, 2, 8, 8), (2, 2, 8, 8)]  # [k|v], [k|v|dk|dv], [dk|dv], again
    assert ring.unrepeated is None  # (no grouped-query attention here)
    assert ring.split_grads and ring.recomputed is None


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_program_holds_the_ring_and_no_serial_core(cp):
    dist = _compile(cp)
    for rank in range(cp):
        plan = dist.rank_plan(rank)
        assert "ring-attention" in plan.stages
        assert count(plan, "pd_op.softmax") == count(plan, "pd_op.softmax_grad") == 0  # the online softmax instead
        assert count(plan, "pd_op.matmul_grad") == 3  # the three projections'; the core's are ring matmuls
        kinds = [str(c.kind) for c in dist.comm_ops(rank)]
        assert kinds.count("permute") == (cp - 1) + cp and "all_gather" not in kinds and "reduce_scatter" not in kinds
        assert kinds.count("all_reduce") == 1  # the weights' gradients; dK, dV are the ring's blocks, not reduced
        # forward: cp blocks of q @ k^T and p @ v; backward: cp blocks of 5 matmuls
        assert count(plan, "pd_op.matmul") == 3 + 2 * cp + 5 * cp


def test_the_rank_program_after_reshard_emission_gathers_what_the_ring_replaces():
    dist = _compile(2)
    before = dist.rank_plan(0, after="reshard_emission")
    assert count(before, "pd_op.softmax") == 1 and count(before, "pd_op.all_gather") == 2  # K and V, the all_gather plan


def test_without_context_parallelism_the_pass_is_not_declared():
    assert "ring_attention" not in str(_compile(2, strategy=None).passes)
    assert "ring_gradients" not in str(_compile(2, strategy=None).passes)
    assert "ring_attention(mesh_dim='sep')" in str(_compile(2).passes)


def test_a_ring_over_a_dim_the_mesh_lacks_is_refused_by_name():
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel(dim="cp", method="ring"))
    with pytest.raises(autopar.AutoparError, match=r"ContextParallel\(dim='cp'\) names no dim of the mesh \(its dims: \['sep'\]\)"):
        _compile(2, strategy=strategy)


def test_check_compares_what_the_ring_keeps_with_serial():
    """``autopar.check`` reads each value in the placement its producer makes: the ring's output
    and dq as the serial ops made them; the core's scores and probabilities are gone, not compared."""
    from autopar.inspect.check import random_feeds

    dist = _compile(2)
    report = autopar.check(dist, random_feeds(dist, 1))
    assert "every value equals serial" in str(report)
