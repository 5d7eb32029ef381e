"""Compile cost against the world size: one process of an N-rank job compiles and builds its
own rank plan only.

A 4-layer GPT block (forward + backward + AdamW; Megatron annotations on the weights, the
batch split over dp) on dp x mp meshes of 8, 64 and 1024 ranks (mp = 2, the same global
program for all three). Timed: ``autopar.compile`` + ``dist.rank_plan(0)`` (what each
process of a job does before its first step), median of ``--runs`` runs after one warm-up.
Target: t(1024) / t(8) <= 1.3. Also the 24-layer GPT of bench_propagation (hidden 1024, 2x2
mesh): compile + one rank plan, target < 1.0 s on 2 cores.

    .venv/bin/python benchmarks/bench_compile_scale.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import annotate_megatron, gpt_block_program  # noqa: E402


def compile_and_plan(seed, mesh) -> tuple[float, float]:
    """Seconds of compile, and of compile + rank_plan(0)."""
    start = time.perf_counter()
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    middle = time.perf_counter()
    dist.rank_plan(0)
    return middle - start, time.perf_counter() - start


def measure(seed, mesh, runs: int) -> tuple[float, float]:
    compile_and_plan(seed, mesh)  # warm-up: caches, Paddle's first-call costs
    times = [compile_and_plan(seed, mesh) for _ in range(runs)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def annotated_gpt(mesh, layers: int, batch: int, seq: int, hidden: int, heads: int, vocab: int):
    seed = gpt_block_program(batch=batch, seq=seq, hidden=hidden, heads=heads, vocab=vocab, layers=layers)
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    annotate_megatron(seed, mesh)
    return seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{'ranks':>6} {'mesh':>10} {'ops':>5} {'compile s':>10} {'compile + rank_plan(0) s':>25}")
    totals = {}
    for ranks in (8, 64, 1024):
        mesh = autopar.ProcessMesh(shape=[ranks // 2, 2], process_ids=list(range(ranks)), dim_names=["dp", "mp"])
        seed = annotated_gpt(mesh, layers=4, batch=512, seq=64, hidden=256, heads=8, vocab=1024)
        ops = len(seed.main.global_block().ops)
        compile_s, total = measure(seed, mesh, args.runs)
        totals[ranks] = total
        print(f"{ranks:>6} {f'{ranks // 2}x2':>10} {ops:>5} {compile_s:>10.3f} {total:>25.3f}")
    print(f"t(1024)/t(8) = {totals[1024] / totals[8]:.2f}  (target <= 1.3)")
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    seed = annotated_gpt(mesh, layers=24, batch=4, seq=128, hidden=1024, heads=16, vocab=8192)
    compile_s, total = measure(seed, mesh, max(1, args.runs // 2))
    print(f"24-layer GPT ({len(seed.main.global_block().ops)} ops, 2x2): compile {compile_s:.3f} s, "
          f"compile + rank_plan(0) {total:.3f} s  (target < 1.0 s)")  # fmt: skip


if __name__ == "__main__":
    main()
