"""Propagation speed on GPT-style programs (forward + backward + AdamW, hidden 1024).

Times graph building + propagation (compile) — median of runs — for 12 / 24 / 48 layers
with Megatron annotations on the weights and data parallel on the batch. Targets: 24 layers
under 1 s; t(48) / t(24) <= 2.2 (linear scaling).

    .venv/bin/python benchmarks/bench_propagation.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import gpt_block_program  # noqa: E402


def annotate_megatron(seed, mesh) -> None:
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    for name, layer in seed.layers.items():
        if name.startswith(("qkv", "fc1_")):
            autopar.shard_tensor(layer.weight, mesh, [None, "mp"])
            autopar.shard_tensor(layer.bias, mesh, ["mp"])
        elif name.startswith(("proj", "fc2_")):
            autopar.shard_tensor(layer.weight, mesh, ["mp", None])


def time_compile(layers: int, runs: int) -> tuple[int, float]:
    seed = gpt_block_program(batch=4, seq=128, hidden=1024, heads=16, vocab=8192, layers=layers)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    annotate_megatron(seed, mesh)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        dist = autopar.compile(seed.main, mesh)
        times.append(time.perf_counter() - start)
    return len(dist.graph.ops), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {}
    print(f"{'layers':>6} {'ops':>7} {'seconds':>9}")
    for layers in (12, 24, 48):
        ops, seconds = time_compile(layers, args.runs)
        results[layers] = seconds
        print(f"{layers:>6} {ops:>7} {seconds:>9.3f}")
    print(f"t(48)/t(24) = {results[48] / results[24]:.2f}  (target <= 2.2); t(24) = {results[24]:.3f} s (target < 1 s)")


if __name__ == "__main__":
    main()
