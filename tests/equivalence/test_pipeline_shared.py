"""A parameter read on several pipeline stages (a tied word embedding: looked up on the first
stage, the LM head's weight on the last; a layer called on two stages) is updated as serial
updates it, in the simulator: losses every step and every parameter after 3 steps equal serial
(rtol 1e-5), for FThenB, 1F1B, ZB-H1 and interleaved 1F1B with 2 and 4 micro-batches, SGD and
Momentum. Every copy of it is the same after each step (``simulate`` compares the copies on the
stages that keep one). Before: the stage-0 gradient of micro-batches 1..m-1 was lost (the send
ran once per micro-batch, the owner's recv once per step), and the last stage's copy was never
updated (losses from step 1 on differed, with one micro-batch too)."""

import numpy as np
import paddle
import pytest
from hypothesis import given
from hypothesis import strategies as st

import autopar
from autopar.testing.pipeline_models import tied_lm
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds

PP = autopar.ProcessMesh([0, 1], ["pp"])
PLACEMENTS = {"FThenB": (0, 1, 1), "1F1B": (0, 1, 1), "ZBH1": (0, 1, 1), "Interleaved1F1B": (0, 1, 0, 1)}


def compiled(seed, mesh, micro_batches, schedule, zero_stage=0):
    config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
    strategy = autopar.Strategy(pipeline=config, zero_stage=zero_stage)
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("schedule", list(PLACEMENTS))
def test_tied_embedding(schedule, micro_batches, optimizer):
    seed = tied_lm(PP, PLACEMENTS[schedule], optimizer=optimizer)
    dist = compiled(seed, PP, micro_batches, schedule)
    weight = seed.layers["embedding"].weight.name
    refresh = [c for c in dist.comm_ops(0) if c.value == weight]
    assert [c.kind.value for c in refresh] == ["send"], dist.comm_ops(0)  # the updated weight, to the head's copy
    assert "replaces the copy once per step" in refresh[0].reason and refresh[0].bytes == 16 * 8 * 4
    assert_simulation_equals_serial(seed, dist)


def test_the_gradient_crosses_once_per_step_into_the_owners_update():
    """The head's gradient of the tied weight is summed over the micro-batches on its stage
    and sent in the optimizer phase, once per step: the one send rank 1 makes there."""
    seed = tied_lm(PP, (0, 1, 1))
    plan = compiled(seed, PP, 4, "1F1B").rank_plan(1)
    in_update = [c for c, position in plan.collectives if plan.pipeline.phases[position] == "OPT"]
    assert [(c.kind.value, c.shape) for c in in_update] == [("send", (16, 8)), ("recv", (16, 8))]
    assert "a stage's part of grad(" in in_update[0].reason and "replaces the copy" in in_update[1].reason


def test_one_micro_batch_keeps_the_copy_up_to_date():
    seed = tied_lm(PP, (0, 1))
    assert_simulation_equals_serial(seed, compiled(seed, PP, 1, "1F1B"), steps=4)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_a_layer_called_on_two_stages(micro_batches):
    seed = tied_lm(PP, (0, 0, 1, 1), optimizer="momentum", shared=(0, 1))
    assert seed.layers["block0"] is seed.layers["block1"]
    assert_simulation_equals_serial(seed, compiled(seed, PP, micro_batches, "1F1B"))


def test_a_layer_called_twice_on_one_rank_interleaved():
    """Two virtual stages of one rank read the layer: their gradients meet on that rank (Paddle
    sums them mid-backward, among the backward ops: the send after that sum once ran once per
    step and the plans deadlocked)."""
    seed = tied_lm(PP, (0, 1, 0, 1, 1), shared=(0, 2))
    assert_simulation_equals_serial(seed, compiled(seed, PP, 2, "Interleaved1F1B"))


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_data_parallel_and_zero_inside_the_stages(zero_stage):
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    seed = tied_lm(mesh, (0, 1, 1), optimizer="momentum", data_parallel="dp")
    dist = compiled(seed, mesh, 2, "1F1B", zero_stage)
    refreshes = {c.group for c in dist.comm_ops(2) if "replaces the copy" in c.reason}
    # each dp rank refreshes its copy; ZeRO-3 shards the weight: the head's stage receives it at each read
    assert refreshes == (set() if zero_stage == 3 else {(0, 2)})
    assert_simulation_equals_serial(seed, dist)


def test_global_norm_clipping_counts_the_shared_gradient_once():
    seed = tied_lm(PP, (0, 1, 1), optimizer="momentum", clip=0.05)
    assert_simulation_equals_serial(seed, compiled(seed, PP, 2, "1F1B"))


@st.composite
def pipelines(draw):
    """A tied LM on 2 or 3 pipeline ranks: random cut, random shared block, schedule, m."""
    ranks = draw(st.sampled_from([2, 3]))
    schedule = draw(st.sampled_from(["FThenB", "1F1B", "ZBH1", "Interleaved1F1B"]))
    if schedule == "Interleaved1F1B":
        placement = tuple(list(range(ranks)) * 2)
        placement = (0,) + placement[1:] + (placement[-1],)
    else:
        cuts = sorted(draw(st.lists(st.integers(1, 4), min_size=ranks - 1, max_size=ranks - 1, unique=True)))
        placement = tuple(sum(i >= c for c in cuts) for i in range(5)) + (ranks - 1,)
    blocks = len(placement) - 2
    shared = None
    if blocks >= 2 and draw(st.booleans()):
        shared = tuple(sorted(draw(st.lists(st.integers(0, blocks - 1), min_size=2, max_size=2, unique=True))))
    # (Interleaved1F1B: micro-batches in groups of the pipeline ranks; all divide the batch of 12)
    micro_batches = draw(st.sampled_from([ranks, 2 * ranks] if schedule == "Interleaved1F1B" else [1, 2, 3, 4]))
    optimizer = draw(st.sampled_from(["sgd", "momentum"]))
    return ranks, placement, shared, schedule, micro_batches, optimizer


@given(pipelines())
def test_random_pipelines_with_shared_parameters_equal_serial(case):
    ranks, placement, shared, schedule, micro_batches, optimizer = case
    mesh = autopar.ProcessMesh(list(range(ranks)), ["pp"])
    seed = tied_lm(mesh, placement, batch=12, optimizer=optimizer, shared=shared)
    assert_simulation_equals_serial(seed, compiled(seed, mesh, micro_batches, schedule), steps=2)


def _program(build, mesh):
    from autopar.testing.models import SeedProgram

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        feeds, loss = build(mesh)
    return SeedProgram(main, startup, feeds, loss)


def test_a_vocabulary_split_tied_embedding_inside_tensor_parallel_stages():
    """pp x mp, the tied weight split over mp by its rows: no copy is kept on the head's stage,
    which receives its piece at each read."""

    def build(mesh):
        ids, label = paddle.static.data("ids", [8, 4], "int64"), paddle.static.data("label", [8, 4, 1], "int64")
        embedding, linear = paddle.nn.Embedding(16, 8), paddle.nn.Linear(8, 8)
        autopar.shard_tensor(embedding.weight, mesh[0], ["mp", None])
        h = autopar.shard_op(lambda t: paddle.tanh(linear(embedding(t))), mesh[0])(ids)
        logits = lambda t: paddle.matmul(t, embedding.weight, transpose_y=True)  # noqa: E731
        loss = autopar.shard_op(lambda t: paddle.mean(paddle.nn.functional.cross_entropy(logits(t), label)), mesh[1])(h)
        paddle.optimizer.Momentum(0.1).minimize(loss)
        return {"ids": ids, "label": label}, loss

    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    seed = _program(build, mesh)
    dist = compiled(seed, mesh, 4, "1F1B")
    assert not [c for c in dist.comm_ops(2) if "replaces the copy" in c.reason]
    assert_simulation_equals_serial(seed, dist)


def test_a_bias_added_three_times_on_two_stages_with_adam():
    def build(mesh):
        x = paddle.static.data("x", [8, 8], "float32")
        bias = paddle.create_parameter([8], "float32")
        first, second = paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 8)
        h = autopar.shard_op(lambda t: paddle.tanh(first(t) + bias) + bias, mesh[0])(x)
        loss = autopar.shard_op(lambda t: paddle.mean((second(t) + bias) ** 2), mesh[1])(h)
        paddle.optimizer.Adam(0.01).minimize(loss)
        return {"x": x}, loss

    seed = _program(build, PP)
    assert_simulation_equals_serial(seed, compiled(seed, PP, 4, "ZBH1"))


def test_a_checkpoint_restores_every_copy_of_the_tied_weight(tmp_path):
    """Saved after 2 steps, loaded (on the same pipeline) and trained 2 more: as 4 steps in a
    row. The head stage's copy is loaded too (it is read there): a stale copy would make step 3's
    forward wrong until the first refresh."""
    seed = tied_lm(PP, (0, 1, 1), optimizer="momentum", seed=5)
    dist = compiled(seed, PP, 2, "1F1B")
    feeds = random_feeds(seed.feeds, 4, classes=10)
    straight = autopar.simulate(dist, feeds, [seed.loss])
    autopar.simulate(dist, feeds[:2], [seed.loss], save_to=tmp_path / "ckpt")
    resumed = autopar.simulate(dist, feeds[2:], [seed.loss], load_from=tmp_path / "ckpt")
    for step, (want, got) in enumerate(zip(straight.fetches[2:], resumed.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, err_msg=f"loss at step {step + 2}")
    for name, want in straight.parameters.items():
        np.testing.assert_allclose(resumed.parameters[name], want, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("case", ["recompute", "clip + zero2 + dp", "adamw interleaved"])
def test_shared_parameters_beside_other_strategies_check_clean(case):
    """Every value equal to serial (``autopar.check``, 3 steps) with recompute, global-norm
    clipping with ZeRO-2 inside data-parallel stages, AdamW on virtual stages."""
    pp, ppdp = PP, autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    one_f_one_b = autopar.PipelineConfig(micro_batches=2, schedule="1F1B")
    mesh, placement, strategy, options = {
        "recompute": (pp, (0, 1, 1), autopar.Strategy(pipeline=one_f_one_b, recompute=True), {"optimizer": "momentum"}),
        "clip + zero2 + dp": (ppdp, (0, 1, 1), autopar.Strategy(pipeline=one_f_one_b, zero_stage=2),
                              {"optimizer": "momentum", "data_parallel": "dp", "clip": 0.05}),
        "adamw interleaved": (pp, (0, 1, 0, 1), autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, schedule="Interleaved1F1B")),
                              {"optimizer": "adamw"}),
    }[case]  # fmt: skip
    seed = tied_lm(mesh, placement, seed=3, **options)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    report = autopar.check(dist, random_feeds(seed.feeds, 3, classes=10))
    assert report.clean, str(report)
