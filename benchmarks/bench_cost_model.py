"""Measured vs predicted collective times on this machine (gloo, 2 and 4 processes).

Each world size runs one set of worker processes that time every collective on two disjoint
size sets: the calibration sizes (6 KiB x 4^k up to 96 MiB, what ``python -m autopar.cost_model.calibrate``
uses) and the evaluation sizes (4 KiB x 4^k up to 64 MiB). The profile is fitted on the
calibration samples only; the table compares its predictions with the evaluation samples and
prints the mean absolute percentage error, over all sizes and over sizes >= 1 MiB (target:
<= 25%). reduce_scatter and all_to_all run as their gloo emulations (all_reduce / all_gather
plus a slice) and are predicted as such; send/recv is timed between 2 processes only.

    python benchmarks/bench_cost_model.py
"""

from __future__ import annotations

import time

from autopar.cost_model.calibrate import CALIBRATION_SIZES, EMULATED, MEASURED, build_profile, measure
from autopar.cost_model.comm import collective_time
from autopar.cost_model.planner import format_bytes, format_time

EVALUATION_SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB ... 64 MiB
KINDS = MEASURED[:3] + EMULATED + ("send_recv",)


def main() -> None:
    start = time.perf_counter()
    worlds = (2, 4)
    assert not set(CALIBRATION_SIZES) & set(EVALUATION_SIZES)
    samples = []
    for world in worlds:
        kinds = [k for k in MEASURED if k != "send_recv" or world == 2]
        samples += measure(world, sorted(CALIBRATION_SIZES + EVALUATION_SIZES), kinds)
        samples += measure(world, EVALUATION_SIZES, EMULATED)
    calibration = [s for s in samples if s.nbytes in CALIBRATION_SIZES]
    cluster = build_profile(calibration, worlds, CALIBRATION_SIZES)
    rows = []
    print(f"{'collective':>15} {'procs':>5} {'size':>10} {'measured':>10} {'predicted':>10} {'error':>7}")
    order = {kind: i for i, kind in enumerate(KINDS)}
    for s in sorted(samples, key=lambda s: (s.world, order[s.kind], s.nbytes)):
        if s.nbytes not in EVALUATION_SIZES:
            continue
        group = (0, 1) if s.kind == "send_recv" else tuple(range(s.world))
        predicted = collective_time(s.kind, group, s.nbytes, cluster)
        error = (predicted - s.seconds) / s.seconds
        rows.append((s, error))
        print(f"{s.kind:>15} {s.world:>5} {format_bytes(s.nbytes):>10} {format_time(s.seconds):>10} "
              f"{format_time(predicted):>10} {100 * error:>6.1f}%")  # fmt: skip

    def mape(selected: list) -> float:
        return 100 * sum(abs(e) for _, e in selected) / max(len(selected), 1)

    big = [(s, e) for s, e in rows if s.nbytes >= 1 << 20]
    print(f"\nMAPE, all sizes: {mape(rows):.1f}% ({len(rows)} points)")
    for world in worlds:
        print(f"MAPE, sizes >= 1 MiB, {world} processes: {mape([r for r in big if r[0].world == world]):.1f}%")
    print(f"MAPE, sizes >= 1 MiB: {mape(big):.1f}% ({len(big)} points; target <= 25%)")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
