"""Real-process test scaffolding: run a script under ``autopar.launch`` and count its results;
inside the script, train with the Executor and compare with the serial run.

Every multi-process test has the same two halves; they live here once so a test says only what
it runs and what it expects.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def launch(script: str, nproc: int, directory: Path, args: Sequence[str] = (), timeout: float = 600) -> list[str]:
    """Write ``script`` (source text) into ``directory`` and run it under ``python -m
    autopar.launch --nproc nproc`` with ``args``; the ``RESULT`` lines every rank printed. A
    failed launch is an AssertionError with the end of both output streams."""
    path = Path(directory) / "script.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", str(nproc), str(path), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "RESULT" in line]


def train_equals_serial(dist: Any, main: Any, startup: Any, loss: Any, feeds: Sequence[dict], backend: str = "host",
                        rtol: float = 1e-5, atol: float = 1e-6, floor: Mapping[str, float] | None = None) -> Any:  # fmt: skip
    """Run ``feeds`` through an Executor of this process's rank, fetching ``loss`` every step:
    the losses and, after the last step, every parameter equal the serial run's (AssertionError
    naming the step or parameter otherwise). ``floor``: parameter name -> how far serial training
    itself moves it under rounding alone (:func:`reordered_floor`; AdamW normalises a gradient
    that is zero up to rounding into full-size steps); each parameter is then within twice its
    floor, at least ``atol``, instead of ``rtol``. Returns the Executor (its timeline, its state)."""
    import numpy as np

    import autopar
    from autopar.testing.serial import assert_within_floor, run_serial

    serial = run_serial(main, startup, feeds, [loss])
    exe = autopar.Executor(dist, backend=backend)
    exe.run_startup()
    losses = [exe.run(feed, fetch_list=[loss])[0] for feed in feeds]
    params = exe.parameters()
    for step, ((want,), got) in enumerate(zip(serial.fetches, losses)):
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=f"loss at step {step}")
    if floor is not None:
        assert_within_floor({name: params[name] for name in serial.parameters}, serial.parameters, floor, atol)
        return exe
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(params[name], want, rtol=rtol, atol=atol, err_msg=name)
    return exe


def reordered_floor(main: Any, startup: Any, loss: Any, feeds: Sequence[dict], rows: Sequence[int]) -> dict[str, float]:
    """The fp32 floor of serial training: per parameter, how far ``feeds`` moves it from where
    the same feeds with the batch's rows in the order ``rows`` do (the same sums, added in another
    order; ``rows`` must keep what the program treats as a unit together, e.g. a router's groups)."""
    import numpy as np
    import paddle

    from autopar.testing.serial import run_serial

    reordered = [{name: np.asarray(array)[list(rows)] for name, array in feed.items()} for feed in feeds]
    start = paddle.get_rng_state()
    serial = run_serial(main, startup, feeds, [loss])
    paddle.set_rng_state(start)
    other = run_serial(main, startup, reordered, [loss])
    paddle.set_rng_state(start)
    return {name: float(np.max(np.abs(other.parameters[name] - want))) for name, want in serial.parameters.items()}
