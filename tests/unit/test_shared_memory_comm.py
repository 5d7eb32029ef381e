"""The host backend's shared-memory collectives (:mod:`autopar.runtime.shm`) between real
processes (forked, no Paddle started in them): every collective kind on interleaved sub-groups
of a 2 x 2 mesh equals the reference semantics, messages that outgrow a slot move the slot,
objects are exchanged, and a rank that never arrives is named."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback

import numpy as np
import pytest

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import KINDS, perform
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh
from autopar.runtime import shm

FORK = multiprocessing.get_context("fork")


class _Store:
    """The job's TCP store as the communicator uses it: set, and a get that waits."""

    def __init__(self, shared) -> None:
        self.shared = shared

    def set(self, key, value) -> None:
        self.shared[key] = bytes(value)

    def get(self, key):
        while key not in self.shared:
            time.sleep(0.001)
        return self.shared[key]


def _job(kind, group, shape, dtype="float32", reduce="sum", axis=0):
    mesh = ProcessMesh(list(group))
    attr = DistAttr.replicated(mesh, len(shape))
    return Collective(
        kind=kind, group=tuple(group), key=CollectiveKey("test", 0), value="x", src=attr, dst=attr, shape=shape,
        output_shape=shape, bytes=0, time=0.0, reason="test", reduce=reduce, axis=axis, dtype=dtype,
    )  # fmt: skip


def _inputs(step, rank, shape, dtype):
    rng = np.random.default_rng(1000 * step + rank)
    return (rng.standard_normal(shape) * 10).astype(dtype)


# (kind, groups of the 2 x 2 mesh [[0, 1], [2, 3]] by which rank runs it, shape, reduce, axis)
STEPS = [
    (CollectiveKind.ALL_REDUCE, "rows", (3, 4), "sum", 0),  # mp groups [0, 1] [2, 3]
    (CollectiveKind.ALL_GATHER, "cols", (2, 3), "sum", 1),  # dp groups [0, 2] [1, 3]
    (CollectiveKind.ALL_REDUCE, "world", (5,), "max", 0),
    (CollectiveKind.REDUCE_SCATTER, "cols", (4, 2), "sum", 0),
    (CollectiveKind.ALL_TO_ALL, "rows", (4, 6), "sum", 1),
    (CollectiveKind.BROADCAST, "world", (2, 2), "sum", 0),
    (CollectiveKind.ALL_REDUCE, "rows", (300_000,), "sum", 0),  # 1.2 MB: outgrows the first slot
    (CollectiveKind.ALL_REDUCE, "cols", (7,), "min", 0),
    (CollectiveKind.ALL_REDUCE, "world", (300_001,), "avg", 0),
    (CollectiveKind.ALL_REDUCE, "rows", (), "sum", 0),  # a loss: 0-d stays 0-d
]
GROUPS = {"rows": lambda r: (0, 1) if r < 2 else (2, 3), "cols": lambda r: (r % 2, r % 2 + 2), "world": lambda r: (0, 1, 2, 3)}


def _rank_main(rank, world, shared, results, steps, timeout):
    try:
        node = shm.NodeMemory(rank, world, _Store(shared), timeout)
        outs = []
        for step, (kind, groups, shape, reduce, axis) in enumerate(steps):
            group = GROUPS[groups](rank)
            job = _job(kind, group, shape, reduce=reduce, axis=axis)
            outs.append(node.collect(group, _inputs(step, rank, shape, "float32"), lambda a, job=job: shm._owned(perform(job, a)[rank], a)))
        gathered = node.collect(range(world), np.frombuffer(f"rank {rank}".encode(), np.uint8), lambda a: [bytes(a[r]).decode() for r in range(world)])
        results[rank] = ("ok", outs, gathered)
        node.close()
    except BaseException as error:  # reported to the test
        results[rank] = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())


def _run(world, steps, ranks=None, timeout=20.0):
    manager = FORK.Manager()
    shared, results = manager.dict(), manager.dict()
    procs = [FORK.Process(target=_rank_main, args=(r, world, shared, results, steps, timeout)) for r in (ranks or range(world))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    return dict(results)


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("autopar-")}


def test_every_kind_on_interleaved_sub_groups_equals_the_reference():
    before = _segments()
    results = _run(4, STEPS)
    assert sorted(results) == [0, 1, 2, 3], results
    errors = {r: res for r, res in results.items() if res[0] != "ok"}
    assert not errors, errors
    for step, (kind, groups, shape, reduce, axis) in enumerate(STEPS):
        for rank in range(4):
            group = GROUPS[groups](rank)
            job = _job(kind, group, shape, reduce=reduce, axis=axis)
            want = perform(job, {r: _inputs(step, r, shape, "float32") for r in group})[rank]
            got = results[rank][1][step]
            assert got.shape == want.shape and got.dtype == want.dtype, (step, kind, got.shape, want.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"step {step} {kind} rank {rank}")
    assert all(results[r][2] == [f"rank {q}" for q in range(4)] for r in range(4))
    assert _segments() <= before  # every segment removed by its maker


def test_a_rank_that_never_arrives_is_named():
    steps = [(CollectiveKind.ALL_REDUCE, "rows", (3,), "sum", 0)]
    results = _run(2, steps, ranks=[0], timeout=0.5)  # rank 1 never starts
    assert results[0][:2] == ("error", "AutoparError: rank 0: waited 0.5 s for rank 1 in shared memory")


def test_ranks_on_several_hosts_or_turned_off_use_gloo(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.2:6170")
    assert not shm.available(2)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170,127.0.0.1:6171")
    assert shm.available(2) == (os.uname().machine in ("x86_64", "AMD64"))
    monkeypatch.setenv(shm.ENV, "gloo")
    assert not shm.available(2)
    monkeypatch.setenv(shm.ENV, "fast")
    with pytest.raises(AutoparError, match="AUTOPAR_HOST_COMM must be 'gloo' or 'shm', got 'fast'"):
        shm.available(2)
    monkeypatch.setenv(shm.ENV, "shm")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.2:6170")
    with pytest.raises(AutoparError, match="not all on one x86-64 host"):
        shm.available(2)


@pytest.mark.parametrize("reduce", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("members", [2, 3, 4])
def test_reducing_into_the_output_tensor_is_bit_equal_to_the_reference(reduce, members):
    """The in-place all_reduce of the scope path combines the members one by one in group
    order: bit-equal to ``perform`` (what the simulator and every other path compute)."""
    group = tuple(range(members))
    job = _job(CollectiveKind.ALL_REDUCE, group, (257, 3), reduce=reduce)
    arrays = {r: _inputs(7, r, (257, 3), "float32") for r in group}
    out = np.empty((257, 3), "float32")
    assert KINDS[job.kind].perform_into(job, out, arrays)
    want = perform(job, arrays)[0]
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)
    gather = _job(CollectiveKind.ALL_GATHER, group, (257, 3))
    assert not KINDS[gather.kind].perform_into(gather, out, arrays)


def test_a_scope_tensor_is_viewed_in_place():
    import paddle
    from paddle.base import core

    tensor = core.DenseTensor()
    tensor.set(np.arange(6, dtype="float32").reshape(2, 3), paddle.CPUPlace())
    view = shm.tensor_view(tensor)
    view[0, 0] = 42.0
    assert np.array(tensor)[0, 0] == 42.0 and view.shape == (2, 3)
    scalar = core.DenseTensor()
    scalar.set(np.array(3.5, "float32"), paddle.CPUPlace())
    assert shm.tensor_view(scalar).shape == () and shm.tensor_view(core.DenseTensor()) is None
