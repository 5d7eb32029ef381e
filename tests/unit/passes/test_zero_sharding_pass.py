"""passes/zero_sharding.py: ZeRO's plan, read from values (no run): where states, gradients and
parameters lie, which collectives move them and how many bytes, and the per-rank memory the
cost report predicts (stage: propagated -> zero-sharded, compile time; the buckets:
test_zero_fusion_pass.py)."""

import math

import pytest

import autopar
from autopar.cost_model.comm import coefficients
from autopar.errors import AutoparError
from autopar.testing.models import simple_net

SIZES = (16, 32, 16, 10)


def _compile(stage, optimizer="adam", mesh=None, fuse=False, sizes=SIZES):
    seed = simple_net(batch=8, sizes=sizes, optimizer=optimizer)
    mesh = mesh or autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    strategy = autopar.Strategy(zero_stage=stage, fuse_allreduce=fuse)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def _wire_bytes(dist, rank=0):
    """Bytes ``rank`` sends per step under the ring algorithms (what the cost model prices)."""
    return sum(coefficients(c.kind.value, len(c.group), c.bytes)[1] for c in dist.comm_ops(rank))


def _kinds(dist, rank=0):
    kinds = {}
    for c in dist.comm_ops(rank):
        kinds[c.kind.value] = kinds.get(c.kind.value, 0) + 1
    return kinds


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_states_are_split_over_dp(stage):
    seed, dist = _compile(stage)
    w1 = seed.layers["linear1"].weight.name
    moments = [n for n in dist.values.named("state") if n.startswith(w1) and "moment" in n]
    assert len(moments) == 2
    for name in moments:
        assert str(dist.dist_attr(name)) == "[S(0)]", name
    pows = [n for n in dist.values.named("state") if n.startswith(w1) and "pow" in n]
    assert pows and all(dist.dist_attr(n).is_replicated for n in pows)  # scalars stay whole
    assert dist.dist_attr(w1).is_replicated == (stage < 3)


def test_collectives_per_stage_and_their_volume_against_plain_data_parallel():
    params = 6  # simple_net's three weights and three biases
    _, plain = _compile(0)
    assert _kinds(plain) == {"all_reduce": params}
    _, one = _compile(1)
    assert _kinds(one) == {"reduce_scatter": params, "all_gather": params}  # the updated shards gathered back
    _, two = _compile(2)
    assert _kinds(two) == {"reduce_scatter": params, "all_gather": params}
    _, three = _compile(3)
    assert _kinds(three) == {"reduce_scatter": params, "all_gather": 2 * params}  # forward, and again in backward
    dp = _wire_bytes(plain)
    assert _wire_bytes(one) == pytest.approx(dp)  # reduce_scatter + all_gather = all_reduce
    assert _wire_bytes(two) == pytest.approx(dp)
    assert _wire_bytes(three) == pytest.approx(1.5 * dp)


def test_stage_one_reduces_gradients_at_the_update_stage_two_right_after_backward_makes_them():
    seed, one = _compile(1)
    w = seed.layers["linear1"].weight.name
    (at_update,) = [c for c in one.comm_ops(0) if c.kind == "reduce_scatter" and w in c.reason]
    assert at_update.reason.split(": ", 1)[1].startswith(
        "pd_op.adam_#"
    )  # the whole gradient lives until the update reads it
    seed, two = _compile(2)
    w = seed.layers["linear1"].weight.name
    (early,) = [c for c in two.comm_ops(0) if c.kind == "reduce_scatter" and w in c.reason]
    assert early.reason.startswith("ZeRO-2 gradient sync in Linear") and f": grad({w}) %" in early.reason
    assert "right after pd_op.matmul_grad#" in early.reason


def test_stage_three_gathers_each_parameter_once_per_phase():
    seed, dist = _compile(3)
    w = seed.layers["linear2"].weight.name
    gathers = [c for c in dist.comm_ops(0) if c.kind == "all_gather" and c.value == w]
    assert len(gathers) == 2
    assert "pd_op.matmul#" in gathers[0].reason and "pd_op.matmul_grad#" in gathers[1].reason


def test_write_back_reasons_name_the_parameter():
    seed, dist = _compile(2)
    w = seed.layers["linear1"].weight.name
    (gather,) = [c for c in dist.comm_ops(0) if c.kind == "all_gather" and w in c.reason]
    assert (
        gather.reason.startswith("ZeRO parameter gather in Linear")
        and f"shard of {w}; gathered back into {w}" in gather.reason
    )


def test_memory_follows_the_zero_table():
    """Bytes of parameters, gradients and states (the cost report) against the ZeRO paper's
    table, with Psi parameters and K = 8 (Adam's two fp32 moments): summed over the ranks, a
    whole tensor counts n times and a sharded one once (shards may be uneven: 10 over 4)."""
    n = 4
    mesh = autopar.ProcessMesh(list(range(n)), ["dp"])
    psi = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    scalars = 4 * (2 * 2 * (len(SIZES) - 1) + 1)  # beta1/beta2 powers of each of the 6 parameters, the lr: whole
    want = {0: (4 * psi * n, 4 * psi * n, 8 * psi * n), 1: (4 * psi * n, 4 * psi * n, 8 * psi),
            2: (4 * psi * n, 4 * psi, 8 * psi), 3: (4 * psi, 4 * psi, 8 * psi)}  # fmt: skip
    for stage, (params, grads, states) in want.items():
        _, dist = _compile(stage, mesh=mesh)
        memory = [r.memory for r in dist.cost.ranks]
        assert sum(m.parameters for m in memory) == params, stage
        assert sum(m.gradients for m in memory) == grads, stage
        assert sum(m.optimizer_states for m in memory) == states + scalars * n, stage


def test_parameters_too_small_to_split_stay_whole_and_say_why():
    seed, dist = _compile(3, mesh=autopar.ProcessMesh(list(range(4)), ["dp"]), sizes=(16, 3, 10))
    small = {str(z.label): z for z in dist.state.zero}
    bias = seed.layers["linear1"].bias.name
    assert small[bias].sharded is None and "no dim with 4 elements" in small[bias].reason
    assert dist.dist_attr(bias).is_replicated
    assert not math.isnan(dist.cost.ranks[0].memory.parameters)


def test_zero_needs_an_update_and_a_data_parallel_dim():
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 3], "float32")
        paddle.nn.Linear(3, 2)(x).mean()
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    with pytest.raises(AutoparError, match="no optimizer update"):
        autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(zero_stage=1))
    seed = simple_net(batch=8, sizes=SIZES)
    grid = autopar.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    with pytest.raises(AutoparError, match="which dim of .* is data parallel"):
        autopar.compile(seed.main, grid, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=2))


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_derives_its_placements_and_leaves_the_analysis_as_it_was(stage):
    """ZeRO's shard placements and reshards are a new value derived from the analysis, which
    stays as it was (for another strategy to derive from)."""
    from autopar.analysis import analyze_state
    from autopar.compile_plan import passes_for
    from autopar.passes.base import PassPipeline

    seed = simple_net(batch=8, sizes=SIZES, optimizer="adam")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    zero = autopar.Strategy(zero_stage=stage)
    state = analyze_state(seed.main, mesh, seed.startup, zero)
    analysis = state.propagation
    before = (dict(analysis.states), analysis.reshards, dict(analysis.op_results))
    PassPipeline(tuple(passes_for(zero))).plan(state)
    assert state.propagation is not analysis and state.zero
    assert state.propagation.base is analysis and state.analysed.propagation is analysis
    assert (dict(analysis.states), analysis.reshards, dict(analysis.op_results)) == before
    assert any(s.dist != analysis.states[k].dist for k, s in state.propagation.states.items())  # the derived value differs


def test_zero_sharding_plans_at_compile_and_runs_only_when_asked():
    from pass_programs import around, declared

    _, dist = _compile(2, fuse=True)
    sharding = declared(dist, "zero_sharding")
    assert not sharding.per_rank and sharding.plan_ensures == "zero-sharded"
    assert "zero-sharded" in declared(dist, "zero_bucket_fusion").plan_requires
    before, after = around(dist, "zero_sharding")  # nothing per rank: the placements changed at compile
    assert after.stages == before.stages and after.collectives == before.collectives == ()
    _, plain = _compile(0)
    assert "zero_sharding" not in plain.passes.names()
