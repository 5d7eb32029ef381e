"""ZeRO 1 / 2 / 3 x (Momentum, Adam) on dp=2 in two real processes, on the host and the
native backend: losses and parameters after 3 steps equal serial (rtol 1e-5); native with
even shards (it gathers even pieces only), host with an uneven one (33 rows over 2)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds, run_serial

    backend, hidden = sys.argv[1], int(sys.argv[2])
    for stage in (1, 2, 3):
        for optimizer in ("momentum", "adam"):
            seed = simple_net(batch=8, sizes=(16, hidden, 16, 10), optimizer=optimizer)
            mesh = autopar.ProcessMesh([0, 1], ["dp"])
            autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
            strategy = autopar.Strategy(zero_stage=stage)
            dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
            feeds = random_feeds(seed.feeds, 3, classes=10)
            serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
            exe = autopar.Executor(dist, backend=backend)
            exe.run_startup()
            losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in feeds]
            params = exe.parameters()
            for (want,), got in zip(serial.fetches, losses):
                np.testing.assert_allclose(got, want, rtol=1e-5)
            for name, want in serial.parameters.items():
                np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
            print("RESULT", backend, stage, optimizer, "equal", flush=True)
    """
)


@pytest.mark.parametrize(("backend", "hidden"), [("host", 33), ("native", 32)])
def test_zero_in_two_processes_equals_serial(tmp_path, backend, hidden):
    script = tmp_path / "zero.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2", str(script), backend, str(hidden)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = [line for line in out.stdout.splitlines() if "RESULT" in line]
    assert len(results) == 2 * 3 * 2, out.stdout[-3000:]
