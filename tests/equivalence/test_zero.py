"""ZeRO 1 / 2 / 3 equal serial in the simulator: losses every step and parameters after 3
steps (rtol 1e-5, fp32), over dp=2 and dp=4, with uneven shards, the four optimizers, L2 decay
and global-norm clipping, beside tensor parallelism, and on an unseeded user program."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.testing.models import annotate_megatron, gpt_block_program, simple_net
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import random_feeds, run_serial

STEPS = 3


def assert_equal_to_serial(main, startup, feeds, loss, dist, rtol=1e-5, atol=1e-6):
    start = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [loss])
    paddle.set_rng_state(start)  # the serial start-up draws from the state the ranks drew from
    serial = run_serial(main, startup, feeds, [loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, err_msg=f"loss at step {step}")
    assert serial.parameters.keys() == result.parameters.keys()
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)


def _dp(stage, optimizer, ranks, sizes=(16, 32, 16, 10)):
    seed = simple_net(batch=8, sizes=sizes, optimizer=optimizer)
    mesh = autopar.ProcessMesh(list(range(ranks)), ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=stage))
    return seed, dist


@pytest.mark.parametrize("ranks", [2, 4], ids=["dp2", "dp4"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])  # momentum: with L2 decay
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_serial(stage, optimizer, ranks):
    seed, dist = _dp(stage, optimizer, ranks)
    assert all(z.sharded is not None for z in dist.state.zero)
    feeds = random_feeds(seed.feeds, STEPS, classes=10)
    assert_equal_to_serial(seed.main, seed.startup, feeds, seed.loss, dist)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_uneven_shards_over_three_ranks(stage, optimizer):
    seed, dist = _dp(stage, optimizer, 3, sizes=(16, 33, 16, 10))
    assert {str(z.sharded) for z in dist.state.zero} == {"[S(0)]", "[S(1)]"}  # 33 and 10 over 3 are uneven
    feeds = random_feeds(seed.feeds, STEPS, classes=10)
    assert_equal_to_serial(seed.main, seed.startup, feeds, seed.loss, dist)


@pytest.mark.parametrize("stage", [1, 2])
def test_bucketed_shards_cost_few_ops(stage):
    """Shards that are equal blocks of a parameter's first dim are laid out in a ZeRO bucket by
    one reshape each, not cut apart (every op costs its launch on a host backend): the rank
    program holds at most 12 ops per parameter more than plain dp (the cut-apart layout: 30)."""
    seed, plain = _dp(0, "adam", 2)
    _, zero = _dp(stage, "adam", 2)
    assert len(zero.state.zero_buckets) == 2  # one reduce_scatter bucket, one all_gather bucket
    params = len(zero.state.zero)
    ops = [len(d.rank_program(0).global_block().ops) for d in (plain, zero)]
    assert ops[1] - ops[0] <= 12 * params, ops


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_beside_tensor_parallel_on_four_ranks(stage):
    """Megatron GPT blocks on dp=2 x mp=2: each weight's dp shard nests inside its mp split."""
    seed = gpt_block_program(batch=2, seq=4, hidden=16, heads=2, vocab=24, layers=2, optimizer="momentum")
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    annotate_megatron(seed, mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=stage))
    qkv = {z.label: z for z in dist.state.zero}[seed.layers["qkv0"].weight.name]
    assert str(qkv.whole) == "[R,S(1)]" and str(qkv.sharded) == "[S(0),S(1)]"
    feeds = random_feeds(seed.feeds, STEPS, classes=24)
    # the same tolerance as plain dp x mp on this model (tests/equivalence/test_simulator.py)
    assert_equal_to_serial(seed.main, seed.startup, feeds, seed.loss, dist, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unseeded_user_program_with_global_norm_clipping(stage):
    """Written as a user would: no random_seed, odd sizes, tanh, Adam with ClipGradByGlobalNorm."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [6, 7], "float32")
        label = paddle.static.data("label", [6, 1], "int64")
        hidden = paddle.tanh(paddle.nn.Linear(7, 5)(x))
        loss = paddle.nn.functional.cross_entropy(paddle.nn.Linear(5, 3)(hidden), label).mean()
        paddle.optimizer.Adam(0.05, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5)).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1, 2], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(zero_stage=stage))
    feeds = random_feeds({"x": x, "label": label}, STEPS, classes=3)
    assert_equal_to_serial(main, startup, feeds, loss, dist)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_inside_pipeline_stages(stage):
    """pp=2 x dp=2 with PipelineConfig(stages=2): each stage's parameters lie on its own dp
    sub-mesh, whose dp dim is not the whole mesh's dim 1 (compile failed with an IndexError)."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 12], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        hidden = paddle.nn.functional.relu(paddle.nn.Linear(12, 16)(x))
        loss = paddle.nn.functional.cross_entropy(paddle.nn.Linear(16, 5)(hidden), label).mean()
        paddle.optimizer.Adam(0.01).minimize(loss)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    pipeline = autopar.PipelineConfig(micro_batches=2, schedule="1F1B", stages=2)
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(zero_stage=stage, pipeline=pipeline))
    assert len(dist.state.zero) == 4 and all(z.sharded is not None for z in dist.state.zero), dist.state.zero
    feeds = random_feeds({"x": x, "label": label}, STEPS, classes=5)
    assert_equal_to_serial(main, startup, feeds, loss, dist)


def test_zero_on_a_pipeline_only_mesh_is_refused():
    """A 1-d pp mesh has no data-parallel dim (ZeRO 'sharded' over one-rank stage meshes)."""
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh)
    strategy = autopar.Strategy(zero_stage=1, pipeline=autopar.PipelineConfig(micro_batches=2))
    with pytest.raises(autopar.AutoparError, match="only dim carries the pipeline stages"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
