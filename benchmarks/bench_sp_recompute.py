"""Sequence parallelism and selective recompute as they run: 2 real processes on CPU (issue 13).

    python benchmarks/bench_sp_recompute.py        # starts itself under autopar.launch --nproc 2

A GPT of two blocks (autopar.testing.models.gpt_block_program: batch 4, sequence 128, hidden
256, 8 heads, vocabulary 512, dropout 0.1, Momentum) with Megatron weights on mp=2, native
backend, the loss fetched every step, one thread per process. Configurations: TP, TP + SP,
TP + SP + recompute of attention's softmax and dropout. Per configuration, rank 0 prints:

* saved activation bytes per rank, measured in the rank program: the local sizes of the values
  made before the first gradient op and read after it (what Paddle keeps for the backward),
  beside the memory model's prediction (``dist.cost``, from placements), and the model's bytes
  of the saved values sequence parallelism splits (norms, residual adds, dropouts);
* the bytes and ring volume of the activation collectives per step (comm_ops);
* the median step time over 8 steps after 2 warm-up steps;
and the ratios to TP.
"""

from __future__ import annotations

import statistics
import time
import warnings

from relaunch import rank_or_relaunch

warnings.filterwarnings("ignore")

SIZES = {"batch": 4, "seq": 128, "hidden": 256, "heads": 8, "vocab": 512, "layers": 2}
WARMUP, STEPS = 2, 8
CONFIGS = {
    "TP": {},
    "TP+SP": {"sequence_parallel": True},
    "TP+SP+recompute": {"sequence_parallel": True, "recompute": ("softmax", "dropout")},
}


def run(rank: int) -> None:
    import autopar
    from autopar.cost_model.comm import coefficients
    from autopar.cost_model.memory import tensor_bytes
    from autopar.inspect.cost_report import program_saved_bytes, saved_activations
    from autopar.testing.models import annotate_megatron, gpt_block_program
    from autopar.testing.serial import random_feeds

    def compiled(options):
        seed = gpt_block_program(**SIZES, optimizer="momentum", dropout=0.1)
        mesh = autopar.ProcessMesh([0, 1], ["mp"])
        annotate_megatron(seed, mesh)
        return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**options))

    # the values sequence parallelism splits (norms, residual adds, dropouts between the regions)
    region = {v.key for v in compiled(CONFIGS["TP+SP"])[1].decisions.sequence().values if v.seq_dim is not None}
    rows = []
    for name, options in CONFIGS.items():
        seed, dist = compiled(options)
        acts = [c for c in dist.comm_ops(rank) if "gradient all_reduces fused" not in c.reason and "grad(" not in c.reason]
        volume = sum(coefficients(str(c.kind), 2, c.bytes)[1] for c in acts)
        measured = program_saved_bytes(dist.rank_plan(rank, backend="native").program)  # collectives in place
        predicted = dist.cost.ranks[rank].memory.activations
        saved = saved_activations(dist.graph)
        in_region = sum(tensor_bytes(dist.graph.values[k].shape, dist.graph.values[k].dtype, dist.propagation.dist(k), rank)
                        for k in saved if k in region)  # fmt: skip
        exe = autopar.Executor(dist, backend="native")
        exe.run_startup()
        times = []
        for i, feed in enumerate(random_feeds(seed.feeds, WARMUP + STEPS, classes=SIZES["vocab"])):
            start = time.perf_counter()
            exe.run(feed, fetch_list=[seed.loss])
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        rows.append((name, measured, predicted, in_region, len(acts), volume, statistics.median(times)))
    if rank == 0:
        report(rows)


def report(rows: list[tuple]) -> None:
    print(f"GPT {SIZES}, mp=2 on 2 processes (native backend), loss fetched every step")
    print(f"{'config':16} {'saved acts/rank':>15} {'model':>9} {'ratio':>6} {'norm/residual/dropout':>21} {'ratio':>6} "
          f"{'act colls':>9} {'ring bytes':>10} {'ms/step':>8} {'ratio':>6}")  # fmt: skip
    _, base_bytes, _, base_region, _, _, base_time = rows[0]
    for name, measured, predicted, region, colls, volume, step in rows:
        print(f"{name:16} {measured / 1024:>11.1f} KiB {predicted / 1024:>5.0f} KiB {measured / base_bytes:>6.3f} "
              f"{region / 1024:>17.0f} KiB {region / base_region:>6.3f} {colls:>9} {volume / 1024:>6.0f} KiB "
              f"{step * 1e3:>8.1f} {step / base_time:>6.2f}")  # fmt: skip


def main() -> None:
    rank = rank_or_relaunch(__file__)
    if rank is not None:
        run(rank)


if __name__ == "__main__":
    main()
