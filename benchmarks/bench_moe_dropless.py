"""Dropless routing (issue 40, "Capacity"): the bytes a dropless MoE layer's dispatch and combine
all_to_alls send per step, padded (the worst-case capacity's ``[E, G, C = S, H]`` buffer) against
the uneven all_to_all (``Strategy(uneven_all_to_all=True)``: each piece up to its last filled
row, counts first). Every figure says whether it is priced or measured, and where.

    python benchmarks/bench_moe_dropless.py [--priced-only] [--no-processes]

**Measured, simulator** (``autopar.simulate`` in this process, the GPU profile's plan: 4
all_to_alls a layer; bytes counted on the messages the simulator exchanges,
``autopar.runtime.wire``): the zoo MoE with ``Config(dropless=True)`` (dim 64, 4 experts of 256,
top-2, 1 layer, batch 8 x 16 tokens, SGD), rank 0, per layer and step (the mean of 3 steps):
the stacked experts on ep2 (2 router groups), the local ones on ep2, ep4 and dp2 x ep2; and the
ported Qwen2-MoE (``autopar/testing/zoo/qwen2_moe.py``, same sizes) with the worst-case capacity
``capacity_factor = num_experts`` on ep2. Beside
them, priced from the shapes: the routed rows ``T x k x h x 4 B`` of rank 0's pieces for the
other members (what a perfect uneven all_to_all would send).

**Measured, real processes** (2 processes, host backend, bytes counted the same way in each):
the stacked experts on ep2, padded and uneven, per layer and step, both ranks.

**Priced** (h100-node profile, no GPU ran): the compiled plan's dispatch / combine all_to_alls
(``Collective.bytes``, ``.time``) of the same small model on ep2, padded and uneven (the uneven
priced at a uniform gate's routed share of the pieces for the other members,
``cost_model/moe.py: uneven_bytes``); and a
Mixtral-8x7B-shaped layer (hidden 4096, 8 experts, top-2, 4096 tokens per rank, bfloat16) on ep 8:
the padded dropless buffer ``E x T x h x 2 B`` against the uneven one at imbalance 1 and 1.5.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import textwrap
import warnings

warnings.filterwarnings("ignore")

SMALL = {"dim": 64, "n_experts": 4, "expert_hidden": 256, "n_layers": 1, "vocab_size": 64}
BATCH, SEQ, STEPS = 8, 16, 3
MIXTRAL = {"hidden": 4096, "experts": 8, "top_k": 2, "tokens": 4096}


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def _cases():
    """(name, mesh, model, build's keywords, config)."""
    import autopar
    from autopar.testing.zoo import moe, qwen2_moe

    M = autopar.ProcessMesh
    qwen = qwen2_moe.Config(hidden_size=SMALL["dim"], num_experts=SMALL["n_experts"], moe_intermediate_size=SMALL["expert_hidden"],
                            num_hidden_layers=1, capacity_factor=float(SMALL["n_experts"]))  # fmt: skip
    return [
        ("stacked ep2", M([0, 1], ["ep"]), moe, {"experts": "stacked"}, moe.Config(**SMALL, dropless=True, router_groups=2)),
        ("local ep2", M([0, 1], ["ep"]), moe, {"experts": "local"}, moe.Config(**SMALL, dropless=True)),
        ("local ep4", M([0, 1, 2, 3], ["ep"]), moe, {"experts": "local"}, moe.Config(**SMALL, dropless=True)),
        ("local dp2 x ep2", M([[0, 1], [2, 3]], ["dp", "ep"]), moe, {"experts": "local"}, moe.Config(**SMALL, dropless=True)),
        ("ported Qwen2-MoE ep2, capacity_factor = E", M([0, 1], ["ep"]), qwen2_moe, {}, qwen),
    ]


def _compiled(mesh, model, keywords, config, uneven):
    import autopar

    seed = model.build(config, batch=BATCH, seq=SEQ, mesh=mesh, **keywords)
    strategy = autopar.Strategy(cluster="h100-node", uneven_all_to_all=uneven)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def _routed(dist, config) -> int:  # (the zoo's and the port's field names)
    """Priced from shapes: the routed rows of rank 0's pieces for the other members, per layer
    (the share k x tokens x hidden of each padded all_to_all's pieces for others)."""
    total = 0
    for c in dist.comm_ops(0):
        if "dropless buffer" in c.reason:
            p = len(c.group)
            total += round(c.bytes * (p - 1) / p * _top_k(config) / _experts(config))
    return total // _layers(config)


def _top_k(config) -> int:
    return getattr(config, "top_k", None) or config.num_experts_per_tok


def _experts(config) -> int:
    return getattr(config, "n_experts", None) or config.num_experts


def _layers(config) -> int:
    return getattr(config, "n_layers", None) or config.num_hidden_layers


def measured_simulator() -> list[str]:
    from autopar.runtime.simulator import simulate
    from autopar.runtime.wire import counting

    lines = [
        f"measured (simulator, autopar.runtime.wire: the messages exchanged), rank 0, per layer and step: zoo MoE dropless {SMALL}, "
        f"top-2, batch {BATCH} x {SEQ}, SGD, h100-node plan; routed: priced from shapes",
        "| plan | all_to_alls / layer | padded sent (measured) | uneven sent (measured) | uneven / padded | routed T x k x h (priced) |",
        "|---|---|---|---|---|---|",
    ]
    for name, mesh, model, keywords, config in _cases():
        sent, count = {}, 0
        for uneven in (False, True):
            seed, dist = _compiled(mesh, model, keywords, config, uneven)
            with counting() as log:
                simulate(dist, model.feeds(config, BATCH, SEQ, STEPS), [seed.loss])
            sent[uneven] = log.sent(rank=0) / STEPS / _layers(config)
            if not uneven:  # (the padded plan's all_to_alls: the uneven ones' bytes are priced already)
                count = sum("dropless buffer" in c.reason for c in dist.comm_ops(0)) // _layers(config)
                routed = _routed(dist, config)
        lines.append(f"| {name} | {count} | {_bytes(sent[False])} | {_bytes(sent[True])} | {sent[True] / sent[False]:.2f} | {_bytes(routed)} |")
    return lines


PROCESS_SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.runtime.wire import counting
    from autopar.testing.zoo import moe

    SMALL = {small!r}
    mesh = autopar.ProcessMesh([0, 1], ["ep"])
    config = moe.Config(**SMALL, dropless=True, router_groups=2)
    for uneven in (False, True):
        seed = moe.build(config, batch={batch}, seq={seq}, mesh=mesh)
        strategy = autopar.Strategy(cluster="h100-node", uneven_all_to_all=uneven)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        with counting() as log:
            for feed in moe.feeds(config, {batch}, {seq}, {steps}):
                exe.run(feed=feed, fetch_list=[seed.loss])
        print("RESULT", "uneven" if uneven else "padded", exe.rank, log.sent() / {steps} / config.n_layers, flush=True)
    """
)


def measured_processes() -> list[str]:
    from autopar.testing.processes import launch

    script = PROCESS_SCRIPT.format(small=SMALL, batch=BATCH, seq=SEQ, steps=STEPS)
    with tempfile.TemporaryDirectory() as directory:
        results = launch(script, 2, directory)
    sent = {}
    for line in results:
        form, rank, nbytes = re.search(r"RESULT (\w+) (\d+) ([\d.]+)", line).groups()
        sent[form, int(rank)] = float(nbytes)
    lines = [
        "measured (2 real processes, host backend, autopar.runtime.wire in each), per layer and step: the stacked experts on ep2, dropless",
        "| rank | padded sent | uneven sent | uneven / padded |",
        "|---|---|---|---|",
    ]
    for rank in (0, 1):
        lines.append(f"| {rank} | {_bytes(sent['padded', rank])} | {_bytes(sent['uneven', rank])} | {sent['uneven', rank] / sent['padded', rank]:.2f} |")
    return lines


def priced() -> list[str]:
    from autopar.cost_model import shipped_profile
    from autopar.cost_model.comm import collective_time
    from autopar.cost_model.moe import uneven_bytes

    name, mesh, model, keywords, config = _cases()[0]
    lines = [
        f"priced (h100-node profile, no GPU ran): the compiled plan of {name} (the small model above), rank 0, per layer",
        "| form | all_to_alls | bytes each (Collective.bytes: all_to_all's input buffer, all_to_all_v's bytes leaving the rank) | seconds each (Collective.time) |",
        "|---|---|---|---|",
    ]
    for uneven in (False, True):
        _, dist = _compiled(mesh, model, keywords, config, uneven)
        moved = [c for c in dist.comm_ops(0) if "dropless buffer" in c.reason]
        kinds = sorted({c.kind.value for c in moved})
        lines.append(f"| {'uneven' if uneven else 'padded'} | {len(moved)} x {', '.join(kinds)} | "
                     f"{', '.join(_bytes(b) for b in sorted({c.bytes for c in moved}))} | "
                     f"{', '.join(f'{t * 1e6:.2f} us' for t in sorted({c.time for c in moved}))} |")  # fmt: skip
    cluster = shipped_profile("h100-node")
    m, ep = MIXTRAL, 8
    padded = m["experts"] * m["tokens"] * m["hidden"] * 2  # [E, C = T, h] bfloat16: every token in one expert
    share = m["top_k"] / m["experts"]
    group = tuple(range(ep))
    lines += [
        "",
        f"priced (cost_model, h100-node, no GPU ran): Mixtral-8x7B-shaped dropless layer {m}, bfloat16, ep {ep}, one all_to_all per rank",
        "| form | bytes / rank | seconds |",
        "|---|---|---|",
        f"| padded (capacity = T) | {_bytes(padded)} | {collective_time('all_to_all', group, padded, cluster) * 1e6:,.1f} us |",
    ]
    for imbalance in (1.0, 1.5):
        n = uneven_bytes(padded * (ep - 1) // ep, share, imbalance)  # (all_to_all_v's bytes: the pieces for the others)
        lines.append(f"| uneven, imbalance {imbalance} | {_bytes(n)} | {collective_time('all_to_all_v', group, n, cluster) * 1e6:,.1f} us |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--priced-only", action="store_true")
    parser.add_argument("--no-processes", action="store_true", help="skip the 2-process measurement")
    args = parser.parse_args()
    print("\n".join(priced()))
    if not args.priced_only:
        print()
        print("\n".join(measured_simulator()))
        if not args.no_processes:
            print()
            print("\n".join(measured_processes()))


if __name__ == "__main__":
    main()
