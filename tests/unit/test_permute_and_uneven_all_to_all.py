"""The two kinds context parallelism and MoE need, added as table entries only
(autopar/collective_kinds.py): ``permute`` (a ring shift over a mesh dim: member i sends to
i + shift, receives from i - shift) and ``all_to_all_v`` (an all_to_all with a size per
(sender, receiver) pair). Each is checked against numpy written independently of the table, run
between real processes through the host backend's shared-memory communicator (2 and 4 ranks),
through the gloo communicator's world path (its exchange, faked here), and planned / priced as a
rewrite would (cost_model.planner.plan_ring_shift, the comm formulas)."""

from __future__ import annotations

import multiprocessing
import traceback

import numpy as np
import pytest
from test_shared_memory_comm import _Store  # (the store the communicator reads: set, and a get that waits)

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import AllToAllV, kind_of, perform, perform_for
from autopar.cost_model import comm
from autopar.cost_model.cluster import shipped_profile
from autopar.cost_model.planner import plan_ring_shift
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh
from autopar.runtime import shm

FORK = multiprocessing.get_context("fork")


def _job(kind, group, shape, **fields):
    attr = DistAttr.replicated(ProcessMesh(list(group)), len(shape))
    return Collective(
        kind=kind, group=tuple(group), key=CollectiveKey("test", 0), value="kv", src=attr, dst=attr, shape=shape,
        output_shape=shape, bytes=0, time=0.0, reason="test", **fields,
    )  # fmt: skip


def _uneven(p: int) -> tuple[tuple[int, ...], ...]:
    """A p x p split matrix with zeros and unequal rows (member i sends (i + j) % 3 rows to j)."""
    return tuple(tuple((i + j) % 3 for j in range(p)) for i in range(p))


def _senders_input(i: int, splits, cols: int = 3) -> tuple[np.ndarray, list[np.ndarray]]:
    """Member i's send buffer and its blocks for each receiver (rows tagged by sender and receiver)."""
    blocks = [np.full((splits[i][j], cols), 100.0 * i + j, np.float32) + np.arange(cols, dtype=np.float32) for j in range(len(splits))]
    return np.concatenate(blocks, axis=0), blocks


@pytest.mark.parametrize("p, shift", [(2, 1), (4, 1), (4, 3), (4, -1), (3, 5)])
def test_permute_is_a_ring_shift(p, shift):
    rng = np.random.default_rng(p * 10 + shift)
    inputs = {r: rng.standard_normal((2, 5)).astype(np.float32) for r in range(p)}
    out = perform(_job("permute", range(p), (2, 5), shift=shift), inputs)
    rolled = np.roll(np.stack([inputs[r] for r in range(p)]), shift, axis=0)  # member i ends with i - shift's
    for r in range(p):
        np.testing.assert_array_equal(out[r], rolled[r])
        assert np.array_equal(perform_for(_job("permute", range(p), (2, 5), shift=shift), inputs, r), out[r])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_to_all_v_delivers_each_pair_its_block(p):
    splits = _uneven(p)
    made = {i: _senders_input(i, splits) for i in range(p)}
    job = _job("all_to_all_v", range(p), (0, 3), splits=splits)
    out = perform(job, {i: made[i][0] for i in range(p)})
    for j in range(p):
        want = np.concatenate([made[i][1][j] for i in range(p)], axis=0)
        np.testing.assert_array_equal(out[j], want)
        assert out[j].shape == (sum(splits[i][j] for i in range(p)), 3)
        assert np.array_equal(perform_for(job, {i: made[i][0] for i in range(p)}, j), out[j])


def test_all_to_all_v_without_splits_is_all_to_all():
    rng = np.random.default_rng(1)
    inputs = {r: rng.standard_normal((4, 6)).astype(np.float32) for r in range(2)}
    even = perform(_job("all_to_all", (0, 1), (4, 6), axis=0, split_axis=1), inputs)
    assert all(np.array_equal(v, even[r]) for r, v in perform(_job("all_to_all_v", (0, 1), (4, 6), axis=0, split_axis=1), inputs).items())


def test_wrong_splits_are_refused_by_name():
    with pytest.raises(ValueError, match=r"all_to_all_v of kv: splits must be 2 x 2 counts >= 0"):
        _job("all_to_all_v", (0, 1), (4,), splits=((1, 1),))
    job = _job("all_to_all_v", (0, 1), (4,), splits=((1, 2), (2, 2)))
    with pytest.raises(AutoparError, match=r"member 0 sends \[1, 2\] \(sum 3\) along dim 0 of an input of shape \[4\]"):
        perform(job, {0: np.zeros(4), 1: np.zeros(4)})


class _FakeWorld:
    """What the gloo communicator lends ``eager``: its rank and every rank's array."""

    def __init__(self, rank, arrays):
        self.rank, self.arrays = rank, arrays

    def gathered(self, x):
        assert np.array_equal(x, self.arrays[self.rank])
        return dict(self.arrays)


def test_the_gloo_world_path_computes_the_reference():
    splits = _uneven(4)
    arrays = {i: _senders_input(i, splits)[0] for i in range(4)}
    for job in (_job("all_to_all_v", range(4), (0, 3), splits=splits), _job("permute", range(4), (1,), shift=1)):
        inputs = arrays if job.kind == "all_to_all_v" else {r: np.array([float(r)]) for r in range(4)}
        want = perform(job, inputs)
        for rank in range(4):
            assert kind_of(job.kind).emulated_by is None  # gloo runs it by its eager exchange
            np.testing.assert_array_equal(kind_of(job.kind).eager(job, inputs[rank], _FakeWorld(rank, inputs)), want[rank])


# ---- between processes: the host backend's shared-memory communicator ---------------------------


def _steps(world):
    """(job, every rank's input) the ranks run in order: ring shifts both ways, uneven all_to_all_v
    over the world and over pairs of ranks."""
    rng = np.random.default_rng(world)
    ring = {r: rng.standard_normal((3, 2)).astype(np.float32) for r in range(world)}
    splits = _uneven(world)
    steps = [
        (_job("permute", range(world), (3, 2), shift=1), ring),
        (_job("permute", range(world), (3, 2), shift=-1), ring),
        (_job("all_to_all_v", range(world), (0, 3), splits=splits), {i: _senders_input(i, splits)[0] for i in range(world)}),
    ]
    if world == 4:  # sub-groups (0, 1) and (2, 3) at once, different splits in each
        pairs = {(0, 1): ((2, 0), (1, 3)), (2, 3): ((0, 1), (4, 2))}
        for group, sp in pairs.items():
            steps.append((_job("all_to_all_v", group, (0, 3), splits=sp), {g: _senders_input(k, sp)[0] for k, g in enumerate(group)}))
    return steps


def _rank_main(rank, world, shared, results):
    try:
        node = shm.NodeMemory(rank, world, _Store(shared), 20.0)
        outs = []
        for job, inputs in _steps(world):
            if rank in job.group:  # what SharedMemoryCommunicator.run does for a collective
                outs.append(node.collect(job.group, inputs[rank], lambda a, job=job: shm._owned(perform_for(job, a, rank), a)))
        results[rank] = ("ok", outs)
        node.close()
    except BaseException as error:  # reported to the test
        results[rank] = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())


@pytest.mark.parametrize("world", [2, 4])
def test_between_processes_equal_the_reference(world):
    manager = FORK.Manager()
    shared, results = manager.dict(), manager.dict()
    procs = [FORK.Process(target=_rank_main, args=(r, world, shared, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    results = dict(results)
    assert sorted(results) == list(range(world)) and all(res[0] == "ok" for res in results.values()), results
    for rank in range(world):
        wanted = [perform(job, inputs)[rank] for job, inputs in _steps(world) if rank in job.group]
        assert len(results[rank][1]) == len(wanted) == (4 if world == 4 else 3)  # (each rank is in one of the pairs)
        for got, want in zip(results[rank][1], wanted):
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)


# ---- planned and priced as a rewrite would -----------------------------------------------------


def test_a_ring_shift_is_planned_and_priced_by_the_table():
    cluster = shipped_profile("h100-node")
    mesh = ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "cp"])
    keys = DistAttr.of(mesh, ((0,), (1,), ()))  # [batch, sequence, hidden]: batch over dp, sequence over cp
    step = plan_ring_shift(keys, 1, (8, 4096, 1024), "bfloat16", cluster)
    piece = 4 * 1024 * 1024 * 2  # one rank's block: 4 x 1024 x 1024 bf16
    assert step.kind is CollectiveKind.PERMUTE and step.src == step.dst == keys and step.shift == 1
    assert step.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and step.bytes == piece
    link = cluster.link_for((0, 1, 2, 3), "permute")
    assert step.time == pytest.approx(link.latency + piece / link.bandwidth + cluster.device.segment_seconds)
    # one hop of the block: cheaper than gathering every block (ring attention's reason to shift)
    assert step.time < comm.groups_time("all_gather", step.groups, 4 * piece, cluster)
    with pytest.raises(Exception, match="mesh dim 2 is not a dim of"):
        plan_ring_shift(keys, 2, (8, 4096, 1024), "bfloat16", cluster)


def test_an_uneven_all_to_all_is_priced_by_its_busiest_member():
    cluster = shipped_profile("h100-node")
    splits = ((5, 1, 0, 2), (0, 0, 7, 1), (3, 3, 3, 3), (1, 0, 0, 0))
    row = 1024 * 2  # one token's hidden state, bf16
    sent = [3, 8, 9, 1]  # off-diagonal row sums
    received = [4, 4, 7, 6]  # off-diagonal column sums
    nbytes = AllToAllV.traffic(splits, row)
    assert nbytes == max(sent + received) * row
    assert comm.coefficients("all_to_all_v", 4, nbytes) == (3.0, nbytes)
    link = cluster.link_for((0, 1, 2, 3), "all_to_all_v")
    assert comm.collective_time("all_to_all_v", (0, 1, 2, 3), nbytes, cluster) == pytest.approx(
        3 * link.latency + nbytes / link.bandwidth + cluster.device.segment_seconds
    )
    assert comm.coefficients("permute", 4, 100.0) == (1.0, 100.0)


def test_on_gloo_a_world_permute_is_priced_as_the_exchange_that_runs_it():
    """gloo has no permute or all_to_all_v: the host backend exchanges every rank's input even over
    the whole world (``eager``), so the cpu-gloo profile (``world_exchange``) prices that."""
    cluster = shipped_profile("cpu-gloo")
    segment = cluster.device.segment_seconds
    for kind in ("permute", "all_to_all_v"):
        got = comm.collective_time(kind, (0, 1, 2, 3), 4096, cluster, world_size=4)
        assert got == pytest.approx(comm.exchange_time(kind, 4, 4096, (0, 1, 2, 3), cluster) + segment)
    native = comm.collective_time("all_reduce", (0, 1, 2, 3), 4096, cluster, world_size=4)
    link = cluster.link_for((0, 1, 2, 3), "all_reduce")
    assert native == pytest.approx(comm.algorithm_time("all_reduce", 4, 4096, link) + segment)  # gloo runs it itself
