"""One collective per bucket (issue 36 item 1): on the default CPU profile (``cpu-shm``), a
data-parallel or ZeRO step of a small MLP on dp=4 moves every gradient in its bucket — none
below the bucket size pays a collective of its own — and still equals serial.

Before: ZeRO-1/2 gave the small gradients (40 B - 10 KiB, whose cheapest plan alone is an
all_reduce then a slice) one all_reduce each beside the reduce_scatter bucket; plain dp gave
the 1 MiB gradient (alone cheaper as reduce_scatter + all_gather) both collectives beside the
bucket's all_reduce. Fusion now decides that decomposition for the whole bucket. A fetched
loss (a pending sum) rides in the buckets too: the step has no other collective."""

import pytest

import autopar
from autopar.suggest.pricing import added_ops
from autopar.testing.models import mlp
from autopar.testing.serial import assert_simulation_equals_serial

WIDTHS = [(512, 256, 10), (512, 512, 256, 10)]  # din 512; the second has a 1 MiB weight


def _compile(widths, **strategy):
    seed = mlp(16, widths)
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))
    names = [p.name for layer in seed.layers.values() for p in (layer.weight, layer.bias)]
    return seed, dist, names


def _explained(collective, names):
    """Each gradient named in the reason; bytes and a predicted time given."""
    assert collective.bytes > 0 and collective.time > 0, str(collective)
    for name in names:
        assert f"grad({name})" in collective.reason, (name, collective.reason)


@pytest.mark.parametrize("widths", WIDTHS, ids=["3-layer", "4-layer"])
def test_data_parallel_step_moves_every_gradient_and_the_loss_in_the_bucket(widths):
    seed, dist, names = _compile(widths)
    (bucket,) = dist.state.buckets
    for rank in dist.mesh.ranks:
        comms = [c for c, _ in dist.rank_plan(rank, fetches=[seed.loss]).collectives]
        # one all_reduce, or where cheaper its reduce_scatter + all_gather, of the one buffer
        want = ["reduce_scatter", "all_gather"] if bucket.split else ["all_reduce"]
        assert [c.kind for c in comms] == want, "\n".join(map(str, comms))
        assert all(c.key.source == "bucket" and c.key.index == bucket.index for c in comms)
        for c in comms:
            _explained(c, names)
        assert "rides along" in comms[-1].reason  # the fetched loss: no collective of its own
        # pricing counts the ops the bucket adds (padding included) as the rank program holds them
        # (beyond the serial program, less the partition's rescaling of the mean: 4 ops)
        added = len(dist.rank_program(rank).global_block().ops) - len(seed.main.global_block().ops)
        assert sum(added_ops(dist.state, rank)) == added - 4
    by_index = {p.index: p for p in dist.state.reshards}
    alone = sum(by_index[i].plan.time for i in bucket.members)
    assert bucket.time < alone
    if len(widths) == 4:  # 1.5 MiB over 4 processes: two collectives beat one all_reduce on cpu-shm
        assert bucket.split
    assert_simulation_equals_serial(seed, dist)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("widths", WIDTHS, ids=["3-layer", "4-layer"])
def test_zero_small_gradients_ride_in_the_reduce_scatter_bucket(widths, stage):
    seed, dist, names = _compile(widths, zero_stage=stage)
    for rank in dist.mesh.ranks:
        comms = [c for c, _ in dist.rank_plan(rank, fetches=[seed.loss]).collectives]
        assert [c.kind for c in comms] == ["reduce_scatter", "all_gather"], "\n".join(map(str, comms))
        assert all(c.key.source == "zero_bucket" for c in comms)
        _explained(comms[0], names)
        assert all(f"updated {name}" in comms[1].reason for name in names)
        assert all("rides along" in c.reason for c in comms)  # the loss: in both, no all_reduce of its own
    assert_simulation_equals_serial(seed, dist)


def test_a_small_bucket_stays_one_all_reduce():
    """Where one all_reduce of the buffer is cheaper (a few KiB), the bucket is not split."""
    seed, dist, _ = _compile((16, 32, 10))
    (bucket,) = dist.state.buckets
    assert not bucket.split
    assert [c.kind for c in dist.comm_ops(0)] == ["all_reduce"]
    assert_simulation_equals_serial(seed, dist)
