"""ZeRO 1 / 2 / 3 x (Momentum, Adam) on dp=2 in two real processes, on the host and the
native backend: losses and parameters after 3 steps equal serial (rtol 1e-5); native with
even shards (it gathers even pieces only), host with an uneven one (33 rows over 2)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    for case in sys.argv[1:]:  # both backends in one launch (a launch costs ~1.5 s a process)
        backend, hidden = case.split(":")[0], int(case.split(":")[1])
        for stage in (1, 2, 3):
            for optimizer in ("momentum", "adam"):
                seed = simple_net(batch=8, sizes=(16, hidden, 16, 10), optimizer=optimizer)
                mesh = autopar.ProcessMesh([0, 1], ["dp"])
                autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
                strategy = autopar.Strategy(zero_stage=stage)
                dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
                feeds = random_feeds(seed.feeds, 3, classes=10)
                train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds, backend)
                print("RESULT", backend, stage, optimizer, "equal", flush=True)
    """
)


def test_zero_in_two_processes_equals_serial(tmp_path):
    cases = [("host", 33), ("native", 32)]
    results = launch(SCRIPT, 2, tmp_path, [f"{backend}:{hidden}" for backend, hidden in cases])
    for backend, _ in cases:
        assert sum(f"RESULT {backend} " in line for line in results) == 2 * 3 * 2, (backend, results)
