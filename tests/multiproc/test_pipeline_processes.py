"""Pipeline parallelism in two real processes (host backend; send / recv over sockets):
an MLP pp=2 with m = 2, 3, 4 micro-batches for FThenB, 1F1B and ZB-H1, m = 2, 4 for interleaved
1F1B (two virtual stages per rank), Momentum and Adam; losses and
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
    configs = [(s, m, o) for s in ("FThenB", "1F1B", "ZBH1") for m in (2, 3, 4) for o in ("momentum", "adam")]
    configs += [("Interleaved1F1B", m, o) for m in (2, 4) for o in ("momentum", "adam")]
    for schedule, micro_batches, optimizer in configs:
        placement = (0, 1, 0, 1) if schedule == "Interleaved1F1B" else None
        seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10), optimizer=optimizer, placement=placement)
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
        if schedule in ("FThenB", "1F1B"):
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
    assert len([line for line in out.stdout.splitlines() if "RESULT" in line]) == 2 * 22, out.stdout[-3000:]
