"""Long runs do not grow: 2 processes train for ``--steps`` steps fetching the loss every step,
on the host and the native backend, and rank 0 prints its resident memory at step 500 and at
the end (each the lowest of 4 marks 250 steps apart). Target: growth < 512 KiB (fetches are made whole inside the program, so nothing is
stored per step; before, every step's fetched bytes stayed in the job's TCP store).

Also printed: the malloc heap in use (glibc's ``mallinfo2``: bytes handed out and not freed)
and Python's allocated blocks (``sys.getallocatedblocks``: objects and buffers Python holds).
Resident memory can grow while the heap in use stays flat — freed memory the allocator keeps,
and more of it when a loaded machine delays the frees of Paddle's threads —
so the two together tell a leak (both grow) from a heap that fragments (only the first does).
tests/multiproc/test_long_run.py bounds the heap in use and the Python blocks (what the code
controls) and only grossly the resident memory.
The Executor gives the free heap back every 1000 steps (``malloc_trim``; without it a 0.7 ms
host step grew 1-1.8 MB over 4500 steps with the heap in use flat).

    .venv/bin/python benchmarks/bench_long_run.py [--steps 5000] [--backend host]   # starts itself under autopar.launch
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_in_use_kib() -> int | None:
    """glibc's malloc heap in use (small and mmapped blocks), or None without glibc >= 2.33."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) // 1024


def run(backend: str, steps: int) -> None:
    import numpy as np

    import autopar
    from autopar.testing.models import simple_net

    net = simple_net(batch=16, sizes=(32, 64, 32, 10), optimizer="sgd")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup)
    exe = autopar.Executor(dist, backend=backend)
    exe.run_startup()
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((16, 32)).astype("float32"), "label": rng.integers(0, 10, (16, 1)).astype("int64")}
    marks, start = {}, time.perf_counter()
    for step in range(1, steps + 1):
        exe.run(feed, fetch_list=[net.loss])
        if step >= 500 and step % 250 == 0 or step == steps:
            marks[step] = resident_kib(), heap_in_use_kib(), sys.getallocatedblocks()
    seconds = time.perf_counter() - start
    if exe.rank == 0:
        (rss, heap, blocks), (rss_end, heap_end, blocks_end) = _low(marks, 500), _low(marks, steps)
        growth = rss_end - rss
        heap_text = f"; heap in use {heap} -> {heap_end} KiB ({heap_end - heap:+d} KiB)" if heap is not None else ""
        print(f"{backend:6s} {steps} steps fetching the loss, {seconds / steps * 1e3:.2f} ms/step: rank 0 RSS "
              f"{rss} KiB at step 500, {rss_end} KiB at step {steps}: growth {growth} KiB "
              f"({growth * 1024 / (steps - 500):.1f} B/step; target < 512 KiB){heap_text}; "
              f"Python blocks {blocks} -> {blocks_end} ({blocks_end - blocks:+d})", flush=True)  # fmt: skip


def _low(marks: dict[int, tuple[int, int | None, int]], at: int) -> tuple[int, int | None, int]:
    """The lowest resident memory, heap in use and Python blocks of the 4 marks from ``at`` on
    (or up to it, at the end): what a step keeps, without what was in flight when one mark was
    taken (the heap in use of single marks varied by +-80 KiB, once +490 KiB, between runs of
    no growth)."""
    window = sorted(marks)
    window = window[:4] if at == window[0] else window[-4:]
    heaps = [marks[m][1] for m in window]
    return (
        min(marks[m][0] for m in window),
        None if None in heaps else min(heaps),
        min(marks[m][2] for m in window),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--backend", choices=["host", "native"], default=None)
    args = parser.parse_args()
    if "PADDLE_TRAINER_ID" not in os.environ:
        root = Path(__file__).resolve().parents[1]
        for backend in [args.backend] if args.backend else ["host", "native"]:  # one job per backend: each starts fresh
            cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2", __file__, "--steps", str(args.steps), "--backend", backend]
            if subprocess.call(cmd, cwd=root):
                sys.exit(f"the {backend} run failed")
        return
    run(args.backend, args.steps)


if __name__ == "__main__":
    main()
