"""Training dropout on a split input: each rank applies exactly its slice of the serial mask and
nothing moves (issue 10). Equal to serial after 3 steps (rtol 1e-5) under dp=2 and mp=2, with
exactly the collectives of the same program without dropout; and under micro-batching (each
micro-batch its rows of the serial mask; the zoo's models: test_dropout_micro_batches.py)."""

import paddle
import pytest

import autopar
from autopar.testing.models import SeedProgram
from autopar.testing.serial import assert_simulation_equals_serial


def _program(dropout: bool, mesh=None, staged: bool = False):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 11
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        fc1, fc2 = paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 10)

        def first(t):
            h = paddle.nn.functional.relu(fc1(t))
            return paddle.nn.functional.dropout(h, 0.3, training=True) if dropout else h

        h = autopar.shard_op(first, mesh[0])(x) if staged else first(x)
        out = autopar.shard_op(fc2, mesh[1])(h) if staged else fc2(h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(out, label))
        paddle.optimizer.Momentum(0.1, momentum=0.9).minimize(loss)
    return main, startup, {"x": x, "label": label}, loss, (fc1, fc2)


def _annotate(mode, mesh, feeds, layers):
    fc1, fc2 = layers
    if mode == "dp":
        autopar.shard_tensor(feeds["x"], mesh, ["dp", None])
    else:
        autopar.shard_tensor(fc1.weight, mesh, [None, "mp"])
        autopar.shard_tensor(fc1.bias, mesh, ["mp"])
        autopar.shard_tensor(fc2.weight, mesh, ["mp", None])


@pytest.mark.parametrize("mode", ["dp", "mp"])
def test_dropout_on_a_split_input_moves_nothing_and_equals_serial(mode):
    mesh = autopar.ProcessMesh([0, 1], [mode])
    dists = {}
    for dropout in (False, True):
        main, startup, feeds, loss, layers = _program(dropout)
        _annotate(mode, mesh, feeds, layers)
        dists[dropout] = autopar.compile(main, mesh, startup_program=startup)
    kinds = {d: [(c.kind.value, c.bytes) for c in dist.comm_ops(0)] for d, dist in dists.items()}
    assert kinds[True] == kinds[False]  # no all_gather in front of the dropout any more
    assert_simulation_equals_serial(SeedProgram(main, startup, feeds, loss), dists[True])


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_training_dropout_under_micro_batching_equals_serial(micro_batches):
    """Each micro-batch applies its rows of the serial mask (was refused: issue 35, item 8)."""
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    main, startup, feeds, loss, _ = _program(True, mesh, staged=True)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches))
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
    assert_simulation_equals_serial(SeedProgram(main, startup, feeds, loss), dist)
