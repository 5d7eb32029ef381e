"""Train a DistributedProgram on this rank and compare with the serial run (examples, tests)."""

from __future__ import annotations

from typing import Any

import numpy as np

from autopar.testing.serial import random_feeds, run_serial


def train_and_compare(seed: Any, dist: Any, steps: int = 5, backend: str = "auto", label: str = "", tol: float = 1e-5) -> float:
    """Run ``steps`` steps through autopar.Executor and serially; print and return the max diff.

    Raises SystemExit when losses (every step) or parameters (after the last) differ by more
    than ``tol`` relative to their size, so a launched example fails loudly.
    """
    import autopar

    feeds = random_feeds(seed.feeds, steps)
    exe = autopar.Executor(dist, backend=backend)
    exe.run_startup()
    losses = [exe.run(feed, fetch_list=[seed.loss])[0] for feed in feeds]
    params = exe.parameters()
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    loss_diff = max(float(np.max(np.abs(a - b[0]))) for a, b in zip(losses, serial.fetches))
    param_diff = max(float(np.max(np.abs(params[n] - serial.parameters[n]))) for n in params)
    head = f"rank {exe.rank} {label} ({exe.backend} backend)"
    print(f"{head}: losses {[round(float(x), 5) for x in losses]}")
    print(f"{head}: max |loss - serial| = {loss_diff:.3g}, max |param - serial| = {param_diff:.3g}")
    scale = max(1.0, max(float(np.max(np.abs(v))) for v in serial.parameters.values()))
    if loss_diff > tol * max(1.0, float(np.max(np.abs(losses)))) or param_diff > tol * scale:
        raise SystemExit(f"rank {exe.rank}: distributed run differs from serial")
    return max(loss_diff, param_diff)
