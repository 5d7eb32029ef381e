"""autopar against Paddle's own static semi-auto engine (``paddle.distributed.to_static`` ->
``DistModel``) on the same model, mesh, initial values and batches, CPU gloo.

    python benchmarks/bench_vs_paddle.py [--models llama,gpt2,bert,vit,mixer] [--meshes dp2,mp2,dp2xmp2]
                                         [--steps 40] [--warmup 5] [--rounds 2] [--timeout 300]

Each (round, model, mesh, engine) is its own job under ``python -m autopar.launch --nproc N``
(the two engines never share a process: their communicators are made differently), Paddle's
job then autopar's, round after round; rank 0 writes its figures as JSON. A job runs the
training loop a user writes: SGD (lr 0.1), the global batch of each step from one numpy
generator, the loss fetched every step; ``warmup`` steps, then ``steps`` timed one by one.

- **Models**: the zoo (``autopar/testing/zoo``) at its default sizes (batch 4; sequence 16 for
  the language models: the issue's Llama, vocab 64, hidden 32, 2 layers). Paddle's engine gets
  the zoo's own ``network(config)``, made in dynamic mode; autopar the zoo's static ``build``.
- **Annotations**: one source, the zoo's: the placements autopar records for the static build
  are given to Paddle as ``layer.weight = dist.shard_tensor(layer.weight, mesh, placements)``
  per parameter (by structured name) and as the feeds' ``DistributedInputSpec``s.
- **Initial values**: the serial static start-up's values, copied by structured name into the
  dynamic layer before it is sharded; autopar runs the same start-up program (``run_startup``).
- **Data**: ``DistModel`` is given ``input_spec`` (no loader: ``dist.shard_dataloader`` fails
  under numpy 2, see PADDLE_NOTES.md) and each step the global arrays as
  ``dist.shard_tensor(paddle.to_tensor(array), mesh, placements)``, which it feeds as the local
  pieces; autopar's ``exe.run`` takes the global arrays.
- **Setup** (build -> first step done, communicators included): Paddle = init_parallel_env +
  dynamic layer + shard + ``to_static`` + ``train()`` + first step; autopar = static build +
  ``compile`` + ``Executor`` + ``run_startup`` + first step. Not counted: the serial start-up and
  the annotated static build the Paddle job reads its initial values and placements from.
- **Collectives per step**: Paddle's, the collective ops of ``DistModel.dist_main_program()``
  (bytes from the local shapes of their values, nccl-tests' convention as autopar's: the input
  for all_reduce / reduce_scatter / all_to_all, the output otherwise); autopar's, the rank plan
  of the step that fetches the loss (``dist.rank_plan(rank, backend, fetches=[loss])``).
- **= serial**: the first 3 losses within rtol 1e-5 of a serial single-process run of the
  zoo's program (``Executor.run``) on the same batches.

Paddle's engine does not run on CPU as released; the four monkeypatches it needs are in
:func:`patch_paddle_for_cpu`, each named by the failure it fixes. A job that fails or hangs
(``--timeout``) prints its error in the table instead of a time. Measured 2026-11-26 (Paddle
3.3.1, 2 cores): with them Paddle's engine runs dp2 and mp2 of every zoo model equal to serial
except ViT dp2 (``Unimplemented cpu kernel for all_to_all``); dp2xmp2 runs but is wrong: every
static-graph collective of a CPU process runs on the first gloo communicator it used, so each
dp half trains on its own (ranks 0, 1 and ranks 2, 3 report different losses whose mean is serial's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

warnings.filterwarnings("ignore")

RESULTS_ENV = "AUTOPAR_BENCH_RESULTS"  # where a job's rank 0 writes its figures (JSON)
CHECKED_STEPS, RTOL, LR = 3, 1e-5, 0.1
MESHES = {  # name -> (mesh shape as a nested list, dim names); Paddle's and autopar's are the same
    "dp2": ([0, 1], ["dp"]),
    "mp2": ([0, 1], ["mp"]),
    "dp2xmp2": ([[0, 1], [2, 3]], ["dp", "mp"]),
}
MODELS = ("llama", "gpt2", "bert", "vit", "mixer")
SHAPE = {"batch": 4, "seq": 16}
RING_BASE = 1000  # Paddle's sub-groups get ring RING_BASE + bit mask of their ranks (patch 2)


# ---- the models, their batches, the serial reference ---------------------------------------


def zoo_model(name: str) -> tuple[Any, Any]:
    """The zoo module and its default config."""
    import importlib

    module = importlib.import_module(f"autopar.testing.zoo.{name}")
    return module, module.Config()


def batches(name: str, steps: int) -> list[dict[str, np.ndarray]]:
    """The global batch of each step (the same in every job)."""
    from autopar.testing.serial import random_feeds

    module, config = zoo_model(name)
    if hasattr(module, "feeds"):  # the zoo's own data (ignored labels, padded rows)
        return module.feeds(config, SHAPE["batch"], SHAPE["seq"], steps)
    seed = module.build(config, mesh=None, **SHAPE)
    return random_feeds(seed.feeds, steps, classes=getattr(config, "num_classes", getattr(config, "vocab_size", 10)))


def serial_losses(name: str) -> list[float]:
    """The first losses of the zoo's serial program run by Paddle's Executor in this process."""
    from autopar.testing.serial import run_serial

    module, config = zoo_model(name)
    seed = module.build(config, mesh=None, **SHAPE)
    result = run_serial(seed.main, seed.startup, batches(name, CHECKED_STEPS), [seed.loss])
    return [float(np.asarray(f[0]).reshape(())) for f in result.fetches]


@dataclass
class Started:
    """A job after its first step: setup seconds, one training step (global batch -> loss), the
    losses so far, the collectives of a step (count, bytes, by kind)."""

    setup: float
    step: Callable[[dict[str, np.ndarray]], float]
    losses: list[float]
    comm: dict[str, Any]


def mesh_of(name: str) -> Any:
    import autopar

    shape, dims = MESHES[name]
    return autopar.ProcessMesh(shape, dims)


# ---- Paddle's engine -------------------------------------------------------------------------


def patch_paddle_for_cpu() -> None:
    """The smallest changes that make ``dist.to_static`` / ``DistModel`` run on CPU with gloo
    (this process only). Without each, the named failure:

    1. ``ProcessGroup.instantiate`` -> ``AssertionError: No CUDA device found`` (it knows CUDA,
       XPU and custom devices only): on CPU the world group (ring 0) is the gloo context
       ``init_parallel_env`` made; any other group of 2+ ranks gets a gloo comm context for its
       ring id; its barriers are ``paddle.distributed.barrier()``.
    2. (dp x mp only) ``new_process_group`` numbers groups in the order each process makes them:
       ranks 0, 1 number their mp group [0, 1] ring 14 and ranks 2, 3 number [2, 3] ring 14
       too; gloo's rendezvous keys are prefixed by the ring id and collide (``RuntimeError:
       ... connect ...: Connection refused`` / ``TIMEOUT``): a group's ring id is made from its ranks.
    3. ``paddle._legacy_C_ops.barrier`` (start-up, ``helper.init_pir``) -> ``RuntimeError:
       NCCLCommContext is nullptr`` (the CPU barrier kernel wants NCCL): ``dist.barrier()``.
    4. Data parallel's averaging all_reduce (a ``Partial(avg)`` gradient made Replicate) ->
       ``InvalidArgumentError: Unsupported reduce type: 4`` (gloo has no average): a summing
       all_reduce, then a scale by 1 / the group's size.
    """
    import paddle
    import paddle.distributed as pdist
    import paddle.distributed.auto_parallel.static.engine  # noqa: F401  (loads the modules patched below)
    from paddle.base import core
    from paddle.base.libpaddle.pir import create_op_dist_attribute
    from paddle.distributed.auto_parallel.static import process_group
    from paddle.distributed.auto_parallel.static.reshard_funcs import p_to_r_reshard_func
    from paddle.distributed.auto_parallel.static.utils import dygraph_guard
    from paddle.distributed.collective import _get_global_env

    @dygraph_guard
    def instantiate(self: Any) -> None:  # 1
        if self._is_instantiate:
            return
        rank = _get_global_env().rank
        if self.id != 0 and self.nranks >= 2 and rank in self.ranks:
            store = core.create_or_get_global_tcp_store()
            core.CommContextManager.create_gloo_comm_context(store, str(self.id), self.local_rank(rank), self.nranks)
        if self.nranks > 1:
            pdist.barrier()
        self._is_instantiate = True

    make_group = process_group.new_process_group

    def new_process_group(ranks: Any, group_id: Any = None, force_new: bool = False, kind: Any = None) -> Any:  # 2
        if group_id is None:  # the same ring id for the same ranks on every process, another for other ranks
            group_id = RING_BASE + sum(1 << r for r in set(ranks))
        return make_group(ranks, group_id, force_new, kind)

    def barrier(x: Any, out: Any, *attrs: Any) -> Any:  # 3
        pdist.barrier()
        return out

    to_replicate = p_to_r_reshard_func.PToRReshardFunction.reshard

    def reshard(self: Any, src: Any, dst: Any, value: Any, dst_type: Any) -> Any:  # 4
        if src.partial_status[0] != core.ReduceType.kRedAvg:
            return to_replicate(self, src, dst, value, dst_type)
        mesh = src.process_mesh
        group = new_process_group(sorted(mesh.process_ids))
        op = value.get_defining_op()
        chunk = op.dist_attr.chunk_id if op.dist_attr else -1
        summed = paddle._C_ops.all_reduce(value, group.id, int(core.ReduceType.kRedSum))
        summed.set_type(dst_type)
        summed.get_defining_op().dist_attr = create_op_dist_attribute(mesh, [src], [dst], chunk)
        out = paddle._C_ops.scale(summed, 1.0 / len(mesh.process_ids), 0.0, True)
        out.set_type(dst_type)
        out.get_defining_op().dist_attr = create_op_dist_attribute(mesh, [dst], [dst], chunk)
        return out

    process_group.ProcessGroup.instantiate = instantiate
    for name, module in list(sys.modules.items()):  # every module that imported it by name
        if name.startswith("paddle") and getattr(module, "new_process_group", None) is make_group:
            module.new_process_group = new_process_group
    paddle._legacy_C_ops.barrier = barrier
    p_to_r_reshard_func.PToRReshardFunction.reshard = reshard


def zoo_annotations(name: str, mesh_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the zoo annotates for ``mesh_name``, read back from its static build: Paddle
    placements by parameter structured name, and by feed name (Replicate where it says nothing)."""
    import paddle.distributed as pdist

    from autopar.annotate import annotations_of

    module, config = zoo_model(name)
    mesh = mesh_of(mesh_name)
    seed = module.build(config, mesh=mesh, **SHAPE)
    by_label = {label: attr.to_placements() for attr, label in annotations_of(seed.main).tensors.values()}
    whole = [pdist.Replicate() for _ in range(mesh.ndim)]
    params = {sname: by_label.get(p.name, whole) for sname, p in seed.layers["model"].named_parameters()}
    return params, {feed: by_label.get(feed, whole) for feed in seed.feeds}


def serial_start(name: str) -> dict[str, np.ndarray]:
    """The serial start-up's parameter values by structured name."""
    import paddle

    module, config = zoo_model(name)
    seed = module.build(config, mesh=None, **SHAPE)
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        paddle.static.Executor(paddle.CPUPlace()).run(seed.startup)
    parameters = seed.layers["model"].named_parameters()
    return {sname: np.array(scope.find_var(p.name).get_tensor()) for sname, p in parameters}


def paddle_job(name: str, mesh_name: str, feeds: list[dict[str, np.ndarray]]) -> Started:
    """Paddle's engine on the zoo model, first step done."""
    import paddle
    import paddle.distributed as pdist
    from paddle.distributed.auto_parallel.static.dist_input_spec import DistributedInputSpec

    from autopar.runtime.native import wait_for_store

    module, config = zoo_model(name)
    start_values = serial_start(name)
    param_placements, feed_placements = zoo_annotations(name, mesh_name)
    paddle.disable_static()
    patch_paddle_for_cpu()
    mesh = mesh_of(mesh_name).to_paddle()

    def global_tensors(feed: dict[str, np.ndarray]) -> list[Any]:
        names = module.INPUTS + module.LABELS
        return [pdist.shard_tensor(paddle.to_tensor(feed[n]), mesh, feed_placements[n]) for n in names]

    start = time.perf_counter()
    wait_for_store(int(os.environ["PADDLE_TRAINER_ID"]))  # ranks > 0 would otherwise retry every 3 s
    pdist.init_parallel_env()
    model = module.network(config)
    sublayers = dict(model.named_sublayers(include_self=True))
    for sname, parameter in list(model.named_parameters()):
        parameter.set_value(start_values[sname])
        owner, _, attr = sname.rpartition(".")
        setattr(sublayers[owner], attr, pdist.shard_tensor(parameter, mesh, param_placements[sname]))
    first = global_tensors(feeds[0])
    n_inputs = len(module.INPUTS)
    specs = [DistributedInputSpec.from_dtensor(t, f"feed{i}") for i, t in enumerate(first)]
    loss_fn = functools.partial(module.compute_loss, config)
    optimizer = paddle.optimizer.SGD(LR, parameters=model.parameters())
    dist_model = pdist.to_static(model, None, loss_fn, optimizer, input_spec=[specs[:n_inputs], specs[n_inputs:]])
    dist_model.train()
    losses = [float(dist_model(*first))]
    setup = time.perf_counter() - start

    def step(feed: dict[str, np.ndarray]) -> float:
        return float(dist_model(*global_tensors(feed)))

    return Started(setup, step, losses, paddle_collectives(dist_model.dist_main_program()))


# collective op names in Paddle's dist programs -> NCCL kind
PADDLE_COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "c_allreduce_sum": "all_reduce",
    "c_allreduce_sum_": "all_reduce", "mp_allreduce_sum": "all_reduce", "mp_allreduce_sum_": "all_reduce",
    "c_allreduce_max": "all_reduce", "c_allreduce_max_": "all_reduce",
    "all_gather": "all_gather", "c_allgather": "all_gather", "c_concat": "all_gather",
    "reduce_scatter": "reduce_scatter", "c_reducescatter": "reduce_scatter",
    "all_to_all": "all_to_all", "alltoall": "all_to_all", "broadcast": "broadcast", "c_broadcast": "broadcast",
    "send_v2": "send", "p_send": "send", "recv_v2": "recv", "p_recv": "recv",
}  # fmt: skip
SIZED_BY_INPUT = {"all_reduce", "reduce_scatter", "all_to_all"}


def local_bytes(value: Any) -> int:
    """Bytes of this rank's piece of a PIR value (dist types carry the global shape)."""
    shape = list(value.shape)
    if value.is_dist_dense_tensor_type():
        attr = value.dist_attr()
        mesh_shape = attr.process_mesh.shape
        for dim, mesh_dim in enumerate(attr.dims_mapping):
            if mesh_dim >= 0:
                shape[dim] = -(-shape[dim] // mesh_shape[mesh_dim])
    itemsize = np.dtype(str(value.dtype).replace("paddle.", "")).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def paddle_collectives(program: Any) -> dict[str, Any]:
    kinds, total = {}, 0
    for op in program.global_block().ops:
        kind = PADDLE_COLLECTIVES.get(op.name().split(".", 1)[-1])
        if kind is None:
            continue
        value = op.operand_source(0) if kind in SIZED_BY_INPUT or op.num_results() == 0 else op.result(0)
        kinds[kind] = kinds.get(kind, 0) + 1
        total += local_bytes(value)
    return {"count": sum(kinds.values()), "bytes": total, "kinds": kinds}


# ---- autopar ---------------------------------------------------------------------------------


def autopar_job(name: str, mesh_name: str, feeds: list[dict[str, np.ndarray]]) -> Started:
    """autopar on the zoo program, first step done."""
    import autopar

    module, config = zoo_model(name)
    mesh = mesh_of(mesh_name)
    serial_start(name)  # the process as warm as Paddle's job at its start (which builds it for its initial values)
    start = time.perf_counter()
    seed = module.build(config, mesh=mesh, **SHAPE)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    exe = autopar.Executor(dist)
    exe.run_startup()
    losses = [float(exe.run(feeds[0], fetch_list=[seed.loss])[0])]
    setup = time.perf_counter() - start

    def step(feed: dict[str, np.ndarray]) -> float:
        return float(exe.run(feed, fetch_list=[seed.loss])[0])

    plan = dist.rank_plan(exe.rank, exe.backend, fetches=[seed.loss])
    kinds: dict[str, int] = {}
    for collective, _ in plan.collectives:
        kinds[str(collective.kind)] = kinds.get(str(collective.kind), 0) + 1
    comm = {"count": sum(kinds.values()), "bytes": sum(c.bytes for c, _ in plan.collectives), "kinds": kinds}
    return Started(setup, step, losses, {**comm, "backend": exe.backend})


# ---- one job ---------------------------------------------------------------------------------


def run_job(engine: str, name: str, mesh_name: str, steps: int, warmup: int) -> dict[str, Any]:
    feeds = batches(name, 1 + warmup + steps)
    job = (paddle_job if engine == "paddle" else autopar_job)(name, mesh_name, feeds)
    times = []
    for i, feed in enumerate(feeds[1:], start=1):
        began = time.perf_counter()
        job.losses.append(job.step(feed))
        if i > warmup:
            times.append(time.perf_counter() - began)
    return {"setup": job.setup, "times": times, "losses": job.losses[:CHECKED_STEPS], "comm": job.comm}


def job_main(argv: list[str]) -> None:
    engine, name, mesh_name, steps, warmup = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    figures = run_job(engine, name, mesh_name, steps, warmup)
    if int(os.environ["PADDLE_TRAINER_ID"]) == 0:
        with open(os.environ[RESULTS_ENV], "w") as out:
            json.dump(figures, out)


# ---- the driver: alternating jobs, the table -------------------------------------------------


def launch(engine: str, name: str, mesh_name: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """One job under autopar.launch; its rank 0's figures, or ``{"error": one line}``."""
    nproc = int(np.prod(np.array(MESHES[mesh_name][0]).shape))
    path = os.path.join(directory, f"{engine}-{name}-{mesh_name}.json")
    job = ["--job", engine, name, mesh_name, str(args.steps), str(args.warmup)]
    launcher = [sys.executable, "-m", "autopar.launch", "--nproc", str(nproc), "--timeout", str(args.timeout)]
    env = {**os.environ, RESULTS_ENV: path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            [*launcher, __file__, *job], cwd=root, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"hung: no result after {args.timeout} s (job killed)"}
    if out.returncode or not os.path.exists(path):
        return {"error": error_line(out.stdout + "\n" + out.stderr, out.returncode)}
    with open(path) as figures:
        result = json.load(figures)
    os.remove(path)
    return result


ERROR = re.compile(r"^(?:\[rank (\d+)\] )?\s*((?:[\w.]+(?:Error|Exception)|FatalError|Segmentation fault)\b.*)$")


def error_line(output: str, code: int) -> str:
    """The last error printed by the rank the launcher names (Paddle's "In user code:" wrappers
    skipped), else the launcher's verdict, on one line."""
    lines = output.splitlines()
    verdict = [line for line in lines if line.startswith("autopar.launch:")]
    at_fault = re.search(r"rank (\d+)", verdict[-1]) if verdict else None
    found = [m for m in map(ERROR.match, lines) if m and not m.group(2).endswith("In user code:")]
    errors = [(m.group(1), m.group(2).strip()) for m in found]
    mine = [text for rank, text in errors if at_fault is None or rank == at_fault.group(1)] or [e for _, e in errors]
    if mine:
        return f"exit {code}: {mine[-1]}"[:200]
    return f"exit {code}: {verdict[-1] if verdict else (lines[-1] if lines else 'no output')}"[:200]


def equals_serial(losses: list[float], serial: list[float]) -> str:
    got, want = np.asarray(losses, float), np.asarray(serial, float)
    if got.shape != want.shape:
        return "?"
    diff = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))
    return "yes" if diff <= RTOL else f"NO ({diff:.1e})"


def summary(jobs: list[dict[str, Any]], serial: list[float]) -> dict[str, Any] | str:
    """Median and range over rounds of a job's figures, or the first failure's line."""
    failed = [j["error"] for j in jobs if "error" in j]
    if failed:
        return failed[0] if len(failed) == len(jobs) else f"{len(failed)}/{len(jobs)} rounds failed: {failed[0]}"
    steps = [statistics.median(j["times"]) for j in jobs]
    verdicts = sorted({equals_serial(j["losses"], serial) for j in jobs})
    return {"step": steps, "setup": [j["setup"] for j in jobs], "comm": jobs[0]["comm"], "serial": "/".join(verdicts)}


def spread(values: list[float], scale: float, digits: int) -> str:
    mid = statistics.median(values) * scale
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} [{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}]"


def ratio(ours: list[float], theirs: list[float]) -> str:
    per_round = [a / b for a, b in zip(ours, theirs)]
    text = f"{statistics.median(ours) / statistics.median(theirs):.2f}"
    return text if len(per_round) == 1 else text + " (" + "/".join(f"{r:.2f}" for r in per_round) + ")"


def comm_text(comm: dict[str, Any]) -> str:
    return f"{comm['count']} / {comm['bytes'] / 1024:.1f} KiB"


def report(name: str, mesh_name: str, paddle: dict[str, Any] | str, ours: dict[str, Any] | str) -> None:
    head = f"{name:6s} {mesh_name:8s}"
    if isinstance(paddle, str) or isinstance(ours, str):
        for engine, figures in (("Paddle", paddle), ("autopar", ours)):
            if isinstance(figures, str):
                print(f"{head} {engine:7s} FAILED: {figures}", flush=True)
            else:
                backend = f" ({figures['comm']['backend']})" if engine == "autopar" else ""
                print(f"{head} {engine:7s} step {spread(figures['step'], 1e3, 2)} ms{backend}, setup "
                      f"{spread(figures['setup'], 1, 2)} s, coll {comm_text(figures['comm'])}, = serial {figures['serial']}")  # fmt: skip
        return
    print(
        f"{head} {spread(paddle['step'], 1e3, 2):>20s} {spread(ours['step'], 1e3, 2):>20s} {ratio(ours['step'], paddle['step']):>17s}"
        f"  {spread(paddle['setup'], 1, 2):>17s} {spread(ours['setup'], 1, 2):>17s} {ratio(ours['setup'], paddle['setup']):>17s}"
        f"  {comm_text(paddle['comm']):>16s} {comm_text(ours['comm']):>17s}  {paddle['serial']:>13s} {ours['serial']:>13s}"
        f"  {ours['comm']['backend']}",
        flush=True,
    )


def driver() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--meshes", default=",".join(MESHES), help=f"comma-separated, of {','.join(MESHES)}")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per job (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (Paddle's job, then autopar's)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a job counts as hung")
    args = parser.parse_args()
    models, meshes = args.models.split(","), args.meshes.split(",")
    for value, known in ((models, MODELS), (meshes, MESHES)):
        unknown = sorted(set(value) - set(known))
        if unknown:
            parser.error(f"unknown {unknown}; choose from {list(known)}")
    print(
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min, {os.cpu_count()} cores)"
    )
    serial = {name: serial_losses(name) for name in models}
    results = run_rounds(models, meshes, args)
    print(f"\nautopar vs Paddle's static semi-auto engine (to_static/DistModel, 4 CPU patches), CPU gloo, SGD, loss fetched "
          f"every step; batch {SHAPE['batch']}, seq {SHAPE['seq']}; {args.steps} timed steps after {1 + args.warmup}, "
          f"{args.rounds} alternating rounds: median [min-max over rounds]; ratio = autopar / Paddle (per round)")  # fmt: skip
    print(f"{'model':6s} {'mesh':8s} {'Paddle ms/step':>20s} {'autopar ms/step':>20s} {'step ratio':>17s}  {'Paddle setup s':>17s} "
          f"{'autopar setup s':>17s} {'setup ratio':>17s}  {'Paddle coll/step':>16s} {'autopar coll/step':>17s}  "
          f"{'Paddle=serial':>13s} {'autopar=serial':>13s}  backend")  # fmt: skip
    paddle_wrong_on_subgroups = False
    for name in models:
        for mesh_name in meshes:
            paddle = summary(results[("paddle", name, mesh_name)], serial[name])
            ours = summary(results[("autopar", name, mesh_name)], serial[name])
            report(name, mesh_name, paddle, ours)
            paddle_wrong_on_subgroups |= (
                mesh_name == "dp2xmp2" and isinstance(paddle, dict) and paddle["serial"] != "yes"
            )
    print(f"(coll/step: collectives a rank runs per step, count / bytes; =serial: the first {CHECKED_STEPS} losses within "
          f"rtol {RTOL:g} of the serial run)")  # fmt: skip
    if paddle_wrong_on_subgroups:
        print("(dp2xmp2, Paddle: on CPU every static-graph collective of a process runs on the first gloo communicator it "
              "used, whatever its ring (PADDLE_NOTES.md): the sub-group sums are wrong and its times are a wrong computation's)")  # fmt: skip
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def run_rounds(models: list[str], meshes: list[str], args: argparse.Namespace) -> dict[tuple, list[dict[str, Any]]]:
    """Every job of every round, Paddle's then autopar's for each model and mesh: figures by
    (engine, model, mesh), one per round."""
    results: dict[tuple, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.rounds):
            for name in models:
                for mesh_name in meshes:
                    for engine in ("paddle", "autopar"):
                        figures = launch(engine, name, mesh_name, args, directory)
                        results.setdefault((engine, name, mesh_name), []).append(figures)
    return results


if __name__ == "__main__":
    if "--job" in sys.argv:
        job_main(sys.argv[sys.argv.index("--job") + 1 :])
    else:
        driver()
