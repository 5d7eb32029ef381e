"""Pipeline parallelism equals serial in the simulator: losses every step and parameters after
3 steps (rtol 1e-5), for FThenB and 1F1B, m = 1..4 micro-batches (odd m included), Momentum
and Adam, 2 and 4 stages, and data parallelism inside the stages (pp=2 x dp=2)."""

import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.models import simple_net
from autopar.testing.pipeline_models import residual_blocks, staged_mlp
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds


def _compile(seed, mesh, micro_batches, schedule="1F1B"):
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "ZBH1"])
def test_two_stages(schedule, micro_batches, optimizer):
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh, optimizer=optimizer)
    dist = _compile(seed, mesh, micro_batches, schedule)
    sends = [c for c in dist.comm_ops(0) if c.kind == "send"]
    assert len(sends) == 1 and sends[0].group == (0, 1)  # the stage boundary's activation, once per micro-batch
    assert [c.kind.value for c in dist.comm_ops(1)] == ["recv", "send"]  # activation in, its gradient back
    assert_simulation_equals_serial(seed, dist)


def test_four_stages_unseeded():
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["pp"])
    seed = staged_mlp(mesh, widths=(8, 16, 16, 16, 10), stages=4, seed=None)
    dist = _compile(seed, mesh, 4)
    assert [str(a) for a in dist.schedule(3) if a.kind.value in ("F", "B")] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3"]
    assert_simulation_equals_serial(seed, dist)


def test_data_parallel_inside_the_stages():
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    seed = staged_mlp(mesh)
    autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
    dist = _compile(seed, mesh, 2)
    assert {c.kind.value for c in dist.comm_ops(0)} >= {"send", "recv", "all_reduce"}
    assert all(c.group in ((0, 2), (2, 0)) for c in dist.comm_ops(0) if c.kind.value in ("send", "recv"))
    # the gradient bucket's all_reduce is an action of its own in the executable schedule: once per step, after
    # micro-batch 1's gradients are accumulated, between the update's pieces
    steps = [str(a) for a in dist.rank_plan(0).pipeline.steps]
    assert steps[-4] == "0ACC1" and [s.split("#")[0] for s in steps[-3:]] == ["OPT", "REDUCE_GRAD", "OPT"]
    assert_simulation_equals_serial(seed, dist)


def test_schedules_the_runtime_does_not_run_yet_and_bad_micro_batches_are_refused():
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh)
    with pytest.raises(AutoparError, match="1 stage\\(s\\) per pipeline rank; Interleaved1F1B needs several"):
        _compile(seed, mesh, 2, "Interleaved1F1B")
    with pytest.raises(AutoparError, match="feed 'x' has 12 rows .* which 5 micro-batches do not divide"):
        _compile(seed, mesh, 5)
    plain = simple_net(batch=8, sizes=(16, 10))
    with pytest.raises(AutoparError, match="no pipeline"):
        autopar.compile(plain.main, autopar.ProcessMesh([0, 1], ["dp"]), startup_program=plain.startup).schedule(0)
    with pytest.raises(AutoparError, match="visit the meshes in the order 0 -> 1 -> 0: stages must cycle"):
        _compile(staged_mlp(mesh, widths=(16, 16, 16, 16, 10), placement=(0, 1, 1, 0)), mesh, 2)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_interleaved_virtual_stages(micro_batches, optimizer):
    """Two virtual stages per pipeline rank (layers on mesh[0], mesh[1], mesh[0], mesh[1])."""
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10), placement=(0, 1, 0, 1), optimizer=optimizer)
    dist = _compile(seed, mesh, micro_batches, "Interleaved1F1B")
    compute = [str(a) for a in dist.schedule(0) if a.kind.value in ("F", "B")]
    assert {a[0] for a in compute} == {"0", "2"}  # rank 0 holds stages 0 and 2
    assert_simulation_equals_serial(seed, dist)


def test_an_op_needing_the_whole_batch_is_refused_under_micro_batching():
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 4], "float32")
        h = autopar.shard_op(paddle.nn.Linear(4, 4), mesh[0])(x)
        centered = autopar.shard_op(lambda t: paddle.nn.functional.softmax(t, axis=0), mesh[1])(h)  # over the batch
        loss = autopar.shard_op(paddle.mean, mesh[1])(centered)
        paddle.optimizer.SGD(0.1).minimize(loss)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    with pytest.raises(AutoparError, match="micro-batching: pd_op.softmax#.* needs the whole batch"):
        autopar.compile(main, mesh, startup_program=startup, strategy=strategy)


def test_tensor_parallel_inside_the_stages():
    """pp=2 x mp=2: each stage a column- then row-parallel pair; the column-parallel layer's
    input gradient is a pending sum, moved to the previous stage and reduced there."""
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10))
    for name, stage, mapping in (("linear1", 0, [None, "mp"]), ("linear2", 0, ["mp", None]),
                                 ("linear3", 1, [None, "mp"]), ("linear4", 1, ["mp", None])):  # fmt: skip
        autopar.shard_tensor(seed.layers[name].weight, mesh[stage], mapping)
    dist = _compile(seed, mesh, 3)
    assert [f"{c.kind}{list(c.group)}" for c in dist.comm_ops(2)] == ["recv[0, 2]", "all_reduce[2, 3]", "send[2, 0]"]
    assert_simulation_equals_serial(seed, dist)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_a_residual_stream_crosses_the_stages(schedule):
    """Pre-norm residual blocks: the stream's gradient is summed by an add_n on the later stage,
    whose builtin.combine must stay with it (it was kept on the earlier stage, reading the other
    stage's gradients without a transfer)."""
    seed = residual_blocks(autopar.ProcessMesh([0, 1], ["pp"]), classes=10)
    assert_simulation_equals_serial(seed, _compile(seed, autopar.ProcessMesh([0, 1], ["pp"]), 2, schedule))


def test_a_megatron_gpt_cut_into_stages_by_layers():
    """What a user writes: a GPT whose attention reshapes with the literal batch size, weights
    annotated on the whole pp x mp mesh, ``PipelineConfig(stages=2)``. Each reshape's target
    shrinks to the micro-batch (the rule read the whole batch's before), each weight's
    annotation moves to the stage reading it (the update ran on the whole mesh before)."""
    from autopar.testing.models import annotate_megatron, gpt_block_program

    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    seed = gpt_block_program(batch=4, seq=4, hidden=16, heads=2, vocab=10, layers=2, optimizer="momentum")
    annotate_megatron(seed, mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    qkv = dist.dist_attr(seed.layers["qkv0"].weight.name)
    assert qkv.mesh == mesh[0] and str(qkv) == "[S(1)]"
    assert dist.dist_attr(seed.layers["fc2_1"].weight.name).mesh == mesh[1]
    assert_simulation_equals_serial(seed, dist)


def test_zero_bubble_splits_each_backward_into_input_and_weight_gradients():
    """ZB-H1: the ops the sent input gradient needs run in I, the rest in W (deferred by the
    schedule); 4 stages, equal to serial. Paddle's matmul_grad makes both gradients in one op,
    so a Linear stage's backward is all I, except on stage 0, which sends no input gradient."""
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["pp"])
    seed = staged_mlp(mesh, widths=(8, 16, 16, 16, 10), stages=4)
    dist = _compile(seed, mesh, 4, "ZBH1")
    first, middle = set(dist.rank_plan(0).pipeline.phases), set(dist.rank_plan(1).pipeline.phases)
    assert {"F0", "W0", "OPT"} <= first and not {"B0", "I0"} & first
    assert {"F1", "I1", "OPT"} <= middle and "B1" not in middle
    assert {a.kind.value for a in dist.schedule(3)} >= {"F", "I", "W", "OPT"}
    assert_simulation_equals_serial(seed, dist)


def test_dump_diff_draws_the_schedule(tmp_path):
    import xml.etree.ElementTree as ElementTree

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh)
    result = _compile(seed, mesh, 4).dump_diff(tmp_path, svg=False)
    root = ElementTree.fromstring(result.schedule.read_text())
    assert root.tag.endswith("svg") and "1F1B, 4 micro-batches" in result.schedule.read_text()


@pytest.mark.parametrize(("stages", "schedule"), [(2, "1F1B"), (4, "Interleaved1F1B")])
def test_stages_by_layer_ranges(stages, schedule):
    """PipelineConfig(stages=n) cuts the layers of an unannotated program into n runs."""
    seed = simple_net(batch=8, sizes=(16, 32, 32, 32, 10), optimizer="adam")
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    config = autopar.PipelineConfig(micro_batches=2, schedule=schedule, stages=stages)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
    assert len(dist.state.pipeline.stages) == stages
    assert_simulation_equals_serial(seed, dist)
    with pytest.raises(AutoparError, match="PipelineConfig.stages must be >= 1"):
        autopar.PipelineConfig(stages=0)
    with pytest.raises(AutoparError, match="has 4 layers"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup,
                        strategy=autopar.Strategy(pipeline=autopar.PipelineConfig(stages=6)))  # fmt: skip


def test_a_stage_rank_keeps_its_stage_only():
    """A rank's start-up still draws every parameter (the generator stays in step: the runs above
    equal serial) but the rank keeps only what it holds or reads: its stage's parameters and
    Adam moments, and the learning rate every stage's update reads. Before, every rank kept the
    whole model (and the start-up's intermediates) for the whole run."""
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["pp"])
    seed = staged_mlp(mesh, widths=(8, 16, 16, 16, 10), stages=4, optimizer="adam")
    dist = _compile(seed, mesh, 2)
    first, last = seed.layers["linear1"].weight.name, seed.layers["linear4"].weight.name
    for rank, mine, other in ((0, first, last), (3, last, first)):
        plan = dist.rank_plan(rank)
        scope = paddle.static.Scope()
        plan.run_startup(scope, paddle.static.Executor(paddle.CPUPlace()))
        kept = set(scope.local_var_names())
        assert mine in kept and not any(other in n for n in kept), sorted(kept)  # nor the other's moments
        assert kept == set(plan.held()) | plan.scope_reads
        assert [n for n in kept if n.startswith("learning_rate")]  # placed on one stage, read by every update
        assert len(kept) == 2 * 5 + 1  # weight and bias, each with 2 moments and 2 beta powers; the learning rate


def test_a_mesh_naming_its_pipeline_dim_second_is_refused():
    """Stages run over mesh dim 0; with ['dp', 'pp'] they were cut over dp (the plans deadlocked)."""
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "pp"])
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    with pytest.raises(AutoparError, match=r"stages over mesh dim 0, which .* names 'dp'; put 'pp' first"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B"])
def test_global_norm_clipping_across_stages(schedule):
    """The clip's norms read the gradients summed over the micro-batches, once per step (they
    were taken for per-micro-batch ops: 'squared_l2_norm ... needs the whole batch at once'),
    and the norm sums over both stages' parameters."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 12], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        hidden = paddle.tanh(paddle.nn.Linear(12, 16)(x))
        hidden = paddle.nn.LayerNorm(16)(paddle.nn.Linear(16, 16)(hidden))
        loss = paddle.nn.functional.cross_entropy(paddle.nn.Linear(16, 10)(hidden), label).mean()
        paddle.optimizer.Momentum(0.2, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05)).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, schedule=schedule, stages=2))
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
    seed = type("Seed", (), {"main": main, "startup": startup, "loss": loss, "feeds": {"x": x, "label": label}})
    assert_simulation_equals_serial(seed, dist)


def _two_stage_program(case):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        first, second = paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 8)
        h = autopar.shard_op(lambda t: paddle.tanh(first(t)), mesh[0])(x)
        if case == "feed read on two stages":
            loss = autopar.shard_op(lambda t, x: paddle.mean((second(t) + x) ** 2), mesh[1])(h, x)
        else:  # a concat inside a stage: its backward unpacks a vector (builtin.combine / split)
            loss = autopar.shard_op(lambda t: paddle.mean(paddle.concat([t[:, :4], second(t)], axis=1) ** 2), mesh[1])(h)
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup, mesh, {"x": x}


@pytest.mark.parametrize("case", ["feed read on two stages", "concat inside a stage"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_user_programs_that_crashed(case, micro_batches):
    """A feed read on two stages (was a bare KeyError: 'x' in the runner: the second stage was
    never given it) and a concat inside a stage (its backward's vector plumbing ran in the
    forward phase: "The variable ... should exist"): every value equals serial."""
    main, startup, mesh, feeds = _two_stage_program(case)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches))
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
    report = autopar.check(dist, random_feeds(feeds, 2))
    assert report.clean, str(report)
