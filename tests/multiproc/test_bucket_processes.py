"""A gradient bucket moved as its reduce_scatter + all_gather (a 1.5 MiB buffer on 4 processes,
cpu-shm) and ZeRO-2's bucket with the small gradients in it, in real processes on both
backends: losses (the loss riding in the bucket) and parameters after 3 steps equal serial."""

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
        assert stage or dist.state.buckets[0].split
        for backend in ("host", "native"):
            train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3), backend=backend)
            print("RESULT", stage, backend, "equal", flush=True)
    """
)


def test_split_bucket_and_zero_bucket_in_processes_equal_serial(tmp_path):
    results = launch(SCRIPT, 4, tmp_path)
    assert len(results) == 4 * 4, results
