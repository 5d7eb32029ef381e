"""Pipeline parallelism as it runs: 2 real processes on CPU (issue 11's benchmark, measured part).

    python benchmarks/bench_pipeline_run.py       # starts itself under autopar.launch --nproc 2

An MLP (1024 -> 2048 -> 2048 -> 2048 -> 10, ReLU, cross-entropy, Momentum), global batch 256,
two stages (two layers each) on two processes, host backend, fetching the loss every step.
Each process computes with one thread (OMP/MKL/OpenBLAS), the serial program too: two devices
against one. Per configuration: the median step time over 6 steps (after 2 warm-up steps), the
speed-up over the same pipeline with one micro-batch (no overlap) and over the serial program on
one process, and from ``Executor.timeline()`` of the last step the measured bubble fraction
(idle time of the two ranks over 2 x the step; waiting in a recv or collective is idle) against (p-1)/(m+p-1), and
the peak number of stashed micro-batches on rank 0 (1F1B: p = 2; FThenB: m).
"""

from __future__ import annotations

import statistics
import time
import warnings

from relaunch import rank_or_relaunch

warnings.filterwarnings("ignore")

WIDTHS = (1024, 2048, 2048, 2048, 10)
BATCH = 256
CONFIGS = (("1F1B", 1), ("FThenB", 8), ("1F1B", 4), ("1F1B", 8), ("ZBH1", 8))
WARMUP, STEPS = 2, 6


def _serial_step(seed, feeds) -> float:
    import paddle

    exe = paddle.static.Executor(paddle.CPUPlace())
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(seed.startup)
        times = []
        for i, feed in enumerate(feeds):
            start = time.perf_counter()
            exe.run(seed.main, feed=feed, fetch_list=[seed.loss])
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(rank: int) -> None:
    import autopar
    from autopar.testing.pipeline_models import staged_mlp
    from autopar.testing.serial import random_feeds

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    rows = []
    serial = None
    for schedule, micro_batches in CONFIGS:
        seed = staged_mlp(mesh, widths=WIDTHS, batch=BATCH)
        feeds = random_feeds(seed.feeds, WARMUP + STEPS, classes=10)
        if serial is None and rank == 0:
            serial = _serial_step(seed, feeds)
        config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        times = []
        for i, feed in enumerate(feeds):
            start = time.perf_counter()
            exe.run(feed, fetch_list=[seed.loss])
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        timeline = exe.timeline()
        rows.append((schedule, micro_batches, statistics.median(times), timeline.bubble_fraction, timeline.peak_stash[0]))
    if rank == 0:
        report(rows, serial)


def report(rows: list[tuple], serial: float) -> None:
    base = rows[0][2]
    print(f"MLP {WIDTHS}, batch {BATCH}, pp=2 on 2 processes (host backend), loss fetched every step")
    print(f"serial program, one process: {serial * 1e3:.1f} ms/step")
    print(f"{'schedule':9} {'m':>2} {'ms/step':>8} {'vs m=1':>7} {'vs serial':>9} {'bubble':>7} {'(p-1)/(m+p-1)':>13} {'stash r0':>8}")
    for schedule, m, step, bubble, stash in rows:
        formula = 1 / (m + 1)
        print(f"{schedule:9} {m:>2} {step * 1e3:>8.1f} {base / step:>6.2f}x {serial / step:>8.2f}x {bubble:>7.1%} {formula:>13.1%} {stash:>8}")


def main() -> None:
    rank = rank_or_relaunch(__file__)
    if rank is not None:
        run(rank)


if __name__ == "__main__":
    main()
