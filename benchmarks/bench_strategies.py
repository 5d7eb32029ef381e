"""Many strategies, one analysis: compile time of 20 strategies for a 24-layer GPT on
pp=2 x dp=2 x mp=2 (Megatron weight annotations, ``PipelineConfig(stages=2)`` cuts the layers).

The 20 strategies vary what strategy search varies: the ZeRO stage (0-3), the gradient bucket
(32 MiB, 1 MiB, unfused), the schedule (FThenB, 1F1B, ZB-H1), the micro-batch count (2, 4),
sequence parallelism and recompute. Printed, each the median of 3 runs:
- one compile (analysis + planning), and its split;
- the 20 compiled one by one (each analyses again);
- the 20 compiled from ``autopar.analyze`` once per distinct analysis (the micro-batch count,
  SP and recompute need their own, each derived from the first with ``analyze(..., base=)``;
  the ZeRO stage, fusion and schedule share one), then ``compile(..., analysis=...)``;
and both totals as multiples of one compile (Core 3.0's target: 20 strategies <= 4x one compile).

    .venv/bin/python benchmarks/bench_strategies.py
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore")

from timing import median_time  # noqa: E402  (benchmarks/timing.py)

import autopar  # noqa: E402
from autopar.compile_plan import analysed_fields  # noqa: E402
from autopar.testing.models import annotate_megatron, gpt_block_program  # noqa: E402

RUNS = 5


def strategies() -> list[autopar.Strategy]:
    def make(schedule="1F1B", micro_batches=2, **fields):
        return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule, stages=2), **fields)

    out = [make(schedule, zero_stage=zero) for zero in (0, 1, 2, 3) for schedule in ("FThenB", "1F1B", "ZBH1")]
    out += [make(allreduce_bucket_mb=1.0), make(fuse_allreduce=False)]
    out += [make("1F1B", 4), make("ZBH1", 4)]
    out += [make(sequence_parallel=True), make(sequence_parallel=True, zero_stage=1)]
    out += [make(recompute=True), make(recompute=True, zero_stage=1)]
    return out


def program():
    seed = gpt_block_program(batch=8, seq=16, hidden=64, heads=4, vocab=128, layers=24, optimizer="adamw", seed=1, layer_calls=True)
    mesh = autopar.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "mp"])
    annotate_megatron(seed, mesh)
    return seed, mesh


def main() -> None:
    seed, mesh = program()
    chosen = strategies()
    args = (seed.main, mesh, seed.startup)
    autopar.compile(*args, chosen[0])  # (warm: rule tables, imports)
    one = median_time(lambda: autopar.compile(*args, chosen[0]), RUNS)
    analysis = autopar.analyze(*args, chosen[0])
    analysed = median_time(lambda: autopar.analyze(*args, chosen[0]), RUNS)
    planned = median_time(lambda: autopar.compile(*args, chosen[0], analysis=analysis), RUNS)

    def separately():
        for strategy in chosen:
            autopar.compile(*args, strategy)

    def shared():
        analyses = {}
        for strategy in chosen:
            key = tuple(analysed_fields(strategy).items())
            if key not in analyses:  # the first made afresh, the others derived from it
                analyses[key] = autopar.analyze(*args, strategy, base=next(iter(analyses.values()), None))
            autopar.compile(*args, strategy, analysis=analyses[key])

    groups = len({tuple(analysed_fields(s).items()) for s in chosen})
    kinds = {}
    first = autopar.analyze(*args, chosen[0])
    for strategy in chosen:  # what each distinct analysis costs, made afresh / derived from the first
        key = tuple(analysed_fields(strategy).items())
        if key not in kinds:
            kinds[key] = (
                median_time(lambda strategy=strategy: autopar.analyze(*args, strategy), RUNS),
                median_time(lambda strategy=strategy: autopar.analyze(*args, strategy, base=first), RUNS),
            )
    each, reused = median_time(separately, RUNS), median_time(shared, RUNS)
    print(f"24-layer GPT ({len(seed.main.global_block().ops)} ops), mesh pp=2 x dp=2 x mp=2, median of {RUNS} runs")
    print(f"  one compile                          {one:6.2f} s   (an analysis alone {analysed:.2f} s, planning from it {planned:.3f} s)")
    print(f"  {len(chosen)} strategies, each analysed        {each:6.2f} s   {each / one:5.1f}x one compile")
    print(f"  {len(chosen)} strategies, {groups} analyses shared   {reused:6.2f} s   {reused / one:5.1f}x one compile   (target <= 4x)")
    for key, (fresh, derived) in kinds.items():
        fields = dict(key)
        what = ", ".join(f"{k}={v}" for k, v in fields.items() if k in ("micro_batches", "sequence_parallel", "recompute"))
        print(f"    analysis {what:58} {fresh:5.2f} s afresh, {derived:5.2f} s derived from the first")


if __name__ == "__main__":
    main()
