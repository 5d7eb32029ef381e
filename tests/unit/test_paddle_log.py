"""Paddle's glog lines ("New Executor is Running", "pir interpreter is running by ...") are kept
out of a run outside the launcher too (issue 36, item 3): a simulation in a fresh process, its
stderr read after the program is built, shows none; a user who sets ``GLOG_minloglevel``
gets them (autopar/runtime/paddle_log.py)."""

import os
import re
import subprocess
import sys
import textwrap

GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
MARK = "--- program built ---"
SCRIPT = textwrap.dedent(f"""
    import sys
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net

    net = simple_net(batch=8, sizes=(8, 16, 4), optimizer="sgd")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup)
    print({MARK!r}, file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    feed = {{"x": rng.standard_normal((8, 8)).astype("float32"), "label": rng.integers(0, 4, (8, 1)).astype("int64")}}
    autopar.simulate(dist, [feed], fetch_list=[net.loss])
    print("simulated", file=sys.stderr, flush=True)
""")


def _stderr_after_build(**glog: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")} | glog
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    after = out.stderr.split(MARK, 1)[1]
    assert "simulated" in after, out.stderr[-3000:]
    return after


def test_simulate_keeps_paddle_quiet():
    after = _stderr_after_build()
    assert not GLOG_LINE.findall(after), after


def test_user_glog_level_is_respected():
    after = _stderr_after_build(GLOG_minloglevel="0")
    assert re.search(r"^I\d{4} .*New Executor is Running", after, re.MULTILINE), after
