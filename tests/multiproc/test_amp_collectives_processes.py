"""Collectives in low precision between real processes (issue 38 item 3): an AMP O2 program's
bfloat16 gradient syncs run by the host backend's gloo and shared-memory communicators give the
simulator's bits (one reduction rule, :mod:`autopar.low_precision`), and the simulator equals
the serial twin; the native form cannot be built on this CPU build and is refused by name."""

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
    from autopar.errors import NativeUnsupported
    from autopar.runtime.replicas import digest
    from autopar.testing.amp import Amp, amp_mlp, assert_twin_equals_serial, twinned
    from autopar.testing.serial import random_feeds

    STRATEGIES = {"bf16": {}, "zero2": {"zero_stage": 2}, "fp32_reduce": {"reduce_dtype": "float32"}}
    amp = Amp("O2", optimizer="sgd")

    def build(a):
        return amp_mlp(a, widths=(8, 16, 16, 4), batch=12)

    def fingerprint(losses, params):
        return digest(np.concatenate([np.ravel(x) for x in losses] + [np.ravel(params[n]) for n in sorted(params)]))

    for case in sys.argv[1:]:
        seed = build(amp)
        mesh = autopar.ProcessMesh([0, 1], ["dp"])
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**STRATEGIES[case]))
        dtypes = sorted({c.dtype for c in dist.comm_ops(0)})
        feeds = random_feeds(seed.feeds, 3, classes=4)
        try:
            dist.rank_plan(0, "native")  # (the plan only: no communicator is made)
            refused = "no"
        except NativeUnsupported as err:
            refused = "yes" if "bfloat16" in str(err) else str(err)
        prints = {}
        for comm in ("gloo", "shm"):  # gloo's process group first (as every multi-backend script)
            os.environ["AUTOPAR_HOST_COMM"] = comm
            start = paddle.get_rng_state()
            exe = autopar.Executor(twinned(dist), backend="host")
            exe.run_startup()
            losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in feeds]
            prints[comm] = fingerprint(losses, exe.parameters())
            paddle.set_rng_state(start)
        start = paddle.get_rng_state()
        sim = autopar.simulate(twinned(dist), feeds, [seed.loss])
        paddle.set_rng_state(start)
        prints["simulate"] = fingerprint([f[0] for f in sim.fetches], sim.parameters)
        assert_twin_equals_serial(build, amp, seed, dist, feeds)
        print("RESULT", case, ",".join(dtypes), f"native_refused={refused}", " ".join(f"{k}={v}" for k, v in prints.items()), flush=True)
    """
)


def test_gloo_and_shared_memory_move_bfloat16_as_the_simulator_does(tmp_path):
    cases = ["bf16", "zero2", "fp32_reduce"]
    lines = [line.split("RESULT ", 1)[1] for line in launch(SCRIPT, 2, tmp_path, cases, timeout=600)]
    assert len(lines) == 2 * len(cases), lines
    dtypes = {"bf16": "bfloat16", "zero2": "bfloat16", "fp32_reduce": "float32"}
    for line in lines:
        case, moved, refused, *fields = line.split()
        prints = dict(f.split("=") for f in fields)
        assert moved == dtypes[case], line
        assert refused == ("native_refused=yes" if moved == "bfloat16" else "native_refused=no"), line
        assert prints["gloo"] == prints["shm"] == prints["simulate"], f"{case}: {prints}"
