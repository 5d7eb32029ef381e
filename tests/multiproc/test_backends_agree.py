"""One truth for all backends: the same programs (RNNs, to_tensor constants after a
collective, collectives reading a feed) through simulate, the host backend (its shared-memory
and its gloo communicator) and the native backend (2 real processes) give bit-equal losses and
parameters."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np, paddle
    import autopar
    from autopar.runtime.replicas import digest
    from autopar.testing.user_programs import build, feeds_for

    def fingerprint(losses, params):
        return digest(np.concatenate([np.ravel(x) for x in losses] + [np.ravel(params[n]) for n in sorted(params)]))

    for case in sys.argv[1:]:
        main, startup, feeds, loss, annotations = build(case)
        mesh = autopar.ProcessMesh([0, 1], ["d"])
        for value, mapping in annotations:
            autopar.shard_tensor(value, mesh, mapping)
        dist = autopar.compile(main, mesh, startup_program=startup)
        steps = feeds_for(feeds)
        prints = {}
        # gloo's host first: its process group must exist before native rings
        for backend, comm in (("host", "gloo"), ("host", "shm"), ("native", "")):
            os.environ["AUTOPAR_HOST_COMM"] = comm
            exe = autopar.Executor(dist, backend=backend)
            assert type(exe.comm).__name__ == {"gloo": "GlooCommunicator", "shm": "SharedMemoryCommunicator", "": "StoreExchange"}[comm]
            exe.run_startup()
            losses = [exe.run(feed, fetch_list=[loss])[0] for feed in steps]
            prints[comm or backend] = fingerprint(losses, exe.parameters())
        sim = autopar.simulate(dist, steps, [loss])
        prints["simulate"] = fingerprint([f[0] for f in sim.fetches], sim.parameters)
        print("RESULT", case, " ".join(f"{k}={v}" for k, v in prints.items()), flush=True)
    """
)


def test_simulate_host_and_native_are_bit_equal(tmp_path):
    cases = ["gru", "lstm", "constant", "feed_collective"]
    lines = [line.split("RESULT ", 1)[1] for line in launch(SCRIPT, 2, tmp_path, cases, timeout=300)]
    assert len(lines) == 2 * len(cases), lines
    for line in lines:
        case, *fields = line.split()
        prints = dict(f.split("=") for f in fields)
        assert prints["gloo"] == prints["shm"] == prints["native"] == prints["simulate"], f"{case}: {prints}"


ALTERNATING = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net

    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    autopar.shard_tensor(net.layers["linear1"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(net.layers["linear2"].weight, mesh, ["mp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup)
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((8, 16)).astype("float32"), "label": rng.integers(0, 10, (8, 1)).astype("int64")}
    for backend in sys.argv[1:]:  # both backends in one launch (a launch costs ~1.5 s a process)
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        for _ in range(3):
            exe.run(feed)
            (loss,) = exe.run(feed, fetch_list=[net.loss])
        print("RESULT", backend, float(loss), flush=True)
    """
)


def test_runs_with_and_without_fetches_alternate(tmp_path):
    """A rank's runners for different fetch lists share its scope but not their transients
    (the host plans' crossing variables once collided: Paddle 'Unsupported setting dims')."""
    backends = ["host", "native"]
    results = launch(ALTERNATING, 2, tmp_path, backends, timeout=240)
    for backend in backends:
        assert sum(f"RESULT {backend} " in line for line in results) == 2, (backend, results)
