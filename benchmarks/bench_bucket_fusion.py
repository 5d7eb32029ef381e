"""A dp=4 step's gradient sync as fusion decides it against the other ways to move it, measured
(issue 36 item 1): 4 processes (the host backend: shared memory on one machine), an MLP with a
1 MiB weight whose gradient alone the cpu-shm profile prices cheapest as reduce_scatter +
all_gather, 150 steps fetching the loss, each way in turn (median and lower quartile, ms):

- ``bucket``: what compile does — every gradient in one all_reduce, the loss riding in it;
- ``apart``: the bucket without the gradients whose own plan is the decomposed all_reduce
  (each its own reduce_scatter + all_gather beside it: before issue 36).

Measured on the 2-core machine (load ~1-2 from other jobs), 3 alternating runs: bucket
7.3-7.7 ms, apart 8.0-9.0 ms; with 1024-1024-1024-10, 25-27.5 against 27-29 ms. The whole
bucket as a reduce_scatter + all_gather of its buffer, which the profile prices cheapest, was
the slowest: 9.8-11.7 and 38-42 ms (a version of allreduce_fusion.py that did it, since removed).

    .venv/bin/python benchmarks/bench_bucket_fusion.py   # starts itself under autopar.launch
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

from relaunch import rank_or_relaunch  # noqa: E402

WIDTHS = (512, 512, 256, 10)
STEPS = 150


def step_ms(way: str) -> tuple[list[str], float, float]:
    import numpy as np

    import autopar
    from autopar.passes import allreduce_fusion
    from autopar.testing.models import mlp
    from autopar.testing.serial import random_feeds

    decomposes = allreduce_fusion.decomposes
    if way == "apart":
        allreduce_fusion.decomposes = lambda plan, all_reduce: False
    seed = mlp(16, WIDTHS)
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    allreduce_fusion.decomposes = decomposes
    exe = autopar.Executor(dist, check_every=None)
    exe.run_startup()
    feeds = random_feeds(seed.feeds, 4)
    for feed in feeds[:2]:
        exe.run(feed, fetch_list=[seed.loss])
    times = []
    for i in range(STEPS):
        start = time.perf_counter()
        exe.run(feeds[i % 4], fetch_list=[seed.loss])
        times.append(time.perf_counter() - start)
    kinds = [c.kind.value for c, _ in dist.rank_plan(exe.rank, fetches=[seed.loss]).collectives]
    return kinds, float(np.median(times)) * 1e3, float(np.percentile(times, 25)) * 1e3


def main() -> None:
    if rank_or_relaunch(__file__, nproc=4) is None:
        return
    print(f"MLP {'-'.join(map(str, WIDTHS))}, dp=4, host backend, {STEPS} steps fetching the loss")
    for way in ("bucket", "apart", "bucket", "apart", "bucket", "apart"):
        kinds, median, quartile = step_ms(way)
        print(f"{way:<7} {median:6.2f} ms (p25 {quartile:5.2f})  {' + '.join(kinds)}", flush=True)


if __name__ == "__main__":
    main()
