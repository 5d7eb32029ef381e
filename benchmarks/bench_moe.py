"""Mixture-of-experts per layer (issue 40): the dispatch and combine all_to_alls against the
formula ``tokens x top-k x hidden`` per all_to_all, the experts' memory per rank at ep 1 / 2 /
4, and the step on this machine's CPU at small sizes. Every figure says whether it is priced
or measured, and where.

    python benchmarks/bench_moe.py [--priced-only]

**Priced, formula** (``cost_model/moe.py``, h100-node profile, no GPU): a Mixtral-8x7B-shaped
MoE layer (hidden 4096, 8 experts of SwiGLU 14336, top-2, bfloat16), 4096 tokens per rank, ep
2 / 4 / 8 in one node: bytes one rank sends per all_to_all, the all_to_all's seconds with a
uniform router and with the busiest rank receiving 1.5x its share (dropless), the layer's 4
(2 forward, 2 backward), and the experts' parameters, gradients and AdamW's two moments per
rank (all bfloat16, for the shape of it).

**Priced, compiled** (``autopar.compile`` on h100-node, the plan priced by
``autopar/pricing.py``; no GPU): the zoo MoE written Paddle's way (``experts="local"``: the router
per group in ``local_map``, experts on ``split_mesh(mesh, "ep")``; dim 64, 4 experts of 256,
top-2, capacity factor 1, 2 layers, batch 8 x 16 tokens, Momentum) on ep = 2 and 4: rank 0's
all_to_alls per layer and their bytes beside the formula (``T = 128 / ep`` tokens per group),
and the experts' parameter memory per rank (the plan's parameters, gradients and states less the
rest, which every rank holds alike) beside ``1 / ep`` of the replicated experts (ep = 1: the
stacked MoE on one device).

**Measured** (this machine's CPU, ``autopar.simulate``: every rank in this one process, so the
step is the sum of the ranks' work, not a parallel step; median of 3 after a warm-up): the
same model on one device (ep = 1: the stacked MoE) and on ep = 2 and 4.

**Stacked experts, routing over the whole batch against routing per group lined up with the
batch split** (GSPMD's formulation, ``experts="stacked"``; the same small model): priced on
h100-node, rank 0's collectives per MoE layer that are not gradient syncs, by kind with their
nccl-tests sizes and priced seconds, for ``router_groups=1`` (the whole batch: its router's
statistics summed over the ranks, the ``[experts, capacity, hidden]`` buffer of the global
capacity reduce-scattered and all-gathered each way) and ``router_groups`` = the ranks splitting
the batch (2 all_to_alls each way); and measured, the simulated step of each on this machine's CPU.
"""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore")

from timing import median_simulated_step  # noqa: E402  (benchmarks/timing.py)

MIXTRAL = {"hidden": 4096, "ffn": 14336, "experts": 8, "top_k": 2, "tokens": 4096}
SMALL = {"dim": 64, "n_experts": 4, "expert_hidden": 256, "n_layers": 2, "vocab_size": 64, "batch": 8, "seq": 16}


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def priced_formula() -> list[str]:
    from autopar.cost_model import shipped_profile
    from autopar.cost_model.moe import MoELayer, expert_memory, price_moe_layer

    cluster = shipped_profile("h100-node")
    m = MIXTRAL
    layer = MoELayer(m["tokens"], m["hidden"], m["experts"], m["top_k"], None, 3 * m["hidden"] * m["ffn"], "bfloat16")
    lines = [
        f"priced (formula, cost_model/moe.py, h100-node profile, no GPU): Mixtral-8x7B-shaped MoE layer {m}, bfloat16, "
        "dropless; n = tokens x top-k x hidden x 2 B per all_to_all",
        "| ep | formula n | sent / all_to_all / rank | all_to_all (uniform) | all_to_all (busiest 1.5x) | layer: 4 all_to_alls (uniform) | experts / rank (params, grads, 2 moments) |",
        "|---|---|---|---|---|---|---|",
    ]
    n = m["tokens"] * m["top_k"] * m["hidden"] * 2
    for ep in (1, 2, 4, 8):
        even, skewed = price_moe_layer(layer, ep, cluster), price_moe_layer(layer, ep, cluster, imbalance=1.5)
        memory = expert_memory(layer, ep, states=2, parameter_dtype="bfloat16")
        lines.append(f"| {ep} | {_bytes(n)} | {_bytes(even.sent)} | {_us(even.seconds)} | {_us(skewed.seconds)} | "
                     f"{even.collectives} x = {_us(even.comm)} | {_bytes(memory)} |")  # fmt: skip
    return lines


def _config():
    from autopar.testing.zoo import moe

    return moe.Config(**{k: SMALL[k] for k in ("dim", "n_experts", "expert_hidden", "n_layers", "vocab_size")})


def _compiled(ep: int, optimizer: str = "momentum"):
    import autopar
    from autopar.testing.zoo import moe

    config = _config()
    if ep == 1:
        seed = moe.build(config, batch=SMALL["batch"], seq=SMALL["seq"], optimizer=optimizer)
        mesh = autopar.ProcessMesh([0], ["dp"])
    else:
        mesh = autopar.ProcessMesh(list(range(ep)), ["ep"])
        seed = moe.build(
            config, batch=SMALL["batch"], seq=SMALL["seq"], mesh=mesh, experts="local", optimizer=optimizer
        )
    strategy = autopar.Strategy(cluster="h100-node")
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def priced_compiled() -> list[str]:
    from autopar.cost_model.moe import MoELayer, expert_memory

    config = _config()
    tokens = SMALL["batch"] * SMALL["seq"]
    per_layer = MoELayer(
        tokens, config.dim, config.n_experts, 2, expert_parameters=2 * config.dim * config.expert_hidden
    )
    experts_total = config.n_layers * expert_memory(per_layer, 1, states=1)
    prices = {ep: _compiled(ep)[1].decisions.price() for ep in (1, 2, 4)}
    held = {ep: price.parameter_memory for ep, price in prices.items()}
    rest = held[1] - experts_total  # what every rank holds alike: attention, router, shared expert, embeddings
    lines = [
        f"priced (compiled plan, autopar/pricing.py, h100-node profile, no GPU): zoo MoE experts='local' {SMALL}, top-2, "
        "capacity factor 1, Momentum (parameter, gradient, velocity); ep=1: the stacked MoE on one device",
        "| ep | all_to_alls / layer (rank 0) | bytes each | formula T x k x h x 4 B | priced seconds each | experts / rank (plan) | 1/ep of replicated | priced step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ep in (1, 2, 4):
        _, dist = _compiled(ep)
        moved = [c for c in dist.comm_ops(0) if c.kind.value == "all_to_all"]
        formula = tokens // ep * 2 * config.dim * 4 if ep > 1 else 0
        each = sorted({c.bytes for c in moved})
        seconds = sorted({round(c.time * 1e6, 3) for c in moved})
        lines.append(f"| {ep} | {len(moved) / config.n_layers:g} | {', '.join(_bytes(b) for b in each) or '-'} | "
                     f"{_bytes(formula) if ep > 1 else '-'} | {', '.join(f'{s} us' for s in seconds) or '-'} | "
                     f"{_bytes(held[ep] - rest)} | {_bytes(experts_total / ep)} | {_us(prices[ep].step)} |")  # fmt: skip
    return lines


def measured(steps: int = 3) -> list[str]:
    from autopar.testing.zoo import moe

    config = _config()
    feeds = moe.feeds(config, SMALL["batch"], SMALL["seq"], steps + 1)
    lines = [
        f"measured (this machine's CPU, autopar.simulate: all ranks in one process; median of {steps} steps after a warm-up): "
        f"zoo MoE experts='local' {SMALL}, Momentum",
        "| plan | collectives / step (rank 0) | simulated step (all ranks) |",
        "|---|---|---|",
    ]
    for ep in (1, 2, 4):
        seed, dist = _compiled(ep)
        step = median_simulated_step(dist, feeds, [seed.loss])
        name = "one device (the stacked MoE)" if ep == 1 else f"ep={ep}"
        lines.append(f"| {name} | {len(dist.comm_ops(0))} | {step * 1e3:,.1f} ms |")
    return lines


STACKED = {  # name -> (mesh shape, mesh dims, router groups lined up with the batch split)
    "ep=2": ([0, 1], ["ep"], 2),
    "ep=4": ([0, 1, 2, 3], ["ep"], 4),
    "dp=2 x ep=2": ([[0, 1], [2, 3]], ["dp", "ep"], 4),
}


def _stacked(name: str, groups: int):
    import dataclasses

    import autopar
    from autopar.testing.zoo import moe

    ranks, dims, _ = STACKED[name]
    mesh = autopar.ProcessMesh(ranks, dims)
    config = dataclasses.replace(_config(), router_groups=groups)
    seed = moe.build(config, batch=SMALL["batch"], seq=SMALL["seq"], mesh=mesh, optimizer="momentum")
    strategy = autopar.Strategy(cluster="h100-node")
    return config, seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def _per_layer(dist, layers: int) -> tuple[str, int, float, float]:
    """Rank 0's collectives per layer that are not gradient syncs: by kind (count x sizes), their
    count, nccl-tests bytes and priced seconds."""
    moved = [c for c in dist.comm_ops(0) if "gradient sync" not in c.reason]
    kinds: dict[str, list[int]] = {}
    for c in moved:
        kinds.setdefault(c.kind.value, []).append(c.bytes)
    text = ", ".join(
        f"{len(b) / layers:g} {kind} ({'/'.join(_bytes(x) for x in sorted(set(b), reverse=True))})"
        for kind, b in sorted(kinds.items())
    )
    return text, len(moved), sum(c.bytes for c in moved) / layers, sum(c.time for c in moved) / layers


def stacked_routing(steps: int = 3, measure: bool = True) -> list[str]:
    from autopar.testing.zoo import moe

    lines = [
        f"stacked experts (experts='stacked' {SMALL}, top-2, capacity factor 1, Momentum): priced (compiled plan on "
        "h100-node, no GPU) rank 0's collectives per MoE layer other than gradient syncs"
        + (
            f"; measured: simulated step (this machine's CPU, all ranks in one process, median of {steps})"
            if measure
            else ""
        ),
        "| mesh | router_groups | collectives / layer (rank 0, not gradient syncs) | bytes / layer | priced seconds / layer | priced step |"
        + (" simulated step (measured) |" if measure else ""),
        "|---|---|---|---|---|---|" + ("---|" if measure else ""),
    ]
    for name, (_, _, lined_up) in STACKED.items():
        for groups in (1, lined_up):
            config, seed, dist = _stacked(name, groups)
            kinds, _, sent, seconds = _per_layer(dist, config.n_layers)
            row = f"| {name} | {groups} | {kinds} | {_bytes(sent)} | {_us(seconds)} | {_us(dist.decisions.price().step)} |"
            if measure:
                feeds = moe.feeds(config, SMALL["batch"], SMALL["seq"], steps + 1)
                row += f" {median_simulated_step(dist, feeds, [seed.loss]) * 1e3:,.1f} ms |"
            lines.append(row)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--priced-only", action="store_true")
    args = parser.parse_args()
    print("\n".join(priced_formula()))
    print()
    print("\n".join(priced_compiled()))
    if not args.priced_only:
        print()
        print("\n".join(measured()))
    print()
    print("\n".join(stacked_routing(measure=not args.priced_only)))


if __name__ == "__main__":
    main()
