"""Calibrate the CPU profiles on this machine: ``python -m autopar.cost_model.calibrate
[--communicator gloo|shm]`` (``cpu-gloo`` / ``cpu-shm``).

Spawns 2 and 4 local processes (the ``PADDLE_*`` variables set, dynamic-mode
``paddle.distributed`` on gloo), times all_reduce, all_gather, broadcast, send/recv and the
host backend's *exchange* (``all_gather_object`` of a numpy array: how it runs a sub-group
collective) over a set of sizes (all_gather up to 192 MiB: an emulated all_to_all gathers p
times its send buffer), each size in several rounds spread over the run (reduced to the lower
quartile of the reps: :func:`summary`), and fits, per collective, the latency and bandwidth of
the alpha-beta formula in :mod:`autopar.cost_model.comm` plus, where it lowers the error, a
knee at 32 MiB (from that size on the buffers are fresh memory: see
:class:`~autopar.cost_model.cluster.Link`), minimizing the mean absolute relative error (over
both world sizes at once, so the fit keeps the formula's dependence on the group size), and
per world size (``all_reduce@4``: with 4 processes on 2 cores the processes contend for the
cores, which no link formula predicts; a group of that size uses its own fit). gloo has no
reduce_scatter and no all_to_all (``ProcessGroupGloo does not support ...``): the profile
marks them *emulated*, priced as the all_reduce / all_gather plus slice that runs instead; the
benchmark times those emulations and the host backend's sub-group collectives too.

``--communicator shm`` times the host backend's shared-memory communicator instead
(:mod:`autopar.runtime.shm`, what one-machine jobs run): every kind native, sub-groups among
their members only; fitted the same way into ``cpu-shm``.

Also measured: the device (:class:`~autopar.cost_model.cluster.Device`): peak float32 matmul
FLOP/s and copy bandwidth of one process (numpy, the best of 7 trials), the machine's memory,
and what Paddle's CPU kernels achieve (:func:`measure_paddle_device`: matmul rate, streamed
bandwidth, the fixed cost of an op and of a program run); ``--device-from PROFILE`` keeps an
earlier profile's device figures instead (a busy machine measures them low), ``--device-only``
re-measures the device alone, ``--samples-from`` refits saved samples. The profile is written
to ``cost_model/profiles/cpu_gloo.json`` / ``cpu_shm.json`` (input profiles, committed), or
``--out``. About four minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autopar.collective_kinds import kind_of, point_to_point, priced_kinds
from autopar.cost_model.cluster import EMULATIONS, Cluster, Device, Link, load_cluster
from autopar.cost_model.comm import coefficients
from autopar.cost_model.kernel_rates import measure_kernel_rates

# all_reduce, all_gather, broadcast, send_recv (gloo emulates the others) and the host backend's exchange
MEASURED = (*(k for k in priced_kinds() if kind_of(k).emulated_by is None), "exchange")
SHM_MEASURED = tuple(priced_kinds())  # every priced kind: the shared-memory communicator runs each
EMULATED = tuple(EMULATIONS)  # reduce_scatter, all_to_all: gloo has neither
CALIBRATION_SIZES = (6 << 10, 24 << 10, 96 << 10, 384 << 10, 1536 << 10, 6 << 20, 24 << 20, 40 << 20, 96 << 20)
ROUNDS = 6  # each size is timed in 6 rounds spread over the run (a burst of load hits one round)
KNEE = 32 << 20  # glibc's largest dynamic mmap threshold: every allocation this big is fresh memory
EXTRA_SIZES = {k: kind_of(k).calibration_sizes for k in priced_kinds() if kind_of(k).calibration_sizes}  # all_gather: 192 MiB
SUBGROUP = {"sub_all_reduce": "all_reduce", "sub_all_gather": "all_gather"}  # over ranks (0, 1), host backend
PROFILE_PATH = Path(__file__).parent / "profiles" / "cpu_gloo.json"
SHM_PROFILE_PATH = Path(__file__).parent / "profiles" / "cpu_shm.json"
COMMUNICATORS = ("gloo", "shm")


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured collective: ``seconds`` for ``nbytes`` (comm.py's convention) over ``world`` ranks."""

    kind: str
    world: int
    nbytes: int
    seconds: float  # the lower quartile over reps of the slowest rank's time (see :func:`summary`)
    reps: tuple[float, ...] = field(default=(), compare=False)  # every rep's slowest-rank time


# ---- parent side -----------------------------------------------------------------------


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def measure(
    world: int,
    sizes: Sequence[int],
    kinds: Sequence[str] = MEASURED,
    timeout: float = 600.0,
    sizes_of: Mapping[str, Sequence[int]] | None = None,
    communicator: str = "gloo",
) -> list[Sample]:
    """Run ``world`` processes here and time each collective at each size (``sizes_of``: other
    sizes for some kinds) through ``communicator``: ``"gloo"`` (dynamic-mode
    ``paddle.distributed``) or ``"shm"`` (the host backend's shared-memory communicator,
    :mod:`autopar.runtime.shm`). All kinds and sizes are timed in the same rounds, so a burst
    of load from elsewhere hits all of them alike."""
    plan = {kind: [int(n) for n in (sizes_of or {}).get(kind, sizes)] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.json"
        argv = ["-m", "autopar.cost_model.calibrate", "--worker", "--communicator", communicator, "--out", str(out),
                "--plan", json.dumps(plan)]  # fmt: skip
        run_processes(world, argv, timeout)
        return [
            Sample(i["kind"], i["world"], i["nbytes"], i["seconds"], tuple(i["reps"]))
            for i in json.loads(out.read_text())
        ]


def run_processes(world: int, argv: Sequence[str], timeout: float = 600.0) -> None:
    """``python *argv`` in ``world`` local processes with the ``PADDLE_*`` variables of a gloo
    job (``paddle.distributed.init_parallel_env()`` works in them); raises if one fails."""
    ports = _free_ports(world + 1)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports[:world])
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            PADDLE_DISTRI_BACKEND="gloo", PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(world),
            PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank]}",
            PADDLE_MASTER=f"127.0.0.1:{ports[world]}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[world]),
            OMP_NUM_THREADS="1", GLOG_v="0", GLOG_minloglevel="2",
        )  # fmt: skip
        cmd = [sys.executable, *argv]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        if rank == 0:
            time.sleep(0.5)  # rank 0 hosts the store; later ranks retry slowly if early
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"rank {rank} exited {proc.returncode}: {err[-2000:]}")
    if errors:
        raise RuntimeError("worker processes failed:\n" + "\n".join(errors))


def summary(reps: Sequence[float]) -> float:
    """The figure a set of reps is reduced to: their lower quartile. The machine may be shared
    (other processes only ever add time to a rep: a scheduler time slice is ~4 ms, more than a
    1 MiB collective takes), while the contention of 4 processes on 2 cores, which every rep
    sees, stays in."""
    return float(np.quantile(np.asarray(reps, dtype=float), 0.25))


def fit_links(samples: Sequence[Sample]) -> dict[str, Link]:
    """Per kind: one fit over every world size (``kind``) and one per world size (``kind@p``)."""
    fits = {}
    for kind in dict.fromkeys(s.kind for s in samples):
        fits[kind] = fit_link(samples, kind)
        for world in sorted({s.world for s in samples if s.kind == kind}):
            fits[f"{kind}@{world}"] = fit_link([s for s in samples if s.world == world], kind)
    return fits


def _formula(kind: str) -> str:
    return "all_gather" if kind == "exchange" else kind  # an exchange is an all_gather of pickled inputs


def fit_link(samples: Sequence[Sample], kind: str, knee: float = KNEE) -> Link:
    """Latency and bandwidth of ``kind``'s ring formula and, where it lowers the error, the
    bandwidth of a knee at ``knee`` bytes (from that size on the buffers are fresh memory:
    :class:`Link`). The fit minimizes the mean absolute *relative* error (the benchmark's
    measure; robust to the odd sample a burst of load slowed down): iteratively reweighted
    least squares, every figure kept >= 0."""
    rows = [s for s in samples if s.kind == kind and s.world > 1]
    design = np.array([(*coefficients(_formula(kind), s.world, s.nbytes), s.nbytes * (s.nbytes >= knee)) for s in rows])
    alpha, beta, gamma = _least_relative_error(design / np.array([[s.seconds] for s in rows]))
    bandwidth = 1.0 / max(beta, 1e-15)
    if gamma <= 0:
        return Link(latency=float(alpha), bandwidth=float(bandwidth))
    return Link(latency=float(alpha), bandwidth=float(bandwidth), knee=float(knee), knee_bandwidth=float(1.0 / gamma))


def _least_relative_error(scaled: np.ndarray) -> np.ndarray:
    """``argmin sum |scaled x - 1|`` over ``x >= 0`` by iteratively reweighted least squares."""
    weights = np.ones(len(scaled))
    for _ in range(100):
        figures = _nonnegative_lstsq(scaled * weights[:, None], weights)
        new = 1.0 / np.sqrt(np.maximum(np.abs(scaled @ figures - 1.0), 1e-4))  # sum w^2 r^2 = sum |r|
        if np.allclose(new, weights, rtol=1e-6):
            break
        weights = new
    return figures


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0`` (a few columns: every subset of free columns tried)."""
    best, best_error = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), size):
            if not a[:, free].any(axis=0).all():
                continue
            x = np.zeros(a.shape[1])
            x[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            error = float(np.sum((a @ x - b) ** 2))
            if (x >= 0).all() and error < best_error:
                best, best_error = x, error
    return best


def measure_device(trials: int = 7) -> Device:
    """float32 matmul FLOP/s and copy bandwidth of one process, the best of ``trials`` (peak
    figures; other work on the machine only ever slows a trial down); the machine's memory."""
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    src, dst = np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)
    a @ a
    np.copyto(dst, src)
    flops, bandwidth = 0.0, 0.0
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(5):
            a @ a
        flops = max(flops, 5 * 2 * 512**3 / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(3):
            np.copyto(dst, src)
        bandwidth = max(bandwidth, 3 * 2 * src.nbytes / (time.perf_counter() - start))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device((("float32", float(flops)),), float(bandwidth), float(memory))


STREAM_SIZES = tuple(1 << k for k in range(11, 25))  # float32 elements: 8 KiB .. 64 MiB per operand
DEVICE_SOURCE = (
    "peaks: numpy float32 512x512 matmul and a 32 MiB copy in one process, best of 7; memory = physical RAM; "
    "achieved: Paddle's static Executor on CPU in one process (measure_paddle_device): chains of 10 adds "
    "(the median bandwidth over 16 .. 64 MiB operands; "
    "cache_bandwidth: over those whose traffic fits the level-2 cache, cache_bytes), "
    "an add of 8 KiB and a tiny GPT block's training step per op (op_seconds: the larger), a one-op program's run "
    "(segment_seconds), each a difference of two programs, best of 5; matmul rate and kernel_seconds: the profiled "
    "training steps of a GPT block, Llama, ViT and MLP-Mixer (kernel_rates.py); cores: os.cpu_count(), shared by "
    "the node's processes"
)


def measure_paddle_device(peak: Device, trials: int = 5) -> Device:
    """``peak`` with what Paddle's CPU kernels achieve in one process (the compute side prices
    with these). From chains of float32 adds over operands of 8 KiB .. 64 MiB: the fixed cost
    of one op (``op_seconds``: an add of the smallest size, its work negligible), the bandwidth
    adds stream out of cache (the median over operands of 16 .. 64 MiB) and in the cache
    (``cache_bytes``: the level-2 cache's size; the median over adds whose traffic is an eighth
    of it or more and fits). From the profiled training steps of four reference models
    (:mod:`~autopar.cost_model.kernel_rates`): the rate their matmuls achieve and each kernel's
    seconds per element. The fixed cost of one program run (``segment_seconds``: a run of a program of one op, less
    it); ``op_seconds`` is raised to a training step's cost per op where that is more
    (:func:`_training_op_seconds`). Each op's time is a difference of two programs that make their inputs in the program
    (random: no feed copies, nothing folded at compile time) and fetch one float, each timing
    the best of ``trials`` (other work only ever slows a trial down)."""
    import paddle

    paddle.enable_static()

    def extra_seconds(build, ops: int) -> float:  # seconds of each of ``ops`` more ops
        return (_program_seconds(paddle, build(ops), trials) - _program_seconds(paddle, build(0), trials)) / ops

    adds = {}
    for count in STREAM_SIZES:
        chain = max(10, min(1000, (1 << 25) // count))  # enough that their time stands out of the run's noise
        adds[count] = extra_seconds(lambda n, count=count: _add_chain(count, n), chain)
    op_seconds = max(adds[min(adds)], 0.0)
    cache_bytes = _cache_bytes()
    in_cache = [12 * n / (t - op_seconds) for n, t in adds.items() if cache_bytes / 8 <= 12 * n <= cache_bytes and t > op_seconds]
    streamed = [12 * n / (t - op_seconds) for n, t in adds.items() if 4 * n >= 16 << 20]
    kernels, matmul = measure_kernel_rates(paddle)
    segment_seconds = max(_program_seconds(paddle, _add_chain(1 << 11, 1), trials) - op_seconds, 0.0)
    op_seconds = max(op_seconds, _training_op_seconds(paddle, segment_seconds, trials))
    return dataclasses.replace(
        peak, achieved_flops=(("float32", float(matmul)),), achieved_bandwidth=float(np.median(streamed)),
        cache_bytes=float(cache_bytes), cache_bandwidth=float(np.median(in_cache)) if in_cache else 0.0,
        op_seconds=float(op_seconds), segment_seconds=float(segment_seconds), cores=os.cpu_count() or 0,
        kernel_seconds=tuple(sorted((name, float(rate)) for name, rate in kernels.items())),
    )  # fmt: skip


def _training_op_seconds(paddle, segment_seconds: float, trials: int) -> float:
    """The fixed cost per op of a training step: a tiny GPT block's step (forward, backward and
    update of tensors of a few floats: no op's work counts), less one program run, over its op
    count. A training program's ops (grads with several outputs, layer norms, softmaxes) cost
    more than an add (here about 8 us against 2-4 us)."""
    from autopar.testing.models import gpt_block_program
    from autopar.testing.serial import random_feeds

    with paddle.utils.unique_name.guard():
        seed = gpt_block_program(batch=2, seq=4, hidden=8, heads=2, vocab=16, layers=2, optimizer="sgd", seed=1)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(seed.startup)
    feed = random_feeds(seed.feeds, 1, classes=16)[0]
    step = _best_seconds(lambda: exe.run(seed.main, feed=feed, fetch_list=[seed.loss]), trials, reps=5)
    return max(step - segment_seconds, 0.0) / len(seed.main.global_block().ops)


def _cache_bytes() -> int:
    """The level-2 data cache of CPU 0 (Linux sysfs), else 1 MiB."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                return int(text.rstrip("KMB")) << {"K": 10, "M": 20}.get(text.rstrip("B")[-1:], 0)
        except (OSError, ValueError):
            continue
    return 1 << 20


def _program_seconds(paddle, build, trials: int) -> float:
    """Seconds of one ``Executor.run`` of the program ``build`` makes (fetching its one-float
    output), best of ``trials``."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        out = build()
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup)
    return _best_seconds(lambda: exe.run(main, fetch_list=[out]), trials, reps=3)


def _best_seconds(run: Callable[[], Any], trials: int, reps: int) -> float:
    """Seconds per ``run()`` after ``reps`` warm-up runs: the best of ``trials`` timings of ``reps`` runs."""
    for _ in range(reps):
        run()
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            run()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _add_chain(count: int, adds: int):
    def build():
        import paddle

        a, b = (paddle.uniform([count], "float32", 0.0, 1.0) for _ in range(2))
        y = a
        for _ in range(adds):
            y = paddle.add(y, b)
        return y[:1]

    return build


def calibrate(
    worlds: Sequence[int] = (2, 4),
    sizes: Sequence[int] = CALIBRATION_SIZES,
    device: Device | None = None,
    communicator: str = "gloo",
) -> tuple[Cluster, list[Sample]]:
    """Measure here and build the ``cpu-gloo`` or ``cpu-shm`` profile (send/recv is timed on
    2 processes only)."""
    samples = []
    for world in worlds:
        measured = SHM_MEASURED if communicator == "shm" else MEASURED
        kinds = [k for k in measured if world == 2 or not _in_pairs(k)]
        extra = {} if communicator == "shm" else EXTRA_SIZES
        samples += measure(
            world, sizes, kinds, sizes_of={k: sorted({*sizes, *more}) for k, more in extra.items()},
            communicator=communicator,
        )  # fmt: skip
    if communicator == "shm":
        return build_shm_profile(samples, worlds, sizes, device), samples
    return build_profile(samples, worlds, sizes, device), samples


def build_profile(
    samples: Sequence[Sample], worlds: Sequence[int], sizes: Sequence[int], device: Device | None = None
) -> Cluster:
    """The ``cpu-gloo`` cluster from measured samples of the MEASURED kinds (``device``: these
    figures instead of measuring them now)."""
    fits = fit_links([s for s in samples if s.kind in MEASURED])
    return Cluster(
        name="cpu-gloo", nodes=1, devices_per_node=8, intra=fits["all_reduce"], inter=fits["all_reduce"],
        device=device or measure_paddle_device(measure_device()), collectives=tuple(sorted(fits.items())), emulated=EMULATED, tree=False,
        subgroups="world_exchange",
        sources=(
            ("collectives", f"fitted by python -m autopar.cost_model.calibrate: gloo over loopback, {list(worlds)} processes, "
                            f"sizes {list(sizes)} bytes, each timed in {ROUNDS} rounds (lower quartile over reps of the slowest rank), "
                            "ring formulas, least absolute relative error; "
                            "kind@p: fitted on p processes only (used for groups of p: 4 processes on 2 cores contend)"),
            ("knee", f"{KNEE} bytes: glibc's largest dynamic mmap threshold; a buffer this big is fresh memory each call "
                     "(Paddle allocates collective outputs per call) and its 4 KiB pages fault in (3-6 us each here); "
                     "knee_bandwidth fitted per collective, absent where it does not lower the error"),
            ("exchange", "paddle.distributed.all_gather_object of a numpy array from every rank (what the host backend "
                         "does for a sub-group collective); nbytes = the gathered bytes, world x input"),
            ("subgroups", "world_exchange: gloo sub-groups deadlock with 4 processes (PADDLE_NOTES), the host backend "
                          "runs every sub-group collective as a world exchange"),
            ("intra", "the all_reduce fit; inter = intra (one host)"),
            ("emulated", "gloo has no reduce_scatter / all_to_all: all_reduce + slice, all_gather + slice"),
            ("device", DEVICE_SOURCE),
            ("devices_per_node", f"processes, not cores: the machine has {os.cpu_count() or 0} cores"),
        ),
    )  # fmt: skip


def build_shm_profile(
    samples: Sequence[Sample], worlds: Sequence[int], sizes: Sequence[int], device: Device | None = None
) -> Cluster:
    """The ``cpu-shm`` cluster: the host backend's shared-memory communicator, every kind
    native (reduce_scatter and all_to_all too) and any sub-group among its members only. A
    collective there is no ring: each member copies its input into its slot and reads every
    member's (``p`` inputs per rank); per world size (``kind@p``) that is still latency plus
    bytes over a bandwidth, which the ring formula's fit absorbs for that ``p``."""
    fits = fit_links([s for s in samples if s.kind in SHM_MEASURED])
    return Cluster(
        name="cpu-shm", nodes=1, devices_per_node=8, intra=fits["all_reduce"], inter=fits["all_reduce"],
        device=device or measure_paddle_device(measure_device()), collectives=tuple(sorted(fits.items())), emulated=(), tree=False,
        subgroups="native",
        sources=(
            ("collectives", f"fitted by python -m autopar.cost_model.calibrate --communicator shm: the host backend's "
                            f"shared-memory communicator (autopar.runtime.shm, SharedMemoryCommunicator.run), {list(worlds)} "
                            f"processes, sizes {list(sizes)} bytes, each timed in {ROUNDS} rounds (lower quartile over reps "
                            "of the slowest rank), ring formulas as the fitted form, least absolute relative error; "
                            "kind@p: fitted on p processes only (the copy-in / read-all algorithm's cost per byte grows "
                            "with p; 4 processes on 2 cores contend)"),
            ("knee", f"{KNEE} bytes: fresh memory for outputs this big (see cpu-gloo); fitted where it lowers the error"),
            ("subgroups", "native: a sub-group's members talk among themselves (shared-memory slots)"),
            ("intra", "the all_reduce fit; inter = intra (one host)"),
            ("device", DEVICE_SOURCE),
            ("devices_per_node", f"processes, not cores: the machine has {os.cpu_count() or 0} cores"),
        ),
    )  # fmt: skip


# ---- worker side -----------------------------------------------------------------------


def _worker(plan: Mapping[str, Sequence[int]], out: str) -> None:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _timed_rounds(plan, lambda kind, nbytes: _operation(paddle, dist, kind, nbytes, rank, world), dist.barrier)
    gathered: list = []
    dist.all_gather(gathered, paddle.to_tensor(np.array([t for ts in local.values() for t in ts], np.float64)))
    per_rep = np.max(np.stack([g.numpy() for g in gathered]), axis=0)  # a rep ends when its slowest rank does
    _write_results(local, per_rep, world, out if rank == 0 else None)
    dist.barrier()


def _timed_rounds(
    plan: Mapping[str, Sequence[int]], operation: Callable[[str, int], Callable[[], Any]], barrier: Callable[[], Any]
) -> dict[tuple[str, int], list[float]]:
    """This rank's seconds per rep of each (kind, size) of ``plan``: ``operation(kind, nbytes)``
    makes the collective, each rep starts from ``barrier()``."""
    for kind in plan:  # connections and buffers are set up lazily: not part of any timing
        warm = operation(kind, 64 << 10)
        for _ in range(5):
            warm()
    local: dict[tuple[str, int], list[float]] = {(kind, n): [] for kind, sizes in plan.items() for n in sizes}
    for _ in range(ROUNDS):  # each round: every (kind, size) once more, so noise spreads over all
        for kind, sizes in plan.items():
            for nbytes in sizes:
                run = operation(kind, nbytes)
                run()  # the steady state of a training loop: the same collective ran before
                reps = 1 if nbytes >= 8 << 20 else (3 if nbytes >= 1 << 20 else 6)
                for _ in range(reps):
                    barrier()
                    start = time.perf_counter()
                    run()
                    local[kind, nbytes].append(time.perf_counter() - start)
                del run
    return local


def _shm_worker(plan: Mapping[str, Sequence[int]], out: str) -> None:
    """The shm variant of :func:`_worker`: each collective through
    :meth:`~autopar.runtime.shm.SharedMemoryCommunicator.run` (what a rank program's collective
    runs), timed from a barrier."""
    from autopar.runtime.shm import SharedMemoryCommunicator

    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    comm = SharedMemoryCommunicator(rank, world)
    everyone = tuple(range(world))
    token = np.zeros(1, np.float32)
    tick = _shm_job("all_reduce", everyone, (1,))

    def barrier() -> None:
        comm.run(tick, token)

    def operation(kind: str, nbytes: int):
        count = max(nbytes // 4, world)
        count -= count % world
        if point_to_point(kind):  # pairs 0 -> 1, 2 -> 3, ... at once
            x = np.ones(count, np.float32)
            pair = (rank - rank % 2, rank - rank % 2 + 1)
            if pair[1] >= world:
                return lambda: None
            job = _shm_job("send" if rank == pair[0] else "recv", pair, (count,))
            return lambda: comm.run(job, x)
        shape = (count // world,) if kind_of(kind).gathers else (count,)  # all_gather: nbytes = output
        job = _shm_job(kind, everyone, shape)
        x = np.ones(shape, np.float32)
        return lambda: comm.run(job, x)

    local = _timed_rounds(plan, operation, barrier)
    gathered = comm.all_gather_object(np.array([t for ts in local.values() for t in ts], np.float64))
    _write_results(local, np.max(np.stack(gathered), axis=0), world, out if rank == 0 else None)
    barrier()


def _in_pairs(kind: str) -> bool:
    """Whether ``kind`` is timed in pairs (a point-to-point move: on 2 processes only)."""
    return kind in priced_kinds() and point_to_point(kind)


def _shm_job(kind: str, group: tuple[int, ...], shape: tuple[int, ...]):
    from autopar.collective import Collective, CollectiveKey
    from autopar.dist_attr import DistAttr
    from autopar.mesh import ProcessMesh

    attr = DistAttr.replicated(ProcessMesh(list(group)), len(shape))
    return Collective(
        kind=kind, group=group, key=CollectiveKey("calibrate", 0), value="x", src=attr, dst=attr, shape=shape,
        output_shape=shape, bytes=0, time=0.0, reason="calibration",
    )  # fmt: skip


def _write_results(local: Mapping[tuple[str, int], list[float]], per_rep: np.ndarray, world: int, out: str | None) -> None:
    """Each (kind, size)'s reps (a rep ends when its slowest rank does: ``per_rep``) to ``out``."""
    results, at = [], 0
    for (kind, nbytes), times in local.items():
        reps = per_rep[at : at + len(times)]
        results.append({"kind": kind, "world": world, "nbytes": int(nbytes), "seconds": summary(reps),
                        "reps": reps.tolist()})  # fmt: skip
        at += len(times)
    if out is not None:
        Path(out).write_text(json.dumps(results))


def _operation(paddle, dist, kind: str, nbytes: int, rank: int, world: int):
    """A closure running one ``kind`` collective whose comm.py size is ``nbytes``."""
    count = max(nbytes // 4, world)
    count -= count % world
    if kind in priced_kinds():  # (each kind's entry says how: autopar/collective_kinds.py, ``calibration``)
        return kind_of(kind).calibration(paddle, dist, count, rank, world)
    if kind == "exchange":  # the host backend's sub-group transport; nbytes = gathered (world x input)
        mine = np.ones(count // world, np.float32)
        return lambda: dist.all_gather_object([], mine)
    if kind in SUBGROUP:  # the host backend's collective over ranks (0, 1) of a bigger world
        return _subgroup(dist, SUBGROUP[kind], count, rank)
    raise ValueError(kind)


def _subgroup(dist, kind: str, count: int, rank: int):
    """What the host backend does for ``kind`` over ranks (0, 1) (autopar.runtime.gloo): every
    rank's input to every rank (all_gather_object), then the group's result in numpy."""
    gathers = kind_of(kind).gathers
    mine = np.ones(count // 2 if gathers else count, np.float32)  # all_gather: nbytes = output

    def run():
        everyone: list = []
        dist.all_gather_object(everyone, mine)
        if rank > 1:
            return None
        if gathers:
            return np.concatenate(everyone[:2])
        return np.sum(np.stack(everyone[:2]), axis=0)

    return run


def vars_of(sample: Sample) -> dict:
    return asdict(sample)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="profile to write (default: the shipped cpu_gloo.json / cpu_shm.json)")
    parser.add_argument("--plan", help=argparse.SUPPRESS)  # worker: JSON {kind: [sizes]}
    parser.add_argument(
        "--communicator", choices=COMMUNICATORS, default="gloo",
        help="gloo: the cpu-gloo profile; shm: the host backend's shared-memory communicator (cpu-shm)",
    )  # fmt: skip
    parser.add_argument("--sizes", type=int, nargs="+", default=list(CALIBRATION_SIZES))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--samples", help="also write the measured samples (JSON) here")
    parser.add_argument("--samples-from", help="fit the samples an earlier --samples wrote instead of measuring")
    parser.add_argument(
        "--device-from", metavar="PROFILE", help="keep this profile's device figures (a busy machine measures them low)"
    )
    parser.add_argument("--device-only", action="store_true", help="measure the device figures only, into the profile --out names")
    args = parser.parse_args(argv)
    if args.worker:
        (_shm_worker if args.communicator == "shm" else _worker)(json.loads(args.plan), args.out)
        return
    out = args.out or str(SHM_PROFILE_PATH if args.communicator == "shm" else PROFILE_PATH)
    start = time.perf_counter()
    if args.device_only:
        cluster = load_cluster(out)
        device = measure_paddle_device(measure_device())
        sources = tuple((k, DEVICE_SOURCE if k == "device" else v) for k, v in cluster.sources)
        dataclasses.replace(cluster, device=device, sources=sources).save(out)
        print(f"{out}: device {device}")
        return
    kept = load_cluster(args.device_from) if args.device_from else None
    device = kept.device if kept else None
    if args.samples_from:
        samples = [
            Sample(**{**item, "reps": tuple(item["reps"])}) for item in json.loads(Path(args.samples_from).read_text())
        ]
        build = build_shm_profile if args.communicator == "shm" else build_profile
        cluster = build(samples, args.worlds, args.sizes, device)
    else:
        cluster, samples = calibrate(args.worlds, args.sizes, device, args.communicator)
    if kept:
        note = f"kept from an earlier calibration ({dict(kept.sources).get('device', 'no source given')})"
        cluster = dataclasses.replace(
            cluster, sources=tuple((k, note if k == "device" else v) for k, v in cluster.sources)
        )
    cluster.save(out)
    if args.samples:
        Path(args.samples).write_text(json.dumps([vars_of(s) for s in samples], indent=1))
    for kind, link in cluster.collectives:
        knee = (
            f", from {link.knee / 2**20:.1f} MiB + {link.knee_bandwidth / 1e9:.3f} GB/s" if link.knee < math.inf else ""
        )
        print(f"{kind:>12}: latency {link.latency * 1e6:8.1f} us, bandwidth {link.bandwidth / 1e9:7.3f} GB/s{knee}")
    print(
        f"device: {cluster.device.flops_for('float32') / 1e9:.1f} GFLOP/s, copy {cluster.device.memory_bandwidth / 1e9:.1f} GB/s"
    )
    print(f"wrote {out} ({len(samples)} samples, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
