"""Real processes without any seeding: every rank starts from rank 0's generator state, so
replicated copies are bit-identical (check_replicas) and the parameters equal a serial
start-up run from that state — on the host and the native backend."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np, paddle
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds, run_serial

    backend = sys.argv[1]
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10), optimizer="sgd", seed=0)  # no program.random_seed
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    exe = autopar.Executor(dist, backend=backend)
    mine = paddle.get_rng_state()  # unseeded: each process has its own
    exe.run_startup()
    exe.check_replicas()
    feeds = random_feeds(seed.feeds, 3)
    losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in feeds]
    params = exe.parameters()
    exe.check_replicas()
    start = exe.comm.all_gather_object(mine)
    own_differs = any(not np.array_equal(a.current_seed(), b.current_seed()) for a, b in zip(start[0], start[1]))
    paddle.set_rng_state(start[0])
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    worst = max(float(np.max(np.abs(params[n] - v))) for n, v in serial.parameters.items())
    loss = max(abs(float(a) - float(b[0])) for a, b in zip(losses, serial.fetches))
    print(f"RESULT backend={exe.backend} own_states_differ={own_differs} param_diff={worst:.3g} loss_diff={loss:.3g}")
    """
)


@pytest.mark.parametrize("backend", ["host", "native"])
def test_unseeded_ranks_start_alike_and_equal_serial(tmp_path, backend):
    results = [line.split("RESULT ", 1)[1] for line in launch(SCRIPT, 2, tmp_path, [backend], timeout=240)]
    assert len(results) == 2, results
    for line in results:
        fields = dict(item.split("=") for item in line.split())
        assert fields["backend"] == backend
        assert fields["own_states_differ"] == "True"  # the processes really started unseeded
        assert float(fields["param_diff"]) < 1e-5 and float(fields["loss_diff"]) < 1e-5, line
