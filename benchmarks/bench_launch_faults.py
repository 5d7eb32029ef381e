"""How the launcher ends a broken job: one fault per row, on the host and the native backend.

    python benchmarks/bench_launch_faults.py [--timeout 5] [--faults raise,exit0,...] [--backends host,native]

Each row starts ``python -m autopar.launch --nproc 2 --timeout T`` on a 2-rank data-parallel
SimpleNet (every step has a gradient all_reduce over [0, 1]) whose rank 1 misbehaves, and
prints the seconds from the start until the launcher exited (for signals also from the
signal), its exit code and its first ``autopar.launch:`` line. ``sigint`` / ``sigterm`` /
``sigkill-launcher`` signal the launcher itself while rank 0 waits in a collective for rank 1
(a --timeout of 60 keeps the job alive until the signal); for ``sigkill-launcher`` the line
says which ranks were still alive 3 s later. tests/multiproc/test_faults.py runs the same
faults through :func:`run_fault` and asserts on the outcome.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# rank 1 misbehaves at the point its fault names; every rank writes its pid first and prints
# "MARK <what>" lines the signal cases wait for
RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, warnings
    warnings.filterwarnings("ignore")
    fault, backend = sys.argv[1], sys.argv[2]
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    faulty = rank == 1

    def mark(text):
        print(f"MARK {text}", flush=True)

    if faulty and fault == "hang_before_executor":
        mark("hanging"); time.sleep(600)
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds
    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup)
    exe = autopar.Executor(dist, backend=backend)
    exe.run_startup()
    feed = random_feeds(net.feeds, 1)[0]
    if faulty and fault == "raise":
        raise RuntimeError("injected fault on rank 1")
    if faulty and fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if faulty and fault == "exit0":
        sys.exit(0)
    if faulty and fault == "hang_collective":
        mark("hanging"); time.sleep(600)
    if not faulty:
        mark("stepping")
    exe.run(feed, fetch_list=[net.loss])
    if faulty and fault == "hang_exchange":
        mark("hanging"); time.sleep(600)
    exe.parameters()
    mark("done")
    """
)

# fault -> (rank-script fault, how the launcher is treated)
FAULTS = {
    "raise": ("raise", None),
    "sigkill-rank": ("sigkill", None),
    "exit0": ("exit0", None),
    "hang-before-executor": ("hang_before_executor", None),
    "hang-collective": ("hang_collective", None),
    "hang-exchange": ("hang_exchange", None),
    "sigint": ("hang_collective", signal.SIGINT),
    "sigterm": ("hang_collective", signal.SIGTERM),
    "sigkill-launcher": ("hang_collective", signal.SIGKILL),
}


@dataclass
class Outcome:
    """One launch: exit code, seconds to exit, output, and the ranks still alive afterwards."""

    code: int
    seconds: float
    stdout: str
    survivors: list[int] = field(default_factory=list)
    after_signal: float | None = None  # seconds from the signal to the launcher's exit

    @property
    def first_line(self) -> str:
        return next((line for line in self.stdout.splitlines() if line.startswith("autopar.launch:")), "")

    @property
    def launcher_lines(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith("autopar.launch:")]


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def run_fault(fault: str, backend: str, timeout: float = 5.0, workdir: Path | None = None) -> Outcome:
    """Launch the 2-rank job with ``fault`` on ``backend``; signal faults signal the launcher
    once rank 0 waits for rank 1, then look for surviving ranks 3 s later."""
    script_fault, launcher_signal = FAULTS[fault]
    workdir = Path(workdir or tempfile.mkdtemp(prefix="autopar-fault-"))
    script = workdir / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    limit = 60.0 if launcher_signal is not None else timeout
    launcher = [sys.executable, "-m", "autopar.launch", "--nproc", "2", "--timeout", str(limit)]
    cmd = [*launcher, str(script), script_fault, backend]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=_read, args=(proc, lines, ready), daemon=True)
    reader.start()
    signalled = None
    if launcher_signal is not None:
        ready.wait(120)
        time.sleep(1.0)  # rank 0 is inside the collective by now
        os.kill(proc.pid, launcher_signal)
        signalled = time.monotonic()
    code = proc.wait(timeout=180)
    end = time.monotonic()
    reader.join(timeout=5)
    if launcher_signal == signal.SIGKILL:
        time.sleep(3.0)
    pids = {r: int((workdir / f"pid{r}").read_text()) for r in range(2) if (workdir / f"pid{r}").exists()}
    survivors = [r for r, pid in pids.items() if alive(pid)]
    return Outcome(code, end - start, "".join(lines), survivors, None if signalled is None else end - signalled)


def _read(proc: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    """Collects the launcher's output; ``ready`` once rank 0 steps and rank 1 hangs."""
    seen: set[str] = set()
    for line in proc.stdout:
        lines.append(line)
        if "MARK stepping" in line or "MARK hanging" in line:
            seen.add(line.split("MARK ")[1].strip())
            if {"stepping", "hanging"} <= seen:
                ready.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--backends", default="host,native")
    args = parser.parse_args()
    rows = []
    for fault in args.faults.split(","):
        for backend in args.backends.split(","):
            with tempfile.TemporaryDirectory(prefix="autopar-fault-") as workdir:
                outcome = run_fault(fault, backend, args.timeout, Path(workdir))
            survivors = (
                f" [ranks alive 3 s later: {outcome.survivors or 'none'}]" if fault == "sigkill-launcher" else ""
            )
            line = (outcome.first_line or "(none)") + survivors
            seconds = f"{outcome.seconds:.1f}"
            if outcome.after_signal is not None:
                seconds += f" ({outcome.after_signal:.1f} after signal)"
            rows.append((fault, backend, seconds, str(outcome.code), line))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    header = ("fault", "backend", "seconds", "exit", f"first launcher line (--timeout {args.timeout:g})")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4])


if __name__ == "__main__":
    main()
