"""Step time of autopar's programs vs hand-written static programs on the same processes.

    python benchmarks/bench_runtime.py [--rounds 2]   # starts itself under autopar.launch --nproc 2

SimpleNet (Linear 256->1024->256->10, ReLU, cross-entropy, Momentum + L2), global batch 64, and
a tiny one (8->16->8->4, batch 8: latency-bound, ``dp-tiny``):

- dp=2: autopar (``x`` annotated ``["dp", None]``) vs the serial program on the local batch with
  an explicit ``all_reduce`` + ``scale(1/2)`` on every gradient before the optimizer;
- mp=2: autopar (linear1 column-, linear2 row-parallel by annotation) vs a hand-sharded program
  (local weight shapes, one ``all_reduce`` after linear2's matmul).

Each backend runs in its own 2-process job (native: whole program per step, gloo collectives
inside; host: segments + process-group collectives); the hand-written program runs in the
native job (its in-program collectives share the native rings; mixing them with the host's
process-group collectives in one process stalls gloo intermittently). Within a job, runs are
interleaved in blocks and a figure is the median over blocks of the mean step time. The jobs
run in alternating rounds (native, host, native, host, ...) and the table shows each figure's
median over the rounds, so the host backend's ratios to the hand-written program compare
figures of different jobs measured a minute apart (the per-round ratios are listed too:
their spread is the machine's noise). Every configuration runs without fetches and
(``+loss``) fetching the loss every step, as training loops do (autopar's fetch is made whole
inside the program: a data-parallel loss rides in the gradient bucket, no collective of its
own, no exchange). autopar runs with its gradient
all-reduce fusion (the default) and without it (``-unfused``: the like-for-like comparison with
the hand-written program, which all-reduces each gradient on its own).

The hand-written program runs twice: through ``Executor.run`` as a user writes it
(``hand-written``), and the way autopar runs its programs — interpreter built once, ops in
order in the calling thread (``hand-prepared``, :class:`autopar.runtime.prepared.PreparedProgram`)
— so the second ratio is autopar's own overhead, not the way it drives Paddle's interpreter.
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

SIZES = (256, 1024, 256, 10)
BATCH = 64
TINY_SIZES, TINY_BATCH = (8, 16, 8, 4), 8  # latency-bound: the collectives' launch, not their bytes, is the step
MODELS = {"dp": (SIZES, BATCH), "mp": (SIZES, BATCH), "dp-tiny": (TINY_SIZES, TINY_BATCH)}
BLOCKS, STEPS, WARMUP = 5, 40, 5
RESULTS_ENV = "AUTOPAR_BENCH_RESULTS"  # where a job's rank 0 writes its figures (JSON)


def hand_written(model: str, rank: int, world: int):
    """The static program a user would write by hand for this rank (ring 0 spans the world)."""
    import paddle

    (sizes, batch), mode = MODELS[model], model.split("-")[0]
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    local_batch = batch // world if mode == "dp" else batch
    hidden = sizes[1] // world if mode == "mp" else sizes[1]
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [local_batch, sizes[0]], "float32")
        label = paddle.static.data("label", [local_batch, 1], "int64")
        l1 = paddle.nn.Linear(sizes[0], hidden)
        l2 = paddle.nn.Linear(hidden, sizes[2], bias_attr=False)
        b2 = paddle.create_parameter([sizes[2]], "float32", is_bias=True)
        l3 = paddle.nn.Linear(sizes[2], sizes[3])
        partial = l2(paddle.nn.functional.relu(l1(x)))
        h = paddle.nn.functional.relu(partial + b2)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(l3(h), label))
        opt = paddle.optimizer.Momentum(0.1, momentum=0.9, weight_decay=paddle.regularizer.L2Decay(1e-4))
        params_grads = paddle.static.append_backward(loss)
        if mode == "dp":
            params_grads = [(p, paddle.scale(paddle._C_ops.all_reduce(g, 0, 0), 1.0 / world)) for p, g in params_grads]
        opt.apply_gradients(params_grads)
        if mode == "mp":  # row-parallel output: sum the partials (its backward is the identity)
            _all_reduce_after(partial)
    return main, startup, local_batch, loss


def _all_reduce_after(value) -> None:
    """Insert ``all_reduce(value)`` right after its producer; every other reader reads the sum."""
    import paddle

    paddle.pir.set_insertion_point_after(value.get_defining_op())
    summed = paddle._C_ops.all_reduce(value, 0, 0)
    for user in list(value.all_used_ops()):
        if user.id() != summed.get_defining_op().id():
            for i in range(user.num_operands()):
                if user.operand_source(i).is_same(value):
                    user.operand(i).set_source(summed)
    paddle.pir.reset_insertion_point_to_end()


def autopar_program(model: str, fuse: bool = True):
    """The DistributedProgram and the serial loss Value."""
    import autopar
    from autopar.testing.models import simple_net

    (sizes, batch), mode = MODELS[model], model.split("-")[0]
    net = simple_net(batch=batch, sizes=sizes)
    mesh = autopar.ProcessMesh([0, 1], [mode])
    if mode == "dp":
        autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    else:
        autopar.shard_tensor(net.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(net.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(net.layers["linear2"].weight, mesh, ["mp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup, strategy=autopar.Strategy(fuse_allreduce=fuse))
    return dist, net.loss


def timed(step) -> float:
    for _ in range(WARMUP):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS


def bench(model: str, rank: int, world: int, backend: str) -> dict[str, float]:
    import numpy as np

    import autopar

    rng = np.random.default_rng(0)
    sizes, batch = MODELS[model]
    feed = {"x": rng.standard_normal((batch, sizes[0])).astype("float32"),
            "label": rng.integers(0, sizes[3], (batch, 1)).astype("int64")}  # fmt: skip
    runs = {}
    for fuse in (True, False):
        dist, loss = autopar_program(model, fuse)
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        name = f"autopar-{backend}" + ("" if fuse else "-unfused")
        runs[name] = lambda exe=exe: exe.run(feed)
        if fuse:  # what every training loop does: fetch the loss each step
            runs[name + "+loss"] = lambda exe=exe, loss=loss: exe.run(feed, fetch_list=[loss])
    if backend == "native":  # the hand-written program's in-program collectives use the native rings
        runs.update(hand_runs(model, rank, world, feed))
    blocks: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(BLOCKS):
        for name, step in runs.items():
            blocks[name].append(timed(step))
    return {name: statistics.median(times) for name, times in blocks.items()}


def hand_runs(model: str, rank: int, world: int, feed: dict) -> dict:
    import paddle

    from autopar.runtime.prepared import PreparedProgram

    mode = model.split("-")[0]
    main, startup, local_batch, hand_loss = hand_written(model, rank, world)
    scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    lo = rank * local_batch if mode == "dp" else 0
    local = {k: v[lo : lo + local_batch] for k, v in feed.items()}
    with paddle.static.scope_guard(scope):
        exe.run(startup)

    def hand_step():
        with paddle.static.scope_guard(scope):
            exe.run(main, feed=local, fetch_list=[])

    def hand_step_loss():
        with paddle.static.scope_guard(scope):
            exe.run(main, feed=local, fetch_list=[hand_loss])

    # the same program run the way autopar runs its own: interpreter built once, ops in order
    prepared = PreparedProgram(main, scope, paddle.CPUPlace(), in_order=True)
    prepared_loss = PreparedProgram(main, scope, paddle.CPUPlace(), [hand_loss], in_order=True)
    return {
        "hand-written": hand_step,
        "hand-written+loss": hand_step_loss,
        "hand-prepared": lambda: prepared.run(local),
        "hand-prepared+loss": lambda: prepared_loss.run(local),
    }


def main() -> None:
    if "PADDLE_TRAINER_ID" not in os.environ:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the native and the host job")
        rounds = parser.parse_args().rounds
        root = Path(__file__).resolve().parents[1]
        results: list[dict[str, dict[str, float]]] = []  # one per round: mode -> name -> seconds
        with tempfile.TemporaryDirectory() as out:
            for round_ in range(rounds):
                merged: dict[str, dict[str, float]] = {}
                for backend in ("native", "host"):  # one job each: the two backends' communicators never share a process
                    path = os.path.join(out, f"{backend}{round_}.json")
                    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2", __file__, backend]
                    if subprocess.call(cmd, cwd=root, env={**os.environ, RESULTS_ENV: path}):
                        sys.exit(f"the {backend} run failed")
                    with open(path) as job:
                        for mode, times in json.load(job).items():
                            merged.setdefault(mode, {}).update(times)
                results.append(merged)
        report(results)
        return
    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    backend = sys.argv[1]
    figures = {model: bench(model, rank, world, backend) for model in MODELS}
    if rank == 0:
        with open(os.environ[RESULTS_ENV], "w") as out:
            json.dump(figures, out)


def report(results: list[dict[str, dict[str, float]]]) -> None:
    """One table per mode: each figure's median over the rounds, its ratio to the hand-written
    program (fetching the same loss for ``+loss``) and, fetching, to its own no-fetch step."""
    for model in results[0]:
        rounds = [r[model] for r in results]
        times = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
        (sizes, batch), mode = MODELS[model], model.split("-")[0]
        print(f"SimpleNet {model}: {mode}=2, batch {batch}, sizes {sizes}: median of {len(rounds)} rounds "
              "(hand-written: in the native jobs)")  # fmt: skip
        for name, t in times.items():
            fetching = name.endswith("+loss")
            suffix = "+loss" if fetching else ""
            ratios = []
            for hand in ("hand-written", "hand-prepared"):
                per_round = "/".join(f"{r[name] / r[hand + suffix]:.2f}" for r in rounds)
                ratios.append(f"{t / times[hand + suffix]:5.2f} ({per_round})")
            own = f"   vs own no-fetch {t / times[name.removesuffix('+loss')]:5.2f}" if fetching else ""
            print(f"  {name:22s} {t * 1e3:7.2f} ms/step   vs hand-written{suffix:5s} {ratios[0]}   vs hand-prepared{suffix:5s} {ratios[1]}{own}", flush=True)


if __name__ == "__main__":
    main()
