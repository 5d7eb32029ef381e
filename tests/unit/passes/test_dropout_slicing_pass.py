"""passes/dropout_slicing.py: a training dropout on a split input applies exactly its slice of
the serial mask, with no communication (stage: comm-inserted -> dropout-sliced). Read from the
rank program the compile produces, so these hold whichever pass makes it. (Equal to serial:
tests/equivalence/test_dropout.py.)"""

import paddle
from pass_programs import count

import autopar
from autopar.testing.models import make_optimizer


def _compile(dropout):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5  # a dropout needs a fixed seed to be sliced
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        h = paddle.nn.Linear(16, 16)(x)
        h = paddle.nn.functional.dropout(h, 0.3, training=True) if dropout else h
        make_optimizer("sgd").minimize(paddle.mean(paddle.square(h)))
    autopar.shard_tensor(x, mesh, ["dp", None])
    return autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(fuse_allreduce=False))


def test_each_rank_draws_the_serial_mask_and_keeps_its_rows():
    dist = _compile(dropout=True)
    for rank in (0, 1):
        plan = dist.rank_plan(rank)
        (dropout,) = [op for op in plan.program.global_block().ops if op.name() == "pd_op.dropout"]
        assert list(dropout.result(0).shape) == [8, 16]  # the whole step's mask, from the op's seed
        assert count(plan, "pd_op.slice") >= 1  # this rank's rows of it
        (grad,) = [op for op in plan.program.global_block().ops if op.name() == "pd_op.dropout_grad"]
        assert list(grad.result(0).shape) == [4, 16]


def test_dropout_adds_no_collective():
    with_dropout, without = (_compile(dropout=d) for d in (True, False))
    for rank in (0, 1):
        assert [(c.kind, c.shape) for c in with_dropout.comm_ops(rank)] == [
            (c.kind, c.shape) for c in without.comm_ops(rank)
        ]
