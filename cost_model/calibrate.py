"""Calibrate the ``cpu-gloo`` profile on this machine: ``python -m autopar.cost_model.calibrate``.

Spawns 2 and 4 local processes (the ``PADDLE_*`` variables set, dynamic-mode
``paddle.distributed`` on gloo), times all_reduce, all_gather, broadcast, send/recv and the
host backend's *exchange* (``all_gather_object`` of a numpy array: how it runs a sub-group
collective) over a set of sizes, each size in several rounds spread over the run, and fits,
per collective, the latency and bandwidth of the alpha-beta formula in
:mod:`autopar.cost_model.comm`, plus the bandwidth of its knee (buffers of at least 32 MiB are
fresh memory: see :class:`~autopar.cost_model.cluster.Link`), minimizing the mean absolute
relative error (over both world sizes at once, so the fit keeps the formula's dependence on
the group size), and per world size (``all_reduce@4``: with 4 processes on 2 cores the
processes contend for the cores, which no link formula predicts; a group of that size uses its
own fit). gloo has no reduce_scatter and no all_to_all (``ProcessGroupGloo does not support
...``): the profile marks them *emulated*, priced as the all_reduce / all_gather plus slice
that runs instead; the workers time those emulations too (the benchmark compares them).

Also measured: float32 matmul FLOP/s and copy bandwidth of one process (numpy), and the
machine's memory. The profile is written to ``cost_model/profiles/cpu_gloo.json`` (an input
profile, committed), or ``--out``. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.cost_model.cluster import Cluster, Device, Link
from autopar.cost_model.comm import coefficients

MEASURED = ("all_reduce", "all_gather", "broadcast", "send_recv", "exchange")
EMULATED = ("reduce_scatter", "all_to_all")
CALIBRATION_SIZES = (6 << 10, 24 << 10, 96 << 10, 384 << 10, 1536 << 10, 6 << 20, 24 << 20, 40 << 20, 96 << 20)
KNEE = 32 << 20  # glibc's largest dynamic mmap threshold: every allocation this big is fresh memory
ROUNDS = 3  # each size is timed in 3 rounds spread over the run (a burst of load hits one round)
PROFILE_PATH = Path(__file__).parent / "profiles" / "cpu_gloo.json"


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured collective: ``seconds`` for ``nbytes`` (comm.py's convention) over ``world`` ranks."""

    kind: str
    world: int
    nbytes: int
    seconds: float


# ---- parent side -----------------------------------------------------------------------


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def measure(world: int, sizes: Sequence[int], kinds: Sequence[str] = MEASURED, timeout: float = 600.0) -> list[Sample]:
    """Run ``world`` gloo processes here and time each collective at each size."""
    ports = _free_ports(world + 1)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports[:world])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.json"
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                PADDLE_DISTRI_BACKEND="gloo", PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(world),
                PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank]}",
                PADDLE_MASTER=f"127.0.0.1:{ports[world]}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[world]),
                OMP_NUM_THREADS="1", GLOG_v="0", GLOG_minloglevel="2",
            )  # fmt: skip
            cmd = [sys.executable, "-m", "autopar.cost_model.calibrate", "--worker", "--out", str(out),
                   "--sizes", *map(str, sizes), "--kinds", *kinds]  # fmt: skip
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
            raise RuntimeError("calibration workers failed:\n" + "\n".join(errors))
        return [Sample(**item) for item in json.loads(out.read_text())]


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
    """Latency, bandwidth and (when samples reach ``knee`` bytes and it helps) the knee's
    bandwidth of ``kind``'s ring formula, minimizing the mean absolute *relative* error (the
    benchmark's measure; robust to the odd sample a burst of load slowed down): iteratively
    reweighted least squares, every figure kept >= 0."""
    rows = [s for s in samples if s.kind == kind and s.world > 1]
    design = np.array([(*coefficients(_formula(kind), s.world, s.nbytes), s.nbytes * (s.nbytes >= knee)) for s in rows])
    times = np.array([s.seconds for s in rows])
    scaled = design / times[:, None]  # row i: predicted / measured time per unit of each figure
    weights = np.ones(len(rows))
    for _ in range(100):
        figures = _nonnegative_lstsq(scaled * weights[:, None], weights)
        residual = np.abs(scaled @ figures - 1.0)
        new = 1.0 / np.sqrt(np.maximum(residual, 1e-4))  # sum w^2 r^2 = sum |r|
        if np.allclose(new, weights, rtol=1e-6):
            break
        weights = new
    alpha, beta, gamma = figures
    beta = max(beta, 1e-15)
    if gamma <= 0:
        return Link(latency=float(alpha), bandwidth=float(1.0 / beta))
    return Link(latency=float(alpha), bandwidth=float(1.0 / beta), knee=float(knee), knee_bandwidth=float(1.0 / gamma))


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


def measure_device() -> Device:
    """float32 matmul FLOP/s and copy bandwidth of one process; the machine's memory."""
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    a @ a
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        a @ a
    flops = reps * 2 * 512**3 / (time.perf_counter() - start)
    src, dst = np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)
    np.copyto(dst, src)
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    bandwidth = reps * 2 * src.nbytes / (time.perf_counter() - start)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device((("float32", float(flops)),), float(bandwidth), float(memory))


def calibrate(worlds: Sequence[int] = (2, 4), sizes: Sequence[int] = CALIBRATION_SIZES) -> tuple[Cluster, list[Sample]]:
    """Measure here and build the ``cpu-gloo`` profile (send/recv is timed on 2 processes only)."""
    samples = []
    for world in worlds:
        kinds = [k for k in MEASURED if k != "send_recv" or world == 2]
        samples += measure(world, sizes, kinds)
    return build_profile(samples, worlds, sizes), samples


def build_profile(samples: Sequence[Sample], worlds: Sequence[int], sizes: Sequence[int]) -> Cluster:
    """The ``cpu-gloo`` cluster from measured samples of the MEASURED kinds."""
    fits = fit_links([s for s in samples if s.kind in MEASURED])
    return Cluster(
        name="cpu-gloo", nodes=1, devices_per_node=8, intra=fits["all_reduce"], inter=fits["all_reduce"],
        device=measure_device(), collectives=tuple(sorted(fits.items())), emulated=EMULATED, tree=False,
        subgroups="world_exchange",
        sources=(
            ("collectives", f"fitted by python -m autopar.cost_model.calibrate: gloo over loopback, {list(worlds)} processes, "
                            f"sizes {list(sizes)} bytes, each timed in {ROUNDS} rounds (median of the slowest rank per rep), "
                            "ring formulas, least absolute relative error; "
                            "kind@p: fitted on p processes only (used for groups of p: 4 processes on 2 cores contend)"),
            ("knee", f"{KNEE} bytes: glibc's largest dynamic mmap threshold; a buffer this big is fresh memory each call "
                     "(Paddle allocates collective outputs per call) and its 4 KiB pages fault in (3-6 us each here); "
                     "knee_bandwidth fitted per collective, absent where it does not help the fit"),
            ("exchange", "paddle.distributed.all_gather_object of a numpy array from every rank (what the host backend "
                         "does for a sub-group collective); nbytes = the gathered bytes, world x input"),
            ("subgroups", "world_exchange: gloo sub-groups deadlock with 4 processes (PADDLE_NOTES), the host backend "
                          "runs every sub-group collective as a world exchange"),
            ("intra", "the all_reduce fit; inter = intra (one host)"),
            ("emulated", "gloo has no reduce_scatter / all_to_all: all_reduce + slice, all_gather + slice"),
            ("device", "numpy float32 512x512 matmul and a 32 MiB copy in one process; memory = physical RAM"),
            ("devices_per_node", f"processes, not cores: the machine has {os.cpu_count() or 0} cores"),
        ),
    )  # fmt: skip


# ---- worker side -----------------------------------------------------------------------


def _worker(sizes: Sequence[int], kinds: Sequence[str], out: str) -> None:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in kinds:  # connections and buffers are set up lazily: not part of any timing
        warm = _operation(paddle, dist, kind, 64 << 10, rank, world)
        for _ in range(5):
            warm()
    local: dict[tuple[str, int], list[float]] = {(kind, n): [] for kind in kinds for n in sizes}
    for _ in range(ROUNDS):  # each round: every (kind, size) once more, so noise spreads over all
        for kind in kinds:
            for nbytes in sizes:
                run = _operation(paddle, dist, kind, nbytes, rank, world)
                run()  # the steady state of a training loop: the same collective ran before
                reps = 2 if nbytes >= 8 << 20 else (4 if nbytes >= 1 << 20 else 10)
                for _ in range(reps):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    local[kind, nbytes].append(time.perf_counter() - start)
                del run
    gathered: list = []
    dist.all_gather(gathered, paddle.to_tensor(np.array([t for ts in local.values() for t in ts], np.float64)))
    per_rep = np.max(np.stack([g.numpy() for g in gathered]), axis=0)  # a rep ends when its slowest rank does
    results, at = [], 0
    for (kind, nbytes), times in local.items():
        seconds = float(np.median(per_rep[at : at + len(times)]))
        results.append({"kind": kind, "world": world, "nbytes": int(nbytes), "seconds": seconds})
        at += len(times)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()


def _operation(paddle, dist, kind: str, nbytes: int, rank: int, world: int):
    """A closure running one ``kind`` collective whose comm.py size is ``nbytes``."""
    count = max(nbytes // 4, world)
    count -= count % world
    if kind in ("all_reduce", "broadcast", "send_recv", "reduce_scatter"):
        x = paddle.ones([count], dtype="float32")
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if kind == "reduce_scatter":  # emulated: all_reduce of the input, keep the own chunk
        chunk = count // world
        return lambda: dist.all_reduce(x) or x[rank * chunk : (rank + 1) * chunk].clone()
    if kind == "send_recv":  # pairs 0 -> 1, 2 -> 3, ... at once (every rank takes part: gloo's tags stay in step)
        if rank % 2 == 0:
            return (lambda: dist.send(x, dst=rank + 1)) if rank + 1 < world else (lambda: None)
        return lambda: dist.recv(x, src=rank - 1)
    if kind == "all_gather":  # nbytes = gathered output
        piece = paddle.ones([count // world], dtype="float32")
        return lambda: dist.all_gather([], piece)
    if kind == "exchange":  # the host backend's sub-group transport; nbytes = gathered (world x input)
        mine = np.ones(count // world, np.float32)
        return lambda: dist.all_gather_object([], mine)
    if kind == "all_to_all":  # emulated: all_gather every send buffer, keep the own column
        send = paddle.ones([count], dtype="float32")
        chunk = count // world

        def run():
            parts: list = []
            dist.all_gather(parts, send)
            return paddle.concat([p[rank * chunk : (rank + 1) * chunk] for p in parts])

        return run
    raise ValueError(kind)


def vars_of(sample: Sample) -> dict:
    return {"kind": sample.kind, "world": sample.world, "nbytes": sample.nbytes, "seconds": sample.seconds}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=str(PROFILE_PATH), help="profile to write (default: the shipped cpu_gloo.json)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(CALIBRATION_SIZES))
    parser.add_argument("--kinds", nargs="+", default=list(MEASURED))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--samples", help="also write the measured samples (JSON) here")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.sizes, args.kinds, args.out)
        return
    start = time.perf_counter()
    cluster, samples = calibrate(args.worlds, args.sizes)
    cluster.save(args.out)
    if args.samples:
        Path(args.samples).write_text(json.dumps([vars_of(s) for s in samples], indent=1))
    for kind, link in cluster.collectives:
        print(f"{kind:>12}: latency {link.latency * 1e6:8.1f} us, bandwidth {link.bandwidth / 1e9:7.3f} GB/s")
    print(
        f"device: {cluster.device.flops_for('float32') / 1e9:.1f} GFLOP/s, copy {cluster.device.memory_bandwidth / 1e9:.1f} GB/s"
    )
    print(f"wrote {args.out} ({len(samples)} samples, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
