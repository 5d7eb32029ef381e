"""Benchmarks that measure real processes start themselves under ``autopar.launch``: the first
run relaunches the script on ``nproc`` processes (one compute thread each: one core per
process, like one device each) and prints what rank 0 printed."""

from __future__ import annotations

import os
import subprocess
import sys

THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def rank_or_relaunch(script: str, nproc: int = 2) -> int | None:
    """This process's rank when launched; otherwise relaunch ``script`` and return None."""
    if "PADDLE_TRAINER_ID" in os.environ:
        return int(os.environ["PADDLE_TRAINER_ID"])
    for name in THREADS:
        os.environ[name] = "1"
    out = subprocess.run([sys.executable, "-m", "autopar.launch", "--nproc", str(nproc), script], capture_output=True, text=True)
    lines = [line.split("] ", 1)[-1] for line in out.stdout.splitlines() if line.startswith("[rank 0]")]
    print("\n".join(line for line in lines if not line.startswith(("W", "I", "=", "FLAGS"))))
    if out.returncode:
        print(out.stdout[-2000:], out.stderr[-2000:])
        raise SystemExit(out.returncode)
    return None
