"""Context parallelism's three plans side by side (issue 39): priced at long sequences on the
h100-node profile, measured at small sizes on this machine's CPU.

    python benchmarks/bench_context_parallel.py [--priced-only] [--cp 8]

**Priced** (``cost_model/context_parallel.py``, no GPU): one Llama-3-8B-shaped decoder layer
(batch 1, 32 query heads and 8 key / value heads of 128, hidden 4096, SwiGLU 14336, bfloat16)
over ``cp`` ranks of one node, at 4k / 32k / 128k tokens, a causal mask; the ring as autopar
lowers it (every block computed, a masked one adding 0) and a ring skipping the masked blocks,
zig-zag balanced (Megatron-Core's); per method: the bytes one rank sends per layer (forward + backward), the attention activation
memory per rank (what the core keeps for the backward and the scores it makes beside them), and
a step of 32 layers: the attention cores (their collectives, the ring's behind its blocks)
plus the layer's linears on ``S / cp`` tokens (the same for every method).

**Measured** (this machine's CPU, ``autopar.simulate``: every rank in this one process): the
Llama zoo model (2 layers, dim 64, 4 heads, 2 key / value heads, batch 2, 256 tokens, SGD)
compiled with ``Strategy(context_parallel=ContextParallel("sep", method))`` on sep=2 and sep=4
for each method that compiles on this tree (the others print compile's refusal): the bytes one
rank sends per layer in its collectives other than the gradient syncs (each one's ring volume,
the alpha-beta formula's bytes), the activation bytes its program keeps for the backward
(read off rank 0's host-backend program, its collectives carriers in place) beside the serial
program's, and the simulator's step (all ranks, one process: the sum of their work, not a
parallel step).
"""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore")

from timing import median_simulated_step  # noqa: E402  (benchmarks/timing.py)

LLAMA3_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "ffn": 14336, "layers": 32}
SEQS = (4096, 32768, 131072)
SMALL = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "vocab_size": 64, "batch": 2, "seq": 256}
METHODS = ("ring", "all_to_all", "all_gather")
SYNC = ("gradient sync", "gradient all_reduces fused")  # the parameters' gradient syncs: not attention's


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def linears_seconds(tokens: int, cluster) -> float:
    """Forward + backward of one layer's linears on ``tokens`` tokens (q, k, v, o; SwiGLU's three),
    bfloat16, each at the device's GEMM rate (a grad: twice the forward's FLOPs)."""
    from autopar.cost_model.compute import op_cost

    h, ffn, d = LLAMA3_8B["hidden"], LLAMA3_8B["ffn"], LLAMA3_8B["head_dim"]
    kv = LLAMA3_8B["kv_heads"] * d
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, ffn), (h, ffn), (ffn, h)]
    total = 0.0
    for k, n in shapes:
        for name in ("matmul", "matmul_grad"):
            cost = op_cost(name, [[1, tokens, k], [k, n]], [[1, tokens, n]], dtype="bfloat16")
            total += cost.time(cluster, "bfloat16") + cluster.device.op_seconds
    return total


def priced(cp: int) -> list[str]:
    from autopar.cost_model import shipped_profile
    from autopar.cost_model.context_parallel import AttentionShape, compare

    cluster = shipped_profile("h100-node")
    layers = LLAMA3_8B["layers"]
    lines = [
        f"priced (h100-node profile, no GPU): Llama-3-8B-shaped layer (32 heads, 8 kv heads, head dim 128), batch 1, "
        f"bfloat16, causal, cp={cp} in one node; step = {layers} layers of attention core + linears",
        "| seq | method | sent / layer / rank | attention memory / rank (saved + scores) | vs serial | step | exposed comm / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for seq in SEQS:
        shape = AttentionShape(1, seq, LLAMA3_8B["heads"], LLAMA3_8B["head_dim"], LLAMA3_8B["kv_heads"], "bfloat16", True)
        prices = compare(shape, cp, cluster, balance="zigzag")
        serial = prices["serial"].memory
        for method, price in prices.items():
            tokens = seq if method == "serial" else seq // cp
            step = layers * (price.seconds + linears_seconds(tokens, cluster))
            lines.append(f"| {seq // 1024}k | {method} | {_mib(price.sent)} | {_mib(price.memory)} | "
                         f"{price.memory / serial:.4f} | {_ms(step)} | {_ms(layers * price.exposed)} |")  # fmt: skip
    return lines


def measured(cps: tuple[int, ...], steps: int = 3) -> list[str]:
    import autopar
    from autopar.cost_model.comm import coefficients
    from autopar.errors import AutoparError
    from autopar.inspect.cost_report import program_saved_bytes
    from autopar.testing.serial import random_feeds
    from autopar.testing.zoo import llama

    config = llama.Config(**{k: SMALL[k] for k in ("dim", "n_heads", "n_kv_heads", "n_layers", "vocab_size")})
    serial_seed = llama.build(config, batch=SMALL["batch"], seq=SMALL["seq"], optimizer="sgd")
    serial_saved = program_saved_bytes(serial_seed.main)
    lines = [
        f"measured (this machine's CPU, autopar.simulate: all ranks in one process; {steps} steps after one warm-up): "
        f"Llama zoo {SMALL}, SGD; serial program keeps {serial_saved / 1024:.0f} KiB for the backward",
        "| cp | method | collectives / step | sent / layer / rank | kept for backward / rank | vs serial | simulated step (all ranks) |",
        "|---|---|---|---|---|---|---|",
    ]
    for cp in cps:
        for method in METHODS:
            seed = llama.build(config, batch=SMALL["batch"], seq=SMALL["seq"], optimizer="sgd")
            mesh = autopar.ProcessMesh(list(range(cp)), ["sep"])
            strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method))
            try:
                dist = autopar.compile(seed.main, mesh, seed.startup, strategy)
            except AutoparError as error:
                lines.append(f"| {cp} | {method} | refused: {str(error).splitlines()[0][:150]} | | | | |")
                continue
            except ImportError as error:  # (a method whose pieces have not all landed on this tree)
                lines.append(f"| {cp} | {method} | does not compile on this tree: {error} | | | | |")
                continue
            comms = [c for c in dist.comm_ops(0) if not any(word in c.reason for word in SYNC)]
            sent = sum(coefficients(str(c.kind), len(c.group), c.bytes)[1] for c in comms) / config.n_layers
            kept = program_saved_bytes(dist.rank_plan(0, backend="host").program)  # (carriers in place: permute has no native op)
            feeds = random_feeds(seed.feeds, steps + 1, classes=config.vocab_size)
            step = median_simulated_step(dist, feeds, [seed.loss])
            lines.append(f"| {cp} | {method} | {len(dist.comm_ops(0))} | {sent / 1024:.0f} KiB | {kept / 1024:.0f} KiB | "
                         f"{kept / serial_saved:.3f} | {_ms(step)} |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--priced-only", action="store_true")
    parser.add_argument("--cp", type=int, default=8, help="context-parallel ranks for the priced table (default 8: one node)")
    args = parser.parse_args()
    print("\n".join(priced(args.cp)))
    if not args.priced_only:
        print()
        print("\n".join(measured((2, 4))))


if __name__ == "__main__":
    main()
