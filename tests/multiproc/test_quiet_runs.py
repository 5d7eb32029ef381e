"""Under ``python -m paddle.distributed.launch`` (no GLOG_minloglevel from autopar's launcher) the
Executor keeps Paddle's glog lines out of each rank's log from its creation on: no tcp_store,
"New Executor is Running" or interpreter-mode lines (issue 36, item 3;
autopar/runtime/paddle_log.py). Lines Paddle logs while the user builds the program, before
any autopar call, cannot be stopped after import: the script marks where its Executor starts."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
MARK = "--- executor starts ---"
SCRIPT = textwrap.dedent(f"""
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net

    net = simple_net(batch=8, sizes=(8, 16, 4), optimizer="sgd")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup)
    print({MARK!r}, flush=True)
    exe = autopar.Executor(dist, backend="native")
    exe.run_startup()
    rng = np.random.default_rng(0)
    feed = {{"x": rng.standard_normal((8, 8)).astype("float32"), "label": rng.integers(0, 4, (8, 1)).astype("int64")}}
    loss, = exe.run(feed, fetch_list=[net.loss])
    print("trained", float(loss), flush=True)
""")


def test_executor_under_paddles_launcher_keeps_paddle_quiet(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")} | {"PADDLE_DISTRI_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(tmp_path / "log"), "--nproc_per_node", "2", str(script)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    logs = [log.read_text() for log in sorted((tmp_path / "log").glob("workerlog.*"))]
    assert out.returncode == 0, out.stdout[-2000:] + "".join(log[-2000:] for log in logs)
    assert len(logs) == 2
    for log in logs:
        assert MARK in log and "trained" in log, log[-3000:]
        after = log.split(MARK, 1)[1]
        assert not GLOG_LINE.findall(after), after
