"""Pipelines of real models as their authors write them (issue 35), each construct in the exact
form the issue writes, equal to serial (losses every step, parameters after 3 SGD steps) under a
2-stage pipeline with m = 2 and 4 (1F1B and ZB-H1), pp x dp and pp x mp
(``autopar.testing.real_pipelines`` builds the decoder; the feeds put the ignored labels
unevenly over the rows, so a mean of micro-batch means is not the serial loss)."""

import numpy as np
import pytest

import autopar
from autopar.errors import AnnotationError
from autopar.testing import real_pipelines as rp
from autopar.testing.serial import assert_simulation_equals_serial, run_serial

M = autopar.ProcessMesh
PP = M([0, 1], ["pp"])
MESHES = {"pp": PP, "pp x dp": M([[0, 1], [2, 3]], ["pp", "dp"]), "pp x mp": M([[0, 1], [2, 3]], ["pp", "mp"])}
BATCH = 8  # (pp x dp with 4 micro-batches: one row per rank)


def _equals_serial(config, mesh=PP, micro_batches=2, schedule="1F1B", staged=True, stages=None, **strategy):
    seed = rp.build(config, batch=BATCH, seq=6, mesh=mesh, staged=staged)
    pipeline = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule, stages=stages)
    dist = autopar.compile(
        seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=pipeline, **strategy)
    )
    assert_simulation_equals_serial(seed, dist, feeds=rp.feeds(config, BATCH, 6, 3))
    return seed, dist


def _refused(build, strategy, error, match):
    """Compile the program ``build(paddle)`` makes inside a fresh program guard (its loss minimized
    with SGD) on ``PP``: refused with ``error`` matching ``match``."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        paddle.optimizer.SGD(0.1).minimize(build(paddle))
    with pytest.raises(error, match=match):
        autopar.compile(main, PP, startup_program=startup, strategy=strategy)


def test_the_feeds_make_a_mean_of_micro_batch_means_wrong():
    """The test's premise: with these feeds the valid tokens are spread unevenly over the
    micro-batches, so averaging the micro-batches' means would not give the serial loss."""
    labels = rp.feeds(rp.Config(), BATCH, 6, 1)[0]["labels"]
    valid = (labels != rp.IGNORE).reshape(4, -1).sum(axis=1)
    assert len(set(valid.tolist())) > 1, valid


@pytest.mark.parametrize(
    "mask, schedule, micro_batches",
    [
        ("labels", "1F1B", 2),
        ("labels", "1F1B", 4),
        ("labels", "ZBH1", 2),
        ("labels", "ZBH1", 4),
        ("positive", "1F1B", 4),
        ("positive", "ZBH1", 2),
    ],
)
def test_masked_select_criterion(mask, schedule, micro_batches):
    """Item 1: ``mean(masked_select(loss, labels != ignore))`` and ``(loss > 0)``, exact: the
    selected sum and count are accumulated over the micro-batches and divided once per step."""
    criterion = "masked_select" if mask == "labels" else "positive"
    _, dist = _equals_serial(rp.Config(criterion=criterion), micro_batches=micro_batches, schedule=schedule)
    assert any("masked_mean" in name and "divided by the selected count" in text for name, text in dist.state.rewrites)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_masked_select_criterion_on_two_dim_meshes_with_an_active_clip(mesh):
    """Item 1 beside dp and mp, with global-norm clipping active (the clip reads the divided
    gradients: clipping the undivided ones would scale by the wrong norm)."""
    _equals_serial(rp.Config(criterion="positive", clip=1e-3), MESHES[mesh], micro_batches=2)


def test_the_clip_scales():
    """The clip of the tests above is active: the clipped update differs from the unclipped one."""
    feeds = rp.feeds(rp.Config(), BATCH, 6, 1)
    updated = []
    for clip in (1e-3, None):
        seed = rp.build(rp.Config(criterion="positive", clip=clip), batch=BATCH, seq=6)
        updated.append(list(run_serial(seed.main, seed.startup, feeds, [seed.loss]).parameters.values()))
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(*updated)) > 1e-3


def test_masked_select_criterion_under_gradient_accumulation():
    config = rp.Config(criterion="masked_select", clip=1e-3)
    _equals_serial(config, M([0, 1], ["dp"]), micro_batches=2, staged=False, stages=1)


def test_a_masked_mean_that_is_not_the_loss_is_refused_by_name():
    def build(paddle):
        x = paddle.static.data("x", [4, 3], "float32")
        h = autopar.shard_op(paddle.nn.Linear(3, 3), PP[0])(x)
        h = autopar.reshard(h, PP[1], [autopar.Replicate()])
        y = autopar.shard_op(paddle.nn.Linear(3, 1), PP[1])(h)
        return paddle.mean(paddle.masked_select(y, y > 0)) + 0.1 * paddle.mean(y)

    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    _refused(
        build, strategy, autopar.AutoparError, r"pd_op.mean#\d+ averages .* only a masked mean that is the step's loss"
    )


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_causal_mask_from_python_scalars(micro_batches, schedule):
    """Item 2: ``paddle.where(causal, 0.0, paddle.finfo(dtype).min)`` (each scalar a ``full`` +
    in-place ``assign_value_``) is a constant: computed on every stage reading it, never sent."""
    _, dist = _equals_serial(
        rp.Config(mask="scalars", criterion="sum_count"), micro_batches=micro_batches, schedule=schedule
    )
    sent = [c for r in PP.ranks for c in dist.comm_ops(r) if c.kind.value == "send"]
    assert all(c.bytes != 4 * 6 * 6 for c in sent), [str(c) for c in sent]  # (the [1, 1, 6, 6] mask is not sent)


@pytest.mark.parametrize("mesh", ["pp x dp", "pp x mp"])
def test_causal_mask_from_python_scalars_on_two_dim_meshes(mesh):
    _equals_serial(rp.Config(mask="scalars", criterion="sum_count"), MESHES[mesh])


@pytest.mark.parametrize("mesh", [*MESHES, "pp x dp x mp"])
def test_a_mask_made_on_one_stage_annotated_on_the_whole_mesh(mesh):
    """Item 3: ``shard_tensor(attention_mask, global_mesh, [Replicate()] * mesh.ndim)`` of a
    mask made from the ids on stage 0 (was a raw IndexError from propagation): replicated on
    every stage reading it, as Paddle means it."""
    meshes = {**MESHES, "pp x dp x mp": M([[[0, 1]], [[2, 3]]], ["pp", "dp", "mp"])}
    config = rp.Config(mask="scalars", criterion="masked_select", padding=True, mask_on_mesh=True)
    _equals_serial(config, meshes[mesh])
    for micro_batches, schedule in ((4, "1F1B"), (2, "ZBH1")):
        if mesh == "pp":
            _equals_serial(config, meshes[mesh], micro_batches=micro_batches, schedule=schedule)


def test_a_value_split_over_the_pipeline_dim_off_its_stage_is_refused_before_propagation():
    def build(paddle):
        x = paddle.static.data("x", [4, 6], "float32")
        h = autopar.shard_op(paddle.nn.Linear(6, 6), PP[0])(x)
        autopar.shard_tensor(h, PP, [autopar.Shard(1)])
        return autopar.shard_op(lambda t: paddle.nn.Linear(6, 1)(t).mean(), PP[1])(h)

    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    _refused(
        build, strategy, AnnotationError, r"is made by pd_op.add#\d+ on mesh\(pp=1\)\[0\] but annotated on mesh\(pp=2\)"
    )


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_automatic_cut_keeps_the_users_reshards(schedule, micro_batches):
    """Item 4: ``PipelineConfig(stages=2)`` on a program whose residual stream the user moves
    with ``autopar.reshard`` (was refused naming shard_op, which the user never wrote)."""
    _equals_serial(
        rp.Config(criterion="sum_count"), staged=False, stages=2, micro_batches=micro_batches, schedule=schedule
    )


@pytest.mark.parametrize("mesh", ["pp x dp", "pp x mp"])
def test_automatic_cut_keeps_the_users_reshards_on_two_dim_meshes(mesh):
    _equals_serial(rp.Config(criterion="sum_count"), MESHES[mesh], staged=False, stages=2)


def test_automatic_cut_names_a_shard_op_the_user_wrote():
    def build(paddle):
        x = paddle.static.data("x", [4, 6], "float32")
        h = autopar.shard_op(paddle.nn.Linear(6, 6), PP[0])(x)
        return paddle.nn.Linear(6, 1)(h).mean()

    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    _refused(
        build,
        strategy,
        AnnotationError,
        r"pd_op.matmul#\d+ \(in Linear(_\d+)?\) is placed on mesh\(pp=1\)\[0\] with shard_op",
    )


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_class_token_glue_outside_any_layer(micro_batches, schedule):
    """Item 5: ``cls_token.expand((paddle.shape(x)[0], -1, -1))`` in the model's own forward,
    from an unannotated parameter, takes the stage of its reader (stage 0)."""
    seed, dist = _equals_serial(
        rp.Config(criterion="sum_count", cls_token=True), micro_batches=micro_batches, schedule=schedule
    )
    assert dist.dist_attr(seed.layers["model"].cls_token.name).mesh == PP[0]


@pytest.mark.parametrize("mesh", ["pp x dp", "pp x mp"])
def test_class_token_glue_on_two_dim_meshes(mesh):
    _equals_serial(rp.Config(criterion="sum_count", cls_token=True), MESHES[mesh])


@pytest.mark.parametrize("mesh", ["pp x dp", "pp x mp"])
def test_a_dead_statistic_on_two_dim_meshes(mesh):
    """Item 6 beside dp and mp (``tests/equivalence/test_dead_ops.py``: every schedule on pp):
    a router statistic over the whole batch that nothing reads is removed, not refused."""
    seed, dist = _equals_serial(rp.Config(criterion="sum_count", dead_statistic=True), MESHES[mesh], micro_batches=4)
    assert any(name == "dead_ops" and "pd_op.max#" in text for name, text in dist.state.rewrites)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_construct_at_once(mesh):
    config = rp.Config(
        mask="scalars",
        criterion="positive",
        cls_token=True,
        padding=True,
        mask_on_mesh=True,
        clip=1e-3,
        dead_statistic=True,
    )
    _equals_serial(config, MESHES[mesh], micro_batches=4, schedule="ZBH1")
