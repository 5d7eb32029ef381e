"""Calibrate the CPU profiles on this machine: ``.venv/bin/python tools/calibrate.py
[--communicator gloo|shm]`` (``cpu-gloo`` / ``cpu-shm``). A tool, not part of the installed
package: it runs the runtime's communicators and Paddle's kernels and writes the profile JSON
that the cost model reads; the fitting is the cost model's (:mod:`autopar.cost_model.profile_fit`).

Spawns 2 and 4 local processes (the ``PADDLE_*`` variables set, dynamic-mode
``paddle.distributed`` on gloo), times all_reduce, all_gather, broadcast, send/recv and the
host backend's *exchange* (``all_gather_object`` of a numpy array: how it runs a sub-group
collective) over a set of sizes (all_gather up to 192 MiB: an emulated all_to_all gathers p
times its send buffer), each size in several rounds spread over the run (reduced to the lower
quartile of the reps: ``profile_fit.summary``), and fits, per collective, the latency and bandwidth of
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
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autopar.collective_kinds import kind_of, point_to_point, priced_kinds
from autopar.cost_model.cluster import Cluster, Device, load_cluster
from autopar.cost_model.profile_fit import (
    CALIBRATION_SIZES,
    DEVICE_SOURCE,
    MEASURED,
    PROFILE_PATH,
    ROUNDS,
    SHM_MEASURED,
    SHM_PROFILE_PATH,
    Sample,
    build_profile,
    build_shm_profile,
    summary,
    vars_of,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/kernel_rates.py beside this file
from kernel_rates import measure_kernel_rates  # noqa: E402

EXTRA_SIZES = {
    k: kind_of(k).calibration_sizes for k in priced_kinds() if kind_of(k).calibration_sizes
}  # all_gather: 192 MiB
SUBGROUP = {"sub_all_reduce": "all_reduce", "sub_all_gather": "all_gather"}  # over ranks (0, 1), host backend
COMMUNICATORS = ("gloo", "shm")


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
        argv = [str(Path(__file__).resolve()), "--worker", "--communicator", communicator, "--out", str(out),
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


def measure_paddle_device(peak: Device, trials: int = 5) -> Device:
    """``peak`` with what Paddle's CPU kernels achieve in one process (the compute side prices
    with these). From chains of float32 adds over operands of 8 KiB .. 64 MiB: the fixed cost
    of one op (``op_seconds``: an add of the smallest size, its work negligible), the bandwidth
    adds stream out of cache (the median over operands of 16 .. 64 MiB) and in the cache
    (``cache_bytes``: the level-2 cache's size; the median over adds whose traffic is an eighth
    of it or more and fits). From the profiled training steps of four reference models
    (``tools/kernel_rates.py``): the rate their matmuls achieve and each kernel's
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
    in_cache = [
        12 * n / (t - op_seconds)
        for n, t in adds.items()
        if cache_bytes / 8 <= 12 * n <= cache_bytes and t > op_seconds
    ]
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
    device = device or measure_paddle_device(measure_device())
    if communicator == "shm":
        return build_shm_profile(samples, worlds, sizes, device), samples
    return build_profile(samples, worlds, sizes, device), samples


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


def _write_results(
    local: Mapping[tuple[str, int], list[float]], per_rep: np.ndarray, world: int, out: str | None
) -> None:
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
    parser.add_argument(
        "--device-only", action="store_true", help="measure the device figures only, into the profile --out names"
    )
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
        cluster = build(samples, args.worlds, args.sizes, device or measure_paddle_device(measure_device()))
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
