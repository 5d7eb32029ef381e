"""Strategy search at scale, and beside Megatron-LM's published plans.

Default: ``autopar.suggest`` for an unannotated 24-layer GPT on 64 devices (8 nodes of the
h100-node profile). Printed: the candidates priced, pruned by memory and skipped (with why),
the search's seconds (issue 25's target: >= 200 candidates in <= 60 s on these 2 cores), and
the top plans with their predicted step split and memory. The model is the benchmarks' GPT
block at a size that builds in seconds (its shapes are what the search prices: no parameter is
allocated).

``--megatron [ROW ...]``: the GPT configurations of Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), Table 1 (sequence 2048,
vocabulary 51200, Adam; 1.7B on 32 GPUs ... 1T on 3072), each built as the benchmarks' GPT
block (float32: Paddle's CPU build cannot build a bfloat16 training program) and priced on
h100-node (80 GB per device). Per row: the published plan (tensor x pipeline x data, activation
recompute, 1F1B with micro-batches of one sequence) priced by our cost model, and the best plan
our search finds among the mesh shapes around it (tensor t/2 .. 2t up to a node, pipeline
p/2 .. 2p; ``--around 1`` for the published shape only), with predicted step and memory for
both, and the published step (their measured TFLOP/s per A100 over the model's FLOPs, for
scale: another GPU and mixed precision). Rows: 1-10 (default 1 2 3).

    .venv/bin/python benchmarks/bench_suggest.py [--layers 24] [--world 64] [--batch 64]
    .venv/bin/python benchmarks/bench_suggest.py --megatron [ROW ...] [--around 2]
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.suggest import price_plan  # noqa: E402
from autopar.testing.models import gpt_block_program  # noqa: E402
from autopar.units import format_bytes, format_time  # noqa: E402

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Published:
    """One row of Narayanan et al. (SC'21), Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    teraflops: float  # achieved per A100 (mixed precision), measured end to end

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    def flops(self) -> float:
        """FLOPs per step, the paper's Eq. 3 (with activation recompute's extra forward)."""
        b, s, layers, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))

    @property
    def step(self) -> float:
        """The published step in seconds: the model's FLOPs over the GPUs' achieved rate."""
        return self.flops() / (self.gpus * self.teraflops * 1e12)


TABLE_1 = [
    Published(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Published(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Published(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Published(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Published(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Published(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Published(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Published(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Published(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Published(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def theirs(row: Published) -> autopar.Strategy:
    """Megatron's recipe for the row: full activation recompute, micro-batches of one sequence
    (m = B / d): 1F1B over the pipeline's stages, or without one gradient accumulation."""
    config = autopar.PipelineConfig(micro_batches=row.batch // row.data, schedule="1F1B", stages=row.pipeline)
    return autopar.Strategy(recompute=True, pipeline=config)


def around(row: Published, factor: int) -> list[tuple[int, int, int]]:
    """Mesh shapes (dp, mp, pp) near the published one: tensor and pipeline within ``factor``
    of theirs (tensor inside a node of 8), the rest data parallel."""
    out = []
    for mp in sorted({max(1, row.tensor // factor), row.tensor, min(8, row.tensor * factor)} | {row.tensor}):
        for pp in sorted({max(1, row.pipeline // factor), row.pipeline, row.pipeline * factor}):
            if row.gpus % (mp * pp) == 0 and pp <= row.layers and row.batch % (row.gpus // (mp * pp)) == 0:
                out.append((row.gpus // (mp * pp), mp, pp))
    return out


def megatron(rows: list[int], factor: int) -> None:
    print("Megatron-LM (Narayanan et al. SC'21, Table 1) beside autopar.suggest, priced on h100-node "
          "(float32 programs: step times are fp32's; memory per rank against 80 GB)\n")  # fmt: skip
    for number in rows:
        row = TABLE_1[number - 1]
        started = time.perf_counter()
        seed = gpt_block_program(batch=row.batch, seq=SEQ, hidden=row.hidden, heads=row.heads, vocab=VOCAB,
                                 layers=row.layers, optimizer="adamw", seed=1, layer_calls=True)  # fmt: skip
        built = time.perf_counter() - started
        published = price_plan(seed.main, (row.data, row.tensor, row.pipeline), theirs(row), seed.startup, cluster="h100-node")
        shapes = around(row, factor)
        found = autopar.suggest(seed.main, row.gpus, seed.startup, cluster="h100-node", top=3, shapes=shapes)
        print(f"row {number}: {row.billions}B ({row.layers} layers, hidden {row.hidden}, {len(seed.main.global_block().ops)} ops, "
              f"built in {built:.1f} s) on {row.gpus} GPUs, batch {row.batch}; published step "
              f"{format_time(row.step)} ({row.teraflops:g} TFLOP/s per A100, mixed precision)")  # fmt: skip
        print(f"  {'':6} {'mesh':22} {'strategy':28} {'step':>8} {'compute':>8} {'comm':>8} {'bubble':>8} {'peak mem':>10} fits")
        best = [("theirs", published)] + [("ours", plan) for plan in found[:1]]
        for who, plan in best:
            p = plan.price
            print(f"  {who:6} {str(plan.shape):22} {plan.features:28} {format_time(p.step):>8} {format_time(p.compute):>8} "
                  f"{format_time(p.communication):>8} {format_time(p.bubble):>8} {format_bytes(p.memory):>10} "
                  f"{'yes' if plan.fits else 'NO'}")  # fmt: skip
        print(f"  searched {found.searched} candidates over {len(shapes)} shapes ({found.pruned} pruned by memory) "
              f"in {found.seconds:.0f} s")
        if found:
            print(f"  ours: {found[0].why}")
        print()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--profile", default="h100-node")
    parser.add_argument("--megatron", type=int, nargs="*", metavar="ROW", help="compare with Megatron-LM's Table 1 rows (1-10)")
    parser.add_argument("--around", type=int, default=2, help="--megatron: shapes within this factor of the published one")
    args = parser.parse_args()
    if args.megatron is not None:
        megatron(args.megatron or [1, 2, 3], args.around)
        return
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
