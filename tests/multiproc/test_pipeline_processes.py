"""Pipeline parallelism in two real processes (host backend: gloo p2p for send / recv):
SimpleNet pp=2 with m = 2 and 3 micro-batches, FThenB and 1F1B, Momentum and Adam; losses and
parameters after 3 steps equal serial (rtol 1e-5); the measured timeline of a step holds the
schedule's stash (1F1B: p, FThenB: m) and draws."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.pipeline_models import staged_mlp
    from autopar.testing.serial import random_feeds, run_serial
    from autopar.schedule_timeline import render_svg

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    for schedule, micro_batches, optimizer in [("1F1B", 2, "momentum"), ("1F1B", 3, "adam"), ("FThenB", 3, "momentum"), ("ZBH1", 4, "adam")]:
        seed = staged_mlp(mesh, optimizer=optimizer)
        config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
        feeds = random_feeds(seed.feeds, 3, classes=10)
        serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in feeds]
        params = exe.parameters()
        for (want,), got in zip(serial.fetches, losses):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        timeline = exe.timeline()  # the last step as it ran on both ranks
        assert timeline.peak_stash[0] == (micro_batches if schedule == "FThenB" else min(2, micro_batches))
        assert str(timeline.spans[1][0].action) == "1F0" and 0 < timeline.bubble_fraction < 1
        assert "<svg" in render_svg(timeline)
        print("RESULT", schedule, micro_batches, optimizer, "equal", flush=True)
    """
)


def test_pipeline_in_two_processes_equals_serial(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2", str(script)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len([line for line in out.stdout.splitlines() if "RESULT" in line]) == 2 * 4, out.stdout[-3000:]
