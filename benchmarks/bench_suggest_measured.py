"""Strategy search checked by real runs: ``autopar.suggest``'s predicted step times against the
step times measured on this machine, for a spread of candidate plans of a GPT block and of the
zoo's Llama on 2 and 4 processes, on the hardware's profile: ``cpu-shm`` here (the shared-memory
communicator one-machine jobs use), ``cpu-gloo`` with ``AUTOPAR_HOST_COMM=gloo`` (gloo's process
group). Every plan runs on the host backend, the one both CPU profiles are calibrated on.

For each model and world size the parent prices every candidate (``suggest(..., top=1000)``),
takes up to ``--plans`` of them spread over the ranking, and starts one ``autopar.launch`` job;
each rank rebuilds the same program, searches again (deterministic) and runs each chosen plan
with the Executor (the loop users run: a step fetching the loss), ``--steps`` timed steps after
a warm-up. Printed per model and world: each plan's predicted and measured step, and the
Spearman rank correlation between the two columns; whether the predicted best is within 15 %
of the measured best. Issue 25's target: Spearman >= 0.8, top-1 within 15 %.

    .venv/bin/python benchmarks/bench_suggest_measured.py [--models gpt llama] [--worlds 2 4] [--plans 12] [--steps 20]
        [--save results.json]

``--save`` writes each plan's label, predicted and measured step (per model and world), to price the
same measured plans again under another cost model (``--reprice results.json``: no run, the
Spearman of the current pricing against the saved measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

RESULTS_ENV = "AUTOPAR_BENCH_RESULTS"
CHOSEN_ENV = "AUTOPAR_BENCH_CHOSEN"
WARMUP = 3


MODEL_ENV = "AUTOPAR_BENCH_MODEL"
MODELS = ("gpt", "llama")  # the benchmarks' GPT block; the zoo's Llama (autopar.testing.zoo.llama)


def seed_program(model: str):
    if model == "llama":
        from autopar.testing.zoo import llama

        return llama.build(llama.Config(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2), batch=8, seq=32, seed=1)
    from autopar.testing.models import gpt_block_program

    return gpt_block_program(batch=8, seq=32, hidden=64, heads=4, vocab=128, layers=4, optimizer="sgd", seed=1, layer_calls=True)


def label(plan) -> str:
    return f"{plan.shape} [{plan.features}]"


def priced(world: int, model: str) -> list:
    import autopar

    seed = seed_program(model)
    return list(autopar.suggest(seed.main, world, seed.startup, top=1000, all_devices=True)), seed  # (run on world processes)


def spread(plans: list, count: int) -> list:
    """Up to ``count`` plans spread evenly over the ranking (first and last included)."""
    if len(plans) <= count:
        return plans
    step = (len(plans) - 1) / (count - 1)
    return [plans[round(i * step)] for i in range(count)]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def child(steps: int) -> None:
    """One rank of the job: run each chosen plan, rank 0 writes the step times."""
    import autopar
    from autopar.testing.serial import random_feeds

    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    chosen = json.loads(os.environ[CHOSEN_ENV])
    plans, seed = priced(world, os.environ[MODEL_ENV])
    by_label = {label(p): p for p in plans}
    feed = random_feeds(seed.feeds, 1, classes=128)[0]
    times = {}
    for name in chosen:
        exe = autopar.Executor(by_label[name].compile(), backend="host")  # (what both CPU profiles are calibrated on)
        exe.run_startup()
        for _ in range(WARMUP):
            exe.run(feed, fetch_list=[seed.loss])
        start = time.perf_counter()
        for _ in range(steps):
            exe.run(feed, fetch_list=[seed.loss])
        times[name] = (time.perf_counter() - start) / steps
    if rank == 0:
        Path(os.environ[RESULTS_ENV]).write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--plans", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--save", help="write each plan's predicted and measured step here (JSON)")
    parser.add_argument("--reprice", help="price the plans of a --save file again; print the Spearman (no run)")
    args = parser.parse_args()
    if "PADDLE_TRAINER_ID" in os.environ:
        child(args.steps)
        return
    if args.reprice:
        reprice(json.loads(Path(args.reprice).read_text()))
        return
    saved = {}
    for model in args.models:
        for world in args.worlds:
            saved[f"{model}@{world}"] = measure(model, world, args.plans, args.steps)
    if args.save:
        Path(args.save).write_text(json.dumps(saved, indent=1))


def reprice(saved: dict) -> None:
    """The plans of a ``--save`` file priced by the current cost model, against their saved measurements."""
    for key, rows in saved.items():
        model, world = key.split("@")
        by_label = {label(p): p for p in priced(int(world), model)[0]}
        kept = [row for row in rows if row["plan"] in by_label]
        predicted = [by_label[row["plan"]].price.step for row in kept]
        got = [row["measured"] for row in kept]
        old = spearman([row["predicted"] for row in kept], got)
        print(f"{key}: {len(kept)} plans, Spearman {old:.2f} as saved -> {spearman(predicted, got):.2f} repriced")
        for row, p in zip(kept, predicted):
            print(f"  {row['plan']:44} {row['predicted'] * 1e3:8.2f}ms -> {p * 1e3:8.2f}ms  measured {row['measured'] * 1e3:8.2f}ms")


def measure(model: str, world: int, count: int, steps: int) -> list[dict]:
    """Price ``model`` on ``world`` processes, run ``count`` of its plans for real, print both columns."""
    root = Path(__file__).resolve().parents[1]
    plans = spread(priced(world, model)[0], count)
    names = [label(p) for p in plans]
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "times.json")
        env = {**os.environ, RESULTS_ENV: path, CHOSEN_ENV: json.dumps(names), MODEL_ENV: model}
        cmd = [sys.executable, "-m", "autopar.launch", "--nproc", str(world), __file__, "--steps", str(steps)]
        job = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if job.returncode:
            sys.exit(f"the {world}-process job failed; its last lines:\n" + "\n".join(job.stdout.splitlines()[-30:]))
        measured = json.loads(Path(path).read_text())
    predicted = [p.price.step for p in plans]
    got = [measured[n] for n in names]
    print(f"\n{model}, {world} processes, {len(plans)} plans (of the ranking, spread), profile {plans[0].analysis.state.cluster.name}")
    print(f"  {'plan':44} {'predicted':>10} {'measured':>10}")
    for name, p, m in zip(names, predicted, got):
        print(f"  {name:44} {p * 1e3:8.2f}ms {m * 1e3:8.2f}ms")
    rho = spearman(predicted, got)
    best = min(got)
    top1 = got[0] / best - 1
    print(f"  Spearman {rho:.2f} (target >= 0.8); predicted best measured {top1 * 100:.0f}% above the measured best (target <= 15%)")
    return [{"plan": n, "predicted": p, "measured": m} for n, p, m in zip(names, predicted, got)]


if __name__ == "__main__":
    main()
