"""passes/batch_norm_stats.py: batch norm over a split batch normalizes with the whole batch's
statistics: one all_reduce of 2·C values forward (the sums of x and x²), one backward (stage:
comm-inserted -> statistics-rewritten). Read from the rank program the compile produces, so these
hold whichever pass makes it. (Equal to serial: tests/equivalence/test_batch_norm.py.)"""

import paddle
from pass_programs import count

import autopar
from autopar.testing.models import make_optimizer

CHANNELS = 3


def _compile(mesh, batch_split):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, CHANNELS, 4, 4], "float32")
        loss = paddle.mean(paddle.square(paddle.nn.BatchNorm2D(CHANNELS)(x)))
        make_optimizer("sgd").minimize(loss)
    autopar.shard_tensor(x, mesh, [batch_split, None, None, None])
    return main, autopar.compile(main, mesh, startup_program=startup)


def test_a_batch_split_norm_sums_its_statistics_over_the_batch_ranks():
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    main, dist = _compile(mesh, "dp")
    assert {op.name() for op in main.global_block().ops} >= {"pd_op.batch_norm_", "pd_op.batch_norm_grad"}
    for rank in (0, 1):
        plan = dist.rank_plan(rank)
        assert count(plan, "pd_op.batch_norm_") == count(plan, "pd_op.batch_norm_grad") == 0  # computed by ops
        statistics = [(c.kind, c.reduce, c.group, c.output_shape) for c, _ in plan.collectives]
        assert statistics == [("all_reduce", "sum", (0, 1), (2, CHANNELS))] * 2


def test_a_whole_batch_keeps_the_kernel_and_moves_nothing():
    main, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]), None)
    plan = dist.rank_plan(0)
    assert count(plan, "pd_op.batch_norm_") == 1 and plan.collectives == ()
