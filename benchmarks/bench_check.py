"""``autopar.check`` against ``autopar.simulate``: what comparing every value costs.

For each configuration, after one warm-up run (rank plans built), the median of 5 timed runs of
- ``simulate`` with 1 and with 17 steps (each call starts every rank and builds its interpreters:
  the difference / 16 is the cost of one more step; on these small models a step is a few ms
  and the figure is noisy, so the count of steps is printed only above 1 ms a step);
- ``check`` with 1 step (start-up of both sides, the serial run fetching every value, the
  distributed run exporting every value, the comparison).
Printed: each, the check's time against one ``simulate`` call of one step, and as a number of
simulated steps — the price of asking "where does it first differ" instead of "does the loss".

    .venv/bin/python benchmarks/bench_check.py
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore")

from timing import median_time  # noqa: E402  (benchmarks/timing.py)

import autopar  # noqa: E402
from autopar.testing.catalog import build, feeds  # noqa: E402

CONFIGS = ("gpt dp2xmp2", "gpt mp2 sequence parallel", "residual pp2xmp2 FThenB", "tied lm pp2 ZBH1")
RUNS = 5
LONG = 17


def main() -> None:
    print(f"autopar.check vs autopar.simulate, median of {RUNS} runs after a warm-up")
    print(f"{'configuration':28} {'values':>6} {'simulate 1 step':>16} {'+1 step':>8} {'check 1 step':>13} {'vs simulate':>12} {'in steps':>9}")
    for name in CONFIGS:
        seed, dist = build(name)
        batches = feeds(seed, LONG)
        report = autopar.check(dist, batches[:1])
        assert report.clean, str(report)
        autopar.simulate(dist, batches[:1], [seed.loss])
        one = median_time(lambda: autopar.simulate(dist, batches[:1], [seed.loss]), RUNS)  # noqa: B023 (called right here)
        many = median_time(lambda: autopar.simulate(dist, batches, [seed.loss]), RUNS)  # noqa: B023
        per_step = (many - one) / (LONG - 1)
        checked = median_time(lambda: autopar.check(dist, batches[:1]), RUNS)  # noqa: B023
        print(f"{name:28} {report.compared:6d} {one * 1e3:14.1f}ms {per_step * 1e3:6.1f}ms {checked * 1e3:11.1f}ms "
              f"{checked / one:11.2f}x {f'{checked / per_step:9.1f}' if per_step > 1e-3 else '        -'}")  # fmt: skip


if __name__ == "__main__":
    main()
