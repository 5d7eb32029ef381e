"""Checkpoint save and load throughput per rank, against numpy writing and reading the same bytes.

    .venv/bin/python benchmarks/bench_checkpoint.py

SimpleNet (Linear 1024->4096->4096->1024->10, Adam: parameters + two moments, ~300 MB of
state in all) on dp=2 x mp=2 with ZeRO-1 (linear1 column-, linear2 row-parallel; the moments
split over dp inside the mp split). Every rank's runner is started in this process as the
simulator does; then each rank's part of a job's save and load is timed on its own (what one
process of a job does, in parallel with the others):

- save: the rank's boxes read from its scope and written as ``.npy`` files with their SHA-256
  (hashed on a second thread while written), then fsynced (``SaveTransaction.write``); the
  scope read alone is shown too. numpy: ``np.save`` of the same arrays, already in hand,
  without and with the same fsyncs. The lowest rank's commit (rename, index.json, fsyncs) is
  timed apart;
- load, same mesh: the rank reads its own files back (size, SHA-256 and header checked),
  assembles its pieces and writes them into its scope; numpy: ``np.load`` of the same files;
- load, resharded onto mp=4: each of 4 ranks builds its pieces from the dp x mp files (it opens
  every file its pieces overlap): MB/s of piece bytes, and of file bytes read.

MB = 10^6 bytes; best of REPEATS runs. The files were just written, so reads come from the page
cache, numpy's too (a cold-cache figure needs root to drop the caches).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import autopar  # noqa: E402
from autopar import checkpoint  # noqa: E402
from autopar.runtime.replicas import generator_state, use_generator_state  # noqa: E402
from autopar.runtime.simulator import runner_for  # noqa: E402
from autopar.testing.models import simple_net  # noqa: E402

SIZES, BATCH, REPEATS = (1024, 4096, 4096, 1024, 10), 8, 3


def build(mesh_shape: tuple[int, ...], names: list[str], zero: int) -> tuple[dict, dict]:
    """Every rank's plan and started runner (the simulator's start-up)."""
    with paddle.utils.unique_name.guard():
        seed = simple_net(batch=BATCH, sizes=SIZES, optimizer="adam")
    mesh = autopar.ProcessMesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape).tolist(), names)
    if "dp" in names:
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
    autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=zero))
    plans = {rank: dist.rank_plan(rank) for rank in mesh.ranks}
    runners = {rank: runner_for(plan, []) for rank, plan in plans.items()}
    start = generator_state()
    for runner in runners.values():
        use_generator_state(start)
        runner.run_startup()
    return plans, runners


def best(run: Callable[[Path], Any], scratch: Path, prepare: Callable[[Path], Any] | None = None) -> float:
    """Best time of ``run(directory)`` over REPEATS fresh directories (set-up and clean-up untimed)."""
    times = []
    for i in range(REPEATS):
        directory = scratch / f"run{i}"
        if prepare is not None:
            prepare(directory)
        began = time.perf_counter()
        run(directory)
        times.append(time.perf_counter() - began)
        shutil.rmtree(directory, ignore_errors=True)
    return min(times)


def numpy_save(directory: Path, arrays: list[np.ndarray], fsync: bool) -> None:
    directory.mkdir()
    for i, array in enumerate(arrays):
        np.save(directory / f"{i}.npy", array)
    if fsync:  # as the checkpoint does: every file once all are written
        checkpoint.sync_files([directory / f"{i}.npy" for i in range(len(arrays))])


def mbps(size: int, seconds: float) -> float:
    return size / 1e6 / seconds


def save_table(scratch: Path, plans: dict, runners: dict) -> None:
    print("\nSAVE per rank (dp=2 x mp=2, ZeRO-1)    MB   ours MB/s   (of it: scope read MB/s)   np.save MB/s   "
          "np.save+fsync MB/s   ours / np.save+fsync")  # fmt: skip
    writes = checkpoint.plan_writes(plans[0].values)
    for rank in sorted(plans):
        names = [w.name for w in writes if w.rank == rank]
        arrays = [runners[rank].parameter_piece(n) for n in names]
        size = sum(a.nbytes for a in arrays)

        def ours(directory: Path, rank: int = rank) -> None:
            checkpoint.SaveTransaction(directory, "x").write(writes, rank, runners[rank].parameter_piece)

        took = best(ours, scratch)
        scope = best(lambda _, rank=rank, names=names: [runners[rank].parameter_piece(n) for n in names], scratch)
        plain = best(lambda d, arrays=arrays: numpy_save(d, arrays, fsync=False), scratch)
        synced = best(lambda d, arrays=arrays: numpy_save(d, arrays, fsync=True), scratch)
        print(f"  rank {rank}                        {size / 1e6:8.1f} {mbps(size, took):11.0f} {mbps(size, scope):26.0f} "
              f"{mbps(size, plain):14.0f} {mbps(size, synced):20.0f} {synced / took:22.2f}")  # fmt: skip


def commit_time(scratch: Path, ckpt: Path, plans: dict) -> float:
    """The lowest rank's commit alone, over a copy of the checkpoint whose files sit in a staging
    directory already (hard links: no copy timed)."""
    index = checkpoint.read_index(ckpt)
    plan = plans[min(plans)]
    state: dict[str, Any] = {}

    def prepare(directory: Path) -> None:
        shutil.copytree(ckpt, directory, copy_function=os.link)
        transaction = state["t"] = checkpoint.SaveTransaction(directory, checkpoint.new_token())
        os.rename(directory / index.data, transaction.staging)
        swap = lambda r: {**r, "file": r["file"].replace(index.data, transaction.data)}  # noqa: E731
        state["records"] = [(name, swap(b.to_json())) for name, t in index.tensors.items() for b in t.boxes]

    return best(lambda d: state["t"].commit(plan.values, plan.mesh, state["records"], {}), scratch, prepare)


def load_rows(ckpt: Path, plans: dict, runners: dict, scratch: Path, baseline: bool) -> None:
    index = checkpoint.read_index(ckpt)
    for rank in sorted(plans):
        wanted = checkpoint.load_targets(plans[rank])
        size = sum(box.size * np.dtype(info.dtype).itemsize for _, info, box in wanted)
        files = {b.file: b.bytes for name, _, box in wanted for b in index.tensors[name].boxes if b.box.intersect(box)}

        def ours(_: Path, rank: int = rank, wanted: list = wanted) -> None:
            pieces = checkpoint.read_pieces(checkpoint.read_index(ckpt), wanted)
            for name, _, box in wanted:
                checkpoint.install(runners[rank], name, pieces[name, box])

        took = best(ours, scratch)
        if baseline:
            plain = best(lambda _, files=files: [np.load(ckpt / f) for f in files], scratch)
            print(f"  rank {rank}                          {size / 1e6:8.1f} {mbps(size, took):11.0f} {mbps(size, plain):14.0f} "
                  f"{took / plain:22.2f}")  # fmt: skip
        else:
            read = sum(files.values())
            print(f"  rank {rank}                          {size / 1e6:8.1f} {read / 1e6:11.1f} {mbps(size, took):14.0f} "
                  f"{mbps(read, took):20.0f}")  # fmt: skip


def main() -> None:
    plans, runners = build((2, 2), ["dp", "mp"], zero=1)
    scratch = Path(tempfile.mkdtemp(prefix="bench_checkpoint."))
    try:
        ckpt = scratch / "ckpt"
        began = time.perf_counter()
        checkpoint.save_ranks(ckpt, plans, runners)
        whole = time.perf_counter() - began
        index = checkpoint.read_index(ckpt)
        total = sum(b.bytes for t in index.tensors.values() for b in t.boxes)
        files = sum(len(t.boxes) for t in index.tensors.values())
        print(f"SimpleNet {SIZES} + Adam on dp=2 x mp=2, ZeRO-1: {len(index.tensors)} tensors in {files} files, "
              f"{total / 1e6:.1f} MB; the 4 ranks' save one after the other in this process: {whole:.2f} s")  # fmt: skip
        save_table(scratch, plans, runners)
        print(
            f"  commit (lowest rank: rename, index.json, fsyncs, old data removed): {commit_time(scratch, ckpt, plans) * 1e3:.1f} ms"
        )
        print("\nLOAD per rank, same mesh               MB   ours MB/s   np.load MB/s   ours time / np.load time")
        load_rows(ckpt, plans, runners, scratch, baseline=True)
        del runners
        target_plans, target_runners = build((4,), ["mp"], zero=0)
        print("\nLOAD per rank, resharded onto mp=4   piece MB   files MB   MB/s (pieces)   MB/s (file bytes read)")
        load_rows(ckpt, target_plans, target_runners, scratch, baseline=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
