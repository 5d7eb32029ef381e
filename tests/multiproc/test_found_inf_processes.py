"""An overflow in one rank's piece of a gradient, in two real processes: tensor parallelism
(only rank 1 holds the overflowing columns; the flag is all-reduced with max over mp) and a
2-stage pipeline (only stage 0 overflows; the stages agree at the SYNC point), on the host
backend, and mp on the native one too (a pipeline runs on the host backend only).
Every rank skips the overflowing step (its parameters after it equal those before it), the loss
scale each step runs with equals serial's (halved after the overflow), and losses and
parameters equal serial (rtol 1e-5)."""

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
    from autopar.testing.overflow import probed_feeds, probed_mlp
    from autopar.testing.serial import run_serial

    OVERFLOW_AT = 2
    for item in sys.argv[1:]:
        backend, case = item.split(":")
        if case == "mp":
            mesh = autopar.ProcessMesh([0, 1], ["mp"])
            seed = probed_mlp()
            autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
            autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
            autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
            strategy = None
        else:
            mesh = autopar.ProcessMesh([0, 1], ["pp"])
            seed = probed_mlp(stages=mesh)
            strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        feeds = probed_feeds(seed, 5, OVERFLOW_AT)
        fetch = [seed.loss, seed.values["scaled"]]
        serial = run_serial(seed.main, seed.startup, feeds, fetch)
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        got, params = [], []
        for feed in feeds:
            got.append(exe.run(feed, fetch_list=fetch))
            params.append(exe.parameters())
        scales = lambda fetches: [float(np.ravel(s)[0] / np.ravel(l)[0]) for l, s in fetches]  # noqa: E731
        assert scales(got) == scales(serial.fetches), (scales(got), scales(serial.fetches))
        assert scales(got)[OVERFLOW_AT + 1] == scales(got)[OVERFLOW_AT] / 2
        for name, value in params[OVERFLOW_AT - 1].items():
            np.testing.assert_array_equal(params[OVERFLOW_AT][name], value, err_msg=name)
        for step, ((want, _), (loss, _)) in enumerate(zip(serial.fetches, got)):
            np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=f"loss at step {step}")
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(params[-1][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        print("RESULT", backend, case, "skipped together", flush=True)
    """
)


def test_an_overflow_on_one_process_is_skipped_by_both(tmp_path):
    """One launch: host mp, host pp, then native mp (a gloo host group exists before the
    native rings); every rank prints its line for each."""
    items = ("host:mp", "host:pp", "native:mp")
    results = launch(SCRIPT, 2, tmp_path, list(items))
    for item in items:
        backend, case = item.split(":")
        assert sum(f"RESULT {backend} {case} skipped together" in line for line in results) == 2, results
