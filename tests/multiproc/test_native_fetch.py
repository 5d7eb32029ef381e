"""Fetches in real processes.

The native backend fetches a value split on dim 1 (an mp-sharded activation): backend lowering
replaces that all_gather and the fetch must follow the replacement (it pointed at the erased
op's result: KeyError when the rank plan was built). The host backend fetches the same (its
world collectives run on the scope's tensors).

A user's data-parallel loop fetching its loss, an accuracy and a hidden value every step (odd
sizes, LayerNorm, Momentum): the accuracy's pieces are averages, whose all_reduce(avg) gloo
lacks — the native step failed with "Unsupported reduce type: 4" before it was lowered to a
sum and a scale. With an odd batch (5 rows on dp=2) the program needs uneven gathers, which the
native program cannot run: ``backend="auto"`` (the default) picks the host backend (it picked
native and failed "gathers uneven pieces"); where only a fetch is uneven, the native backend
exchanges its pieces instead of gathering them in the program."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds, run_serial

    for backend in sys.argv[1:]:  # every backend in one launch (a launch costs ~1.5 s a process)
        seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
        mesh = autopar.ProcessMesh([0, 1], ["mp"])
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
        hidden = seed.values["linear1"]
        feeds = random_feeds(seed.feeds, 2, classes=10)
        serial = run_serial(seed.main, seed.startup, feeds, [seed.loss, hidden])
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        for feed, (want_loss, want_hidden) in zip(feeds, serial.fetches):
            loss, got = exe.run(feed, fetch_list=[seed.loss, hidden])
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
            np.testing.assert_allclose(got, want_hidden, rtol=1e-5, atol=1e-6)
        print("RESULT equal", backend, flush=True)
    """
)


def test_fetch_of_a_dim_1_split_value(tmp_path):
    backends = ["host", "native"]  # host first: a gloo host communicator needs its group before native rings
    results = launch(SCRIPT, 2, tmp_path, backends, timeout=300)
    for backend in backends:
        assert sum(line.endswith(f"RESULT equal {backend}") for line in results) == 2, (backend, results)


AVERAGE_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np, paddle
    import autopar
    from autopar.testing.serial import run_serial

    def check(backend, batch):
        paddle.enable_static()
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [batch, 7], "float32")
            y = paddle.static.data("y", [batch, 1], "int64")
            hidden = paddle.tanh(paddle.nn.Linear(7, 10)(x))
            logits = paddle.nn.Linear(10, 5)(paddle.nn.LayerNorm(10)(hidden))
            loss = paddle.nn.functional.cross_entropy(logits, y).mean()
            acc = paddle.static.accuracy(paddle.nn.functional.softmax(logits), y)
            autopar.keep(acc)  # fetched, read by nothing
            paddle.optimizer.Momentum(0.05, momentum=0.8).minimize(loss)
        mesh = autopar.ProcessMesh([0, 1], ["dp"])
        autopar.shard_tensor(x, mesh, ["dp", None])
        dist = autopar.compile(main, mesh, startup_program=startup)
        rng = np.random.default_rng(7)
        feeds = [{"x": rng.standard_normal((batch, 7)).astype("float32"), "y": rng.integers(0, 5, (batch, 1)).astype("int64")} for _ in range(4)]
        paddle.seed(11)
        serial = run_serial(main, startup, feeds, [loss, acc, hidden])
        paddle.seed(11)
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        for step, (feed, want) in enumerate(zip(feeds, serial.fetches)):
            for got, wanted in zip(exe.run(feed, fetch_list=[loss, acc, hidden]), want):
                np.testing.assert_allclose(got, wanted, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        assert len({float(w[1]) for w in serial.fetches}) > 1  # the accuracy changes: a real average each step
        print("RESULT equal", backend, batch, exe.backend, flush=True)

    for case in sys.argv[1:]:  # every case in one launch (a launch costs ~1.5 s a process)
        backend, batch = case.split(":")
        check(backend, int(batch))
    """
)


def test_fetch_of_an_average_every_step(tmp_path):
    cases = [("host", 6, "host"), ("auto", 5, "host"), ("native", 6, "native")]  # backend asked, batch, backend run; host first
    results = launch(AVERAGE_SCRIPT, 2, tmp_path, [f"{backend}:{batch}" for backend, batch, _ in cases], timeout=300)
    for backend, batch, ran in cases:
        assert sum(line.endswith(f"RESULT equal {backend} {batch} {ran}") for line in results) == 2, (backend, results)


UNEVEN_FETCH = textwrap.dedent(
    """
    import os, warnings
    warnings.filterwarnings("ignore")
    import numpy as np, paddle
    import autopar
    from autopar.testing.serial import run_serial

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [5, 10], "float32")
        y = paddle.static.data("y", [5, 1], "int64")
        logits = paddle.nn.Linear(10, 7)(x)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        paddle.optimizer.SGD(0.1).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((5, 10)).astype("float32"), "y": rng.integers(0, 7, (5, 1)).astype("int64")} for _ in range(3)]
    paddle.seed(3)
    serial = run_serial(main, startup, feeds, [loss, logits])
    paddle.seed(3)
    os.environ["AUTOPAR_HOST_COMM"] = "gloo"  # as CPU ranks on several hosts: auto picks native for dp
    exe = autopar.Executor(dist)
    exe.run_startup()
    for feed, want in zip(feeds, serial.fetches):
        for got, wanted in zip(exe.run(feed, fetch_list=[loss, logits]), want):
            np.testing.assert_allclose(got, wanted, rtol=1e-5, atol=1e-6)
    print("RESULT equal", exe.backend, flush=True)
    """
)


def test_native_exchanges_a_fetch_it_cannot_gather(tmp_path):
    """Batch 5 on dp=2, ranks as on several hosts (no shared memory): auto runs the step
    natively (its gradients' all_reduces are even); the fetched logits' pieces (3 and 2 rows)
    are exchanged and assembled."""
    results = launch(UNEVEN_FETCH, 2, tmp_path, timeout=300)
    assert sum("RESULT equal native" in line for line in results) == 2, results
