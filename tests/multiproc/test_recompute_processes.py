"""Selective recompute in two real processes: the 2-layer GPT block (dropout in attention and
after the MLP) under tensor parallelism (mp=2), attention's softmax + dropout recomputed on the
host backend and whole layers on the native one, equal to serial after 3 steps (rtol 1e-5)."""

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
    from autopar.testing.models import annotate_megatron, gpt_block_program
    from autopar.testing.serial import random_feeds, run_serial

    for selection, backend in ((("softmax", "dropout"), "host"), (("TransformerLayer*",), "native")):
        seed = gpt_block_program(batch=4, seq=4, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum",
                                 dropout=0.1, layer_calls=True)
        mesh = autopar.ProcessMesh([0, 1], ["mp"])
        annotate_megatron(seed, mesh)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                               strategy=autopar.Strategy(recompute=selection))
        assert dist.state.recompute.dropped
        steps = random_feeds(seed.feeds, 3, classes=32)
        serial = run_serial(seed.main, seed.startup, steps, [seed.loss])
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in steps]
        params = exe.parameters()
        for (want,), got in zip(serial.fetches, losses):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        print("RESULT", selection, backend, "equal", flush=True)
    """
)


def test_recompute_under_tensor_parallel_in_two_processes_equals_serial(tmp_path):
    script = tmp_path / "recompute.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "autopar.launch", "--nproc", "2", str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("RESULT") == 2 * 2, out.stdout[-3000:]
