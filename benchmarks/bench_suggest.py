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
block (float32: Paddle's CPU build cannot build a bfloat16 AdamW program, docs/paddle_amp.md)
and priced on h100-node (80 GB per device) as the mixed-precision program it stands for
(``precision="bf16"``: bfloat16 activations, GEMMs and gradients, fp32 masters and Adam states;
``--precision fp32`` for the float32 prices). Per row: the **published measured step** (their
reported TFLOP/s per A100 over the model's FLOPs per step, the paper's Eq. 3 — measured by them
on A100 80GB in mixed precision; and that step scaled to an H100 by the two GPUs' dense bf16
peaks, 312 against 989.4 TFLOP/s — a scale, not a measurement) beside our price of the same plan
(their tensor x pipeline x data, activation recompute, 1F1B with micro-batches of one sequence)
and its error against the scaled step; then the best plan our search finds among the mesh
shapes around it (tensor t/2 .. 2t up to a node, pipeline p/2 .. 2p; ``--around 1`` for the
published shape only; ``--published-only`` skips the search). Rows: 1-10 (default 1 2 3).

    .venv/bin/python benchmarks/bench_suggest.py [--layers 24] [--world 64] [--batch 64]
    .venv/bin/python benchmarks/bench_suggest.py --megatron [ROW ...] [--around 2] [--precision bf16|fp32] [--published-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from dataclasses import dataclass

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.cost_model import Cluster, load_cluster  # noqa: E402
from autopar.suggest import Plan, price_plan  # noqa: E402
from autopar.testing.models import gpt_block_program  # noqa: E402
from autopar.units import format_bytes, format_time  # noqa: E402

SEQ, VOCAB = 2048, 51200
# NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), A100 80GB SXM column:
# FP32 19.5, TF32 156, BF16 / FP16 Tensor Core 312 TFLOPS dense (twice with sparsity), HBM2e
# 2,039 GB/s, NVLink 600 GB/s (both directions). Megatron's runs (SC'21, Sec. 5.1): Selene, 8
# A100 80GB per node over NVLink / NVSwitch, eight 200 Gb/s HDR InfiniBand HCAs per node.
A100_BF16_PEAK = 312e12
A100_PEAKS = {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}
A100_BANDWIDTH, A100_NVLINK, A100_IB = 2.039e12, 300e9, 25e9  # bytes/s; NVLink and HDR per direction per GPU


def a100_node(h100: Cluster) -> Cluster:
    """An A100 80GB node derived from ``h100`` (h100-node) by the datasheets' ratios, none of it
    measured: each dtype's achieved rates scaled by the peaks' ratio (the same fraction of peak
    as H100.md measured), the streaming rate by the memory bandwidths', NVLink 300 GB/s and HDR
    InfiniBand 25 GB/s per direction per GPU (latencies as h100-node's)."""
    device = h100.device
    peaks = dict(device.peak_flops)

    def scaled(rates: tuple) -> tuple:
        return tuple((dtype, rate * A100_PEAKS[dtype] / peaks[dtype]) for dtype, rate in rates if dtype in A100_PEAKS)

    a100 = dataclasses.replace(
        device, peak_flops=tuple(sorted(A100_PEAKS.items())), achieved_flops=scaled(device.achieved_flops),
        batched_flops=scaled(device.batched_flops), memory_bandwidth=A100_BANDWIDTH,
        achieved_bandwidth=device.achieved_bandwidth * A100_BANDWIDTH / device.memory_bandwidth,
    )  # fmt: skip
    intra, inter = dataclasses.replace(h100.intra, bandwidth=A100_NVLINK), dataclasses.replace(h100.inter, bandwidth=A100_IB)
    return dataclasses.replace(h100, name="a100-node (derived)", device=a100, intra=intra, inter=inter, sources=())


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


@dataclass(frozen=True)
class Comparison:
    """One Table 1 row: the published measured step beside our price of the same plan."""

    row: Published
    theirs: Plan  # their plan, priced by our cost model (h100-node)
    h100_peak: float  # the profile's dense bf16 peak, FLOP/s
    on_a100: Plan | None = None  # their plan priced on :func:`a100_node` (derived from the datasheets)

    @property
    def published(self) -> float:
        """Their measured step on A100s, seconds (reported TFLOP/s per GPU over Eq. 3's FLOPs)."""
        return self.row.step

    @property
    def scaled(self) -> float:
        """The published step scaled to H100s by the dense bf16 peaks (A100 312, H100 989.4 TFLOP/s)."""
        return self.row.step * A100_BF16_PEAK / self.h100_peak

    @property
    def error(self) -> float:
        """Our price of their plan over the scaled published step, minus one."""
        return self.theirs.price.step / self.scaled - 1.0

    @property
    def a100_error(self) -> float:
        """Our price of their plan on the derived A100 node over their measured step, minus one."""
        return self.on_a100.price.step / self.published - 1.0

    def lines(self) -> list[str]:
        row, p = self.row, self.theirs.price
        return [
            f"  published (Narayanan et al. SC'21 Table 1, measured by them on A100 80GB, mixed precision): "
            f"{row.teraflops:g} TFLOP/s per GPU x {row.gpus} GPUs over {row.flops():.3g} FLOPs a step = "
            f"{format_time(self.published)} a step; scaled to H100 by peak ({A100_BF16_PEAK / 1e12:g} -> "
            f"{self.h100_peak / 1e12:g} TFLOP/s): {format_time(self.scaled)}",
            f"  ours (priced on h100-node, {self.theirs.precision.split(' ')[0]}): their plan {self.theirs.shape} "
            f"[{self.theirs.features}] {format_time(p.step)} = compute {format_time(p.compute)} + comm "
            f"{format_time(p.communication)} + bubble {format_time(p.bubble)}; error against the scaled "
            f"published step: {self.error:+.0%}",
        ] + ([] if self.on_a100 is None else [
            f"  ours on an A100 node derived from h100-node by the datasheets' ratios (not measured): "
            f"{format_time(self.on_a100.price.step)} = compute {format_time(self.on_a100.price.compute)} + comm "
            f"{format_time(self.on_a100.price.communication)}; error against their measured step: {self.a100_error:+.0%}",
        ])  # fmt: skip


def compare(row: Published, program, startup, profile: str = "h100-node", precision: str | None = "bf16") -> Comparison:
    """Our price of ``row``'s published plan (``program``: its model, built) beside their measured
    step: on ``profile``, and on an A100 node derived from it (:func:`a100_node`)."""
    shape, cluster = (row.data, row.tensor, row.pipeline), load_cluster(profile)
    plan = price_plan(program, shape, theirs(row), startup, cluster=profile, precision=precision)
    on_a100 = price_plan(program, shape, theirs(row), startup, cluster=a100_node(cluster), precision=precision)
    return Comparison(row, plan, cluster.device.flops_for("bfloat16"), on_a100)


def megatron(rows: list[int], factor: int, precision: str | None = "bf16", search: bool = True) -> None:
    said = "bfloat16 programs (fp32 masters and Adam states)" if precision else "float32 programs"
    print("Megatron-LM (Narayanan et al. SC'21, Table 1): their measured steps (A100, mixed precision) beside our "
          f"prices (h100-node, {said}; memory per rank against 80 GB)\n")  # fmt: skip
    for number in rows:
        row = TABLE_1[number - 1]
        started = time.perf_counter()
        seed = gpt_block_program(batch=row.batch, seq=SEQ, hidden=row.hidden, heads=row.heads, vocab=VOCAB,
                                 layers=row.layers, optimizer="adamw", seed=1, layer_calls=True)  # fmt: skip
        built = time.perf_counter() - started
        compared = compare(row, seed.main, seed.startup, precision=precision)
        print(f"row {number}: {row.billions}B ({row.layers} layers, hidden {row.hidden}, {len(seed.main.global_block().ops)} ops, "
              f"built in {built:.1f} s) on {row.gpus} GPUs (t={row.tensor}, p={row.pipeline}, d={row.data}), batch {row.batch}")  # fmt: skip
        print("\n".join(compared.lines()))
        if not search:
            print()
            continue
        shapes = around(row, factor)
        found = autopar.suggest(seed.main, row.gpus, seed.startup, cluster="h100-node", top=3, shapes=shapes, precision=precision)
        print(f"  {'':6} {'mesh':22} {'strategy':28} {'step':>8} {'compute':>8} {'comm':>8} {'bubble':>8} {'peak mem':>10} fits")
        best = [("theirs", compared.theirs)] + [("ours", plan) for plan in found[:1]]
        for who, plan in best:
            p = plan.price
            print(f"  {who:6} {str(plan.shape):22} {plan.features:28} {format_time(p.step):>8} {format_time(p.compute):>8} "
                  f"{format_time(p.communication):>8} {format_time(p.bubble):>8} {format_bytes(p.memory):>10} "
                  f"{'yes' if plan.fits else 'NO'}")  # fmt: skip
        print(f"  searched {found.searched} candidates over {len(shapes)} shapes ({found.pruned} pruned by memory) "
              f"in {found.seconds:.0f} s; precision: {found.precision}")
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
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="--megatron: the programs' precision")
    parser.add_argument("--published-only", action="store_true", help="--megatron: their plan priced, no search")
    args = parser.parse_args()
    if args.megatron is not None:
        precision = None if args.precision == "fp32" else args.precision
        megatron(args.megatron or [1, 2, 3], args.around, precision, search=not args.published_only)
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
