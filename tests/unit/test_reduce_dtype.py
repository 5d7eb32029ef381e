"""``Strategy(reduce_dtype=...)``: gradient reductions in the gradient's dtype (None) or in the
one asked for, cast there before the collective and back after; checked at the door, declared
on the pass that plans them, and seen in what the compile reports (bytes of the dtype moved,
the dtype printed, the step's price)."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.amp import Amp, amp_mlp


@pytest.mark.parametrize("value", ["bf16", "int8", "", 16, True])
def test_a_dtype_gradients_cannot_be_reduced_in_is_refused_by_name(value):
    with pytest.raises(AutoparError, match=rf"Strategy.reduce_dtype={value!r} is not a dtype gradients are reduced in"):
        autopar.Strategy(reduce_dtype=value)


def _o2_dp(**strategy):
    seed = amp_mlp(Amp("O2", optimizer="sgd"), widths=(8, 16, 4), batch=8)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))


def test_the_planning_pass_declares_it():
    _, dist = _o2_dp(reduce_dtype="float32")
    assert "reshard_planning(reduce_dtype='float32')" in str(dist.passes)
    _, default = _o2_dp()
    assert "reshard_planning()" in str(default.passes)


def test_float32_reduction_of_bfloat16_gradients_casts_up_before_and_down_after():
    """Each bf16 gradient is cast to float32 before the bucket's concat, the all_reduce moves
    float32 (4 bytes an element: twice the bf16 bucket's), and each piece is cast back to bf16
    before the ``sgd_`` that was built for a bf16 gradient."""
    _, dist = _o2_dp(reduce_dtype="float32")
    _, default = _o2_dp()
    (bucket,), (bf16_bucket,) = dist.comm_ops(0), default.comm_ops(0)
    assert (bucket.dtype, bf16_bucket.dtype) == ("float32", "bfloat16")
    numel = 8 * 16 + 16 + 16 * 4 + 4
    assert (bucket.bytes, bf16_bucket.bytes) == (4 * numel, 2 * numel)
    ops = list(dist.rank_plan(0).program.global_block().ops)
    concat = next(op for op in ops if op.name() == "pd_op.concat" and "f32" in str(op.result(0).type()))
    members = concat.operand_source(0).get_defining_op()  # builtin.combine of the flattened gradients
    for i in range(members.num_operands()):
        source = members.operand_source(i).get_defining_op()
        while source.name() == "pd_op.reshape":
            source = source.operand_source(0).get_defining_op()
        assert source.name() == "pd_op.cast" and str(source.operand_source(0).dtype) == "paddle.bfloat16"
    for update in [op for op in ops if op.name() == "pd_op.sgd_"]:
        grad = update.operand_source(2)
        assert str(grad.dtype) == "paddle.bfloat16"
        made = grad.get_defining_op()
        while made.name() == "pd_op.reshape":
            made = made.operand_source(0).get_defining_op()
        assert made.name() == "pd_op.cast" and str(made.operand_source(0).dtype) == "paddle.float32"


def test_what_the_compile_reports_is_the_dtype_moved():
    """The reshard table and the printed collectives name the dtype; the price counts its bytes."""
    _, dist = _o2_dp(reduce_dtype="float32", fuse_allreduce=False)
    _, default = _o2_dp(fuse_allreduce=False)
    gradients = [r for r in dist.decisions.reshards() if r.kinds == ("all_reduce",)]
    assert gradients and all(r.dtype == "float32" for r in gradients)
    assert all(r.dtype == "bfloat16" for r in default.decisions.reshards() if r.kinds == ("all_reduce",))
    assert "float32" in str(dist.decisions.reshards()) and "bfloat16" in str(default.decisions.reshards())
    assert all(", float32, " in str(c) for c in dist.comm_ops(0))
    assert all(", bfloat16, " in str(c) for c in default.comm_ops(0))
    from autopar.cli import collective_lines

    assert sum(" float32 " in line for line in collective_lines(dist)) == len(gradients)  # (autopar explain)
    assert dist.cost.comm_bytes == {rank: 2 * sent for rank, sent in default.cost.comm_bytes.items()}


@pytest.mark.parametrize("strategy", [{}, {"fuse_allreduce": False}, {"zero_stage": 2}, {"zero_stage": 2, "fuse_allreduce": False}])
def test_pricing_counts_the_casts(strategy):
    """What the rank programs hold beyond the serial program is what pricing counts (less the
    partition's rescaling of the mean, four ops: tests/unit/test_suggest_pricing.py), casts
    included: each op costs its launch on a host."""
    from autopar.pricing import added_ops

    seed, dist = _o2_dp(reduce_dtype="float32", **strategy)
    for rank in (0, 1):
        added = len(dist.rank_program(rank).global_block().ops) - len(seed.main.global_block().ops)
        assert sum(added_ops(dist.state, rank)) == added - 4, rank


def test_strategies_differing_in_it_share_an_analysis():
    """It changes what the passes plan, not the analysis: a compile from another strategy's
    analysis plans what a fresh compile plans."""
    seed, fresh = _o2_dp(reduce_dtype="float32")
    analysis = autopar.analyze(seed.main, fresh.mesh, seed.startup, autopar.Strategy())
    shared = autopar.compile(seed.main, fresh.mesh, seed.startup, autopar.Strategy(reduce_dtype="float32"), analysis=analysis)
    assert [str(c) for c in shared.comm_ops(0)] == [str(c) for c in fresh.comm_ops(0)]
    assert shared.comm_ops(0)[0].dtype == "float32"
