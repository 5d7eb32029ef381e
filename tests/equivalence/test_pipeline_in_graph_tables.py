"""Pipelines of models that build tables and masks in the graph (issue: real models, 1, 2, 3,
5, 12): position ids ``arange(seq)`` expanded to the batch, a causal mask ``tril(ones)`` read
on both stages, a batch-sized padding mask ``ones([batch, seq])``, a rotate-half ``concat``.
Before: refused at compile ("pd_op.arange runs on mesh(pp=2) which is no pipeline stage";
with micro-batches "pd_op.add reads %35.0 as [S(0)] ... needs the whole batch at once"; the
rotate-half's backward had no stage). Now each stage computes the values it reads, and the
batch-sized ones are built one micro-batch at a time; every case equals serial."""

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.models import _static, make_optimizer
from autopar.testing.pipeline_models import in_graph_tables
from autopar.testing.serial import assert_simulation_equals_serial

PP = autopar.ProcessMesh([0, 1], ["pp"])
VOCAB = 32


def compiled(seed, mesh, micro_batches, **config):
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, **config))
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_tables_built_in_the_graph_run_on_the_stages_reading_them(micro_batches):
    seed = in_graph_tables(PP)
    dist = compiled(seed, PP, micro_batches)
    assert_simulation_equals_serial(seed, dist, classes=VOCAB)
    # nothing crosses the pipeline for the tables: one activation forward, its gradient back
    sends = [c for c in dist.comm_ops(0) if c.kind.value in ("send", "recv")]
    assert [(c.kind.value, c.shape) for c in sends] == [("send", (4 // micro_batches, 8, 16)), ("recv", (4 // micro_batches, 8, 16))]
    report = str(dist.passes)
    assert "pipeline_stages" in report and "(rewrite)" in report


def test_the_causal_mask_is_computed_on_both_stages():
    seed = in_graph_tables(PP)
    dist = compiled(seed, PP, 2)
    tril = [op for op in dist.decisions.ops() if op.name == "pd_op.tril"]
    assert len(tril) == 2  # one copy per stage reading it
    meshes = {dist.decisions.value(op.outputs[0]).placement.mesh for op in tril}
    assert meshes == {PP[0], PP[1]}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_automatic_cut_with_tables(micro_batches):
    seed = in_graph_tables(PP, placement=None)
    assert_simulation_equals_serial(seed, compiled(seed, PP, micro_batches, stages=2), classes=VOCAB)


def test_pipeline_by_data_parallel_with_tables():
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    seed = in_graph_tables(mesh)
    autopar.shard_tensor(seed.feeds["ids"], mesh[0], ["dp", None])
    autopar.shard_tensor(seed.feeds["labels"], mesh[1], ["dp", None])
    assert_simulation_equals_serial(seed, compiled(seed, mesh, 2), classes=VOCAB)


def test_data_parallel_with_tables_equals_serial():
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    seed = in_graph_tables(mesh, placement=None)
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist, classes=VOCAB)
    assert {c.kind.value for c in dist.comm_ops(0)} == {"all_reduce"}  # the gradients only: the masks are sliced


def _constant_made_on_stage_0(batch=4, width=6):
    """A ``full`` made inside stage 0's layer and read by stage 1 (issue item 5)."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, width], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        first, second = paddle.nn.Linear(width, width), paddle.nn.Linear(width, 3)

        def stage0(t):
            return first(t), paddle.full([batch, width], 0.5, "float32")

        h, bias = autopar.shard_op(stage0, PP[0])(x)
        loss = autopar.shard_op(lambda t, b: paddle.mean(paddle.nn.functional.cross_entropy(second(t + b), label)), PP[1])(h, bias)
        make_optimizer("sgd").minimize(loss)
    from autopar.testing.models import SeedProgram

    return SeedProgram(main, startup, {"x": x, "label": label}, loss)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_constant_made_on_one_stage_and_read_on_the_next(micro_batches):
    seed = _constant_made_on_stage_0()
    assert_simulation_equals_serial(seed, compiled(seed, PP, micro_batches), classes=3)


def test_an_op_needing_the_whole_batch_is_refused_by_name_and_layer():
    """Centering over the batch (a mean over dim 0) cannot run one micro-batch at a time."""
    paddle, main, startup = _static()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        first, second = paddle.nn.Linear(6, 6), paddle.nn.Linear(6, 1)
        h = autopar.shard_op(first, PP[0])(x)

        def center(t):
            return paddle.mean(second(t - paddle.mean(t, axis=0, keepdim=True)))

        loss = autopar.shard_op(center, PP[1])(h)
        make_optimizer("sgd").minimize(loss)
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op\.\w+#\d+ .*needs the whole batch"):
        autopar.compile(main, PP, startup_program=startup, strategy=autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2)))
