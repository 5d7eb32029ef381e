"""The benchmarks' timer: the median of repeated runs (a burst of load on the other core hits one),
each started from a collected heap (the collector stays on during a run: what the run's own
garbage costs is counted, what an earlier measurement left is not)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def median_time(run: Callable[[], object], runs: int) -> float:
    """Median seconds of ``runs`` calls of ``run``."""
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_simulated_step(dist: object, feeds: list, fetch_list: list) -> float:
    """Median seconds of one ``autopar.simulate`` step of ``dist`` over ``feeds[1:]``, after a
    first step on ``feeds[0]`` (which builds the rank programs: not a step's cost)."""
    from autopar.runtime.simulator import simulate

    simulate(dist, feeds[:1], fetch_list)
    times = []
    for feed in feeds[1:]:
        start = time.perf_counter()
        simulate(dist, [feed], fetch_list)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
