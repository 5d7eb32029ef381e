"""What mixed precision changes per rank: bytes moved by collectives, bytes held, step time.

    .venv/bin/python benchmarks/bench_mixed_precision.py

An MLP (Linear 512->2048->2048->512, GELU, cross-entropy; global batch 64) written with Paddle's
AMP (autopar.testing.amp.amp_mlp) in fp32, O1 bf16, O2 bf16 (SGD and AdamW), O2 AdamW with ZeRO-2
and O2 AdamW with ``reduce_dtype="float32"``, on dp = 2 (``x`` annotated ``["dp", None]``),
priced on the h100-node profile (``Strategy(cluster="h100-node")``).

- comm bytes: rank 0's collectives of one step, counted from the compiled plan
  (``dist.comm_ops(0)``, each Collective's bytes in the dtype it moves);
- held, measured: every parameter, fp32 master and optimizer state in rank 0's scope after one
  step run through the numerics twin in this process (``nbytes``: bf16 held as 2 bytes);
- held, priced: the cost model's parameters + optimizer states of rank 0 (masters among the states);
- step, priced: ``dist.cost.step_time`` on h100-node (no GPU here: a price, not a measurement).
"""

from __future__ import annotations

import warnings
from typing import Any

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.runtime.rank_runner import RankRunner  # noqa: E402
from autopar.runtime.simulator import run_step, start_ranks  # noqa: E402
from autopar.testing.amp import Amp, amp_mlp, twin_plan  # noqa: E402
from autopar.testing.serial import random_feeds  # noqa: E402

WIDTHS, BATCH = (512, 2048, 2048, 512), 64
CONFIGS = (
    ("fp32 AdamW", Amp("O0", optimizer="adamw"), {}),
    ("O1 bf16 AdamW", Amp("O1", optimizer="adamw"), {}),
    ("O2 bf16 SGD", Amp("O2", optimizer="sgd"), {}),
    ("O2 bf16 AdamW", Amp("O2", optimizer="adamw"), {}),
    ("O2 bf16 AdamW, ZeRO-2", Amp("O2", optimizer="adamw"), {"zero_stage": 2}),
    ("O2 bf16 AdamW, reduce_dtype=float32", Amp("O2", optimizer="adamw"), {"reduce_dtype": "float32"}),
)


def compiled(amp: Amp, options: dict[str, Any]) -> tuple[Any, Any]:
    seed = amp_mlp(amp, batch=BATCH, widths=WIDTHS)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    strategy = autopar.Strategy(cluster="h100-node", **options)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def held_after_a_step(seed: Any, dist: Any) -> int:
    runners = {r: RankRunner(twin_plan(dist.rank_plan(r)), []) for r in dist.mesh.ranks}
    start_ranks(runners)
    run_step(runners, random_feeds(seed.feeds, 1, classes=WIDTHS[-1])[0])
    names = [*dist.values.named("parameter"), *dist.values.named("state")]
    return sum(runners[0].read(n).nbytes for n in names if n in runners[0].plan.copies())


def main() -> None:
    header = ("config", "comm bytes/step (counted)", "held, measured", "held, priced", "step, priced h100-node")
    rows = []
    for name, amp, options in CONFIGS:
        seed, dist = compiled(amp, options)
        cost = dist.cost
        rank0 = cost.ranks[0]
        comm = sum(c.bytes for c in dist.comm_ops(0))
        priced = rank0.memory.parameters + rank0.memory.optimizer_states
        rows.append((name, f"{comm / 2**20:.2f} MiB", f"{held_after_a_step(seed, dist) / 2**20:.2f} MiB",
                     f"{priced / 2**20:.2f} MiB", f"{cost.step_time * 1e6:.0f} us"))  # fmt: skip
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    main()
