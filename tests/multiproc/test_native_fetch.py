"""The native backend fetches a value split on dim 1 (an mp-sharded activation): backend lowering
replaces that all_gather and the fetch must follow the replacement (it pointed at the erased
op's result: KeyError when the rank plan was built). The host backend fetches the same (its
world collectives run on the scope's tensors)."""

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

    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    hidden = seed.values["linear1"]
    feeds = random_feeds(seed.feeds, 2, classes=10)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss, hidden])
    exe = autopar.Executor(dist, backend=sys.argv[1])
    exe.run_startup()
    for feed, (want_loss, want_hidden) in zip(feeds, serial.fetches):
        loss, got = exe.run(feed, fetch_list=[seed.loss, hidden])
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(got, want_hidden, rtol=1e-5, atol=1e-6)
    print("RESULT equal", flush=True)
    """
)


@pytest.mark.parametrize("backend", ["native", "host"])
def test_fetch_of_a_dim_1_split_value(tmp_path, backend):
    results = launch(SCRIPT, 2, tmp_path, [backend], timeout=300)
    assert sum("RESULT equal" in line for line in results) == 2, results
