"""Propagation speed on GPT-style programs (forward + backward + AdamW, hidden 1024).

Times graph building + propagation (``autopar.analysis.analyze_state``) — median of runs — for
12 / 24 / 48 layers with Megatron annotations on the weights and data parallel on the batch
(a 2 x 2 mesh). Targets: 24 layers under 1 s; t(48) / t(24) <= 2.2 (linear scaling). Printed
beside it: compile (analysis + every pass's planning) + ``rank_plan(0)`` (one rank's program
built: what each process of a job does).

    .venv/bin/python benchmarks/bench_propagation.py [--runs 3]
"""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore")

from timing import median_time  # noqa: E402  (benchmarks/timing.py)

import autopar  # noqa: E402
from autopar.analysis import analyze_state  # noqa: E402
from autopar.testing.models import annotate_megatron, gpt_block_program  # noqa: E402


def time_compile(layers: int, runs: int) -> tuple[int, float, float]:
    seed = gpt_block_program(batch=4, seq=128, hidden=1024, heads=16, vocab=8192, layers=layers)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    annotate_megatron(seed, mesh)
    ops = len(analyze_state(seed.main, mesh).graph.ops)
    whole = median_time(lambda: autopar.compile(seed.main, mesh, startup_program=seed.startup).rank_plan(0), runs)
    return ops, median_time(lambda: analyze_state(seed.main, mesh), runs), whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {}
    print(f"{'layers':>6} {'ops':>7} {'graph+propagation s':>20} {'compile + rank_plan(0) s':>25}")
    for layers in (12, 24, 48):
        ops, seconds, whole = time_compile(layers, args.runs)
        results[layers] = seconds
        print(f"{layers:>6} {ops:>7} {seconds:>20.3f} {whole:>25.3f}")
    print(f"t(48)/t(24) = {results[48] / results[24]:.2f}  (target <= 2.2); t(24) = {results[24]:.3f} s (target < 1 s)")


if __name__ == "__main__":
    main()
