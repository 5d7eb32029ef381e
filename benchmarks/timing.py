"""The benchmarks' timer: the median of repeated runs (a burst of load on the other core hits one)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(run: Callable[[], object], runs: int) -> float:
    """Median seconds of ``runs`` calls of ``run``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
