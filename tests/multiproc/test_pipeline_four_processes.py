"""Pipeline with data or tensor parallelism inside the stages on 4 real processes (host
backend): pp=2 x dp=2 and pp=2 x mp=2, 3 micro-batches, equal to serial after 3 steps. A stage's
collectives run among its own ranks over the p2p links (the world exchange cannot serve them
while the other stage runs other jobs)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings; warnings.filterwarnings("ignore")
    import numpy as np, autopar
    from autopar.testing.pipeline_models import staged_mlp
    from autopar.testing.serial import random_feeds, run_serial
    for mode in ("dp", "mp"):
        mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", mode])
        seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10))
        if mode == "dp":
            autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
        else:
            for name, stage, mapping in (("linear1", 0, [None, "mp"]), ("linear2", 0, ["mp", None]), ("linear3", 1, [None, "mp"]), ("linear4", 1, ["mp", None])):
                autopar.shard_tensor(seed.layers[name].weight, mesh[stage], mapping)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=3)))
        feeds = random_feeds(seed.feeds, 3, classes=10)
        serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        losses = [exe.run(f, fetch_list=[seed.loss])[0] for f in feeds]
        params = exe.parameters()
        for (w,), g in zip(serial.fetches, losses): np.testing.assert_allclose(g, w, rtol=1e-5)
        for k, w in serial.parameters.items(): np.testing.assert_allclose(params[k], w, rtol=1e-5, atol=1e-6, err_msg=k)
        print("RESULT pp x", mode, "equal", flush=True)
    """
)


def test_pipeline_with_dp_or_mp_inside_stages_on_four_processes(tmp_path):
    script = tmp_path / "pp4.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "autopar.launch", "--nproc", "4", str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("RESULT") == 4 * 2, out.stdout[-3000:]
