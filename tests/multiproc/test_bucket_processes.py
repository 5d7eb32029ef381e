"""The dp bucket holding every gradient (a 1 MiB one whose own plan is reduce_scatter +
all_gather included) and ZeRO-2's buckets with the small gradients and the loss in them, in 4
real processes on both backends: losses and parameters after 3 steps equal serial."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.models import mlp
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    for stage in (0, 2):
        seed = mlp(16, (512, 512, 256, 10))
        mesh = autopar.ProcessMesh([0, 1, 2, 3], ["dp"])
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=stage))
        for backend in ("host", "native"):
            train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3), backend=backend)
            print("RESULT", stage, backend, "equal", flush=True)
    """
)


def test_buckets_holding_every_gradient_in_processes_equal_serial(tmp_path):
    results = launch(SCRIPT, 4, tmp_path)
    assert len(results) == 4 * 4, results
