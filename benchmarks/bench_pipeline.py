"""Pipeline schedules: bubble and activation memory, simulated (issue 11's benchmark, simulator part).

For p = 2, 4 ranks and m = 4, 8 micro-batches, every schedule is built, lowered and verified
(``autopar.schedule.build_schedule``), then timed by ``autopar.schedule_timeline.simulate_timeline``
with modelled action times F = I = W = 1, B = I + W = 2, sends / recvs / optimizer free. Printed
per schedule: the simulated bubble fraction vs its formula, the peak number of stashed
micro-batches (forward done, input-gradient backward not) and the peak activation bytes, both on
rank 0 (the rank that holds the most), at 64 MiB per stashed micro-batch of a whole rank's model.

Formulas (bubble = idle time / (p x makespan)):
- FThenB and 1F1B: (p-1) / (m+p-1) (GPipe; Narayanan et al. 2021);
- ZB-H1: (p-1) / (3m+p-1): Qi et al. 2023 give ZB-H1's bubble time as (p-1)(T_F + T_B - T_W)
  (their T_B is our I), against m(T_F + T_B + T_W) of work, here all times equal;
- Interleaved1F1B with v = 2 stages per rank, each doing 1/v of the rank's work:
  (p-1) / (v m + p-1) (Narayanan et al. 2021: the bubble time shrinks v times).
Targets: bubble within 5 % of the formula; stash exact: 1F1B holds p, FThenB m (the ratio of peak
activation bytes 1F1B / FThenB is then p / m).

    .venv/bin/python benchmarks/bench_pipeline.py

A real 2-process CPU run (measured step times and bubble; speed-up of 1F1B m=8 over no
pipelining) is still to come: it will add rows measured through ``autopar.launch`` to the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.schedule import ActionKind, build_schedule
from autopar.schedule_timeline import simulate_timeline

RANKS = (2, 4)
MICRO_BATCHES = (4, 8)
VIRTUAL_STAGES = 2  # for Interleaved1F1B
RANK_ACTIVATION_BYTES = 64 << 20  # one stashed micro-batch of a whole rank's model
TOLERANCE = 0.05
F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


@dataclass(frozen=True, slots=True)
class Row:
    """One schedule on one (p, m): what was found and what the formulas say."""

    schedule: str
    num_ranks: int
    micro_batches: int
    bubble: float
    formula: float
    peak_stash: int  # rank 0
    expected_stash: int | None
    peak_activation_bytes: int  # rank 0

    @property
    def bubble_ok(self) -> bool:
        return abs(self.bubble - self.formula) <= TOLERANCE * self.formula

    @property
    def stash_ok(self) -> bool:
        return self.expected_stash is None or self.peak_stash == self.expected_stash


def formula(schedule: str, num_ranks: int, micro_batches: int) -> float:
    p, m, v = num_ranks, micro_batches, VIRTUAL_STAGES
    if schedule == "ZBH1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def simulate(schedule: str, num_ranks: int, micro_batches: int) -> Row:
    """The simulated row of one schedule; each of v stages per rank does 1/v of the rank's work."""
    v = VIRTUAL_STAGES if schedule == "Interleaved1F1B" else 1
    durations = {F: 1.0 / v, B: 2.0 / v, I: 1.0 / v, W: 1.0 / v}
    stage_bytes = dict.fromkeys(range(num_ranks * v), RANK_ACTIVATION_BYTES // v)
    timeline = simulate_timeline(build_schedule(schedule, num_ranks, micro_batches, v), durations, stage_bytes)
    expected = {
        "FThenB": micro_batches,
        "1F1B": min(num_ranks, micro_batches),
        "ZBH1": min(num_ranks, micro_batches),
    }.get(schedule)
    return Row(
        schedule,
        num_ranks,
        micro_batches,
        timeline.bubble_fraction,
        formula(schedule, num_ranks, micro_batches),
        timeline.peak_stash[0],
        expected,
        timeline.peak_activation_bytes[0],
    )


def print_table(title: str, rows: list[Row]) -> None:
    print(title)
    print(
        f"{'p':>2} {'m':>2}  {'schedule':<16}{'bubble':>8} {'formula':>8} {'':>4}  {'stash r0':>8} {'expect':>6}  {'act. MiB r0':>11}"
    )
    for row in rows:
        expected = "-" if row.expected_stash is None else str(row.expected_stash)
        print(
            f"{row.num_ranks:>2} {row.micro_batches:>2}  {row.schedule:<16}{row.bubble:>8.2%} {row.formula:>8.2%} "
            f"{'ok' if row.bubble_ok else 'MISS':>4}  {row.peak_stash:>8} {expected:>6}  "
            f"{row.peak_activation_bytes / 2**20:>11.0f}"
        )


def print_memory_ratios(rows: list[Row]) -> None:
    print("\npeak activation bytes on rank 0, 1F1B / FThenB (expect p / m):")
    by_key = {(row.schedule, row.num_ranks, row.micro_batches): row for row in rows}
    for p in RANKS:
        for m in MICRO_BATCHES:
            ratio = by_key["1F1B", p, m].peak_activation_bytes / by_key["FThenB", p, m].peak_activation_bytes
            print(f"  p={p} m={m}: {ratio:.3f} (p/m = {p / m:.3f})")


def main() -> None:
    rows = [
        simulate(schedule, p, m)
        for p in RANKS
        for m in MICRO_BATCHES
        for schedule in ("FThenB", "1F1B", "ZBH1", "Interleaved1F1B")
    ]
    print_table(f"simulated: F = I = W = 1, B = 2 (per rank's model; v = {VIRTUAL_STAGES} for Interleaved1F1B)", rows)
    print_memory_ratios(rows)
    bubbles = sum(row.bubble_ok for row in rows)
    stashes = sum(row.stash_ok for row in rows if row.expected_stash is not None)
    print(
        f"\ntargets: bubble within {TOLERANCE:.0%} of the formula {bubbles}/{len(rows)}; "
        f"stash exact {stashes}/{sum(row.expected_stash is not None for row in rows)}"
    )


if __name__ == "__main__":
    main()
