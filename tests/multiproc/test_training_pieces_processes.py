"""Issue 10's pieces in two real processes (host backend), equal to serial after 3 steps
(rtol 1e-5): global-norm clipping under dp=2, batch norm over a batch split over dp=2, and
training dropout on an activation split over mp=2. ``Strategy(local_batch_norm=True)`` (per-rank
statistics, not serial) equals the simulator's run of the same plan, running statistics
included."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import paddle
    import autopar
    from autopar.testing.serial import random_feeds, run_serial

    def program(piece):
        paddle.enable_static()
        main, startup = paddle.static.Program(), paddle.static.Program()
        main.random_seed = startup.random_seed = 5
        nn, F = paddle.nn, paddle.nn.functional
        with paddle.static.program_guard(main, startup):
            if piece in ("batch_norm", "local_batch_norm"):
                x = paddle.static.data("x", [8, 3, 8, 8], "float32")
                conv, bn, fc = nn.Conv2D(3, 4, 3, padding=1), nn.BatchNorm2D(4), nn.Linear(4 * 16, 10)
                h = F.max_pool2d(F.relu(bn(conv(x))), 2)
                logits, layers = fc(paddle.flatten(h, 1)), {}
            else:
                x = paddle.static.data("x", [8, 16], "float32")
                layers = {"fc1": nn.Linear(16, 32), "fc2": nn.Linear(32, 10)}
                h = F.relu(layers["fc1"](x))
                if piece == "dropout":
                    h = F.dropout(h, 0.3, training=True)
                logits = layers["fc2"](h)
            label = paddle.static.data("label", [8, 1], "int64")
            loss = paddle.mean(F.cross_entropy(logits, label))
            clip = paddle.nn.ClipGradByGlobalNorm(0.05) if piece == "clip" else None
            paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=clip).minimize(loss)
        return main, startup, {"x": x, "label": label}, loss, layers

    for piece in ("clip", "batch_norm", "dropout", "local_batch_norm"):
        main, startup, feeds, loss, layers = program(piece)
        if piece == "dropout":
            mesh = autopar.ProcessMesh([0, 1], ["mp"])
            autopar.shard_tensor(layers["fc1"].weight, mesh, [None, "mp"])
            autopar.shard_tensor(layers["fc1"].bias, mesh, ["mp"])
            autopar.shard_tensor(layers["fc2"].weight, mesh, ["mp", None])
        else:
            mesh = autopar.ProcessMesh([0, 1], ["dp"])
            autopar.shard_tensor(feeds["x"], mesh, ["dp"] + [None] * (len(feeds["x"].shape) - 1))
        strategy = autopar.Strategy(local_batch_norm=piece == "local_batch_norm")
        dist = autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
        assert not any(c.kind == "all_gather" for c in dist.comm_ops(0)), [str(c) for c in dist.comm_ops(0)]
        steps = random_feeds(feeds, 3, classes=10)
        # per-rank statistics are not serial: the reference is the simulator's run of the same plan
        serial = autopar.simulate(dist, steps, [loss]) if strategy.local_batch_norm else run_serial(main, startup, steps, [loss])
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        losses = [exe.run(feed, fetch_list=[loss])[0] for feed in steps]
        params = exe.parameters()
        for (want,), got in zip(serial.fetches, losses):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        print("RESULT", piece, "equal", flush=True)
    """
)


def test_training_pieces_in_two_processes_equal_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path, timeout=300)
    assert len(results) == 2 * 4, results
