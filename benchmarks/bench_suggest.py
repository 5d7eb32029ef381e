"""Strategy search at scale: ``autopar.suggest`` for an unannotated 24-layer GPT on 64 devices
(8 nodes of the h100-node profile).

Printed: the candidates priced, pruned by memory and skipped (with why), the search's seconds
(issue 25's target: >= 200 candidates in <= 60 s on these 2 cores), and the top plans with
their predicted step split and memory. The model is the benchmarks' GPT block at a size that
builds in seconds (its shapes are what the search prices: no parameter is allocated).

    .venv/bin/python benchmarks/bench_suggest.py [--layers 24] [--world 64] [--batch 64]
"""

from __future__ import annotations

import argparse
import time
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import gpt_block_program  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--profile", default="h100-node")
    args = parser.parse_args()
    started = time.perf_counter()
    seed = gpt_block_program(batch=args.batch, seq=64, hidden=args.hidden, heads=8, vocab=1024, layers=args.layers,
                             optimizer="adamw", seed=1, layer_calls=True)  # fmt: skip
    built = time.perf_counter() - started
    plans = autopar.suggest(seed.main, args.world, seed.startup, cluster=args.profile, top=8)
    print(f"{args.layers}-layer GPT (hidden {args.hidden}, batch {args.batch}, {len(seed.main.global_block().ops)} ops, built in "
          f"{built:.1f} s) on {args.world} devices, profile {args.profile}")  # fmt: skip
    print(plans)
    target = "met" if plans.searched >= 200 and plans.seconds <= 60 else "NOT met"
    print(f"\nsearch: {plans.searched} candidates priced in {plans.seconds:.1f} s ({plans.seconds / max(plans.searched, 1) * 1e3:.0f} ms "
          f"each; target >= 200 in <= 60 s: {target})")  # fmt: skip


if __name__ == "__main__":
    main()
