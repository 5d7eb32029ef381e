"""One collective per bucket (issue 36 item 1): on the default CPU profile (``cpu-shm``), a
data-parallel or ZeRO step of a small MLP on dp=4 moves every gradient in its bucket — none
below the bucket size pays a collective of its own — and still equals serial.

Before: ZeRO-1/2 gave the small gradients (40 B - 10 KiB, whose cheapest plan alone is an
all_reduce then a slice) one all_reduce each beside the reduce_scatter bucket; plain dp gave
the 1 MiB gradient (alone priced cheaper as reduce_scatter + all_gather) both collectives beside
the bucket's all_reduce. The decomposition is now the bucket's to decide, and a bucket is one
all_reduce (measured faster: see passes/allreduce_fusion.py). A fetched loss (a pending sum)
rides in the buckets too: the step has no other collective."""

import pytest

import autopar
from autopar.pricing import added_ops
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
def test_data_parallel_step_moves_every_gradient_and_the_loss_in_one_all_reduce(widths):
    seed, dist, names = _compile(widths)
    (bucket,) = dist.state.buckets
    for rank in dist.mesh.ranks:
        (comm,) = [c for c, _ in dist.rank_plan(rank, fetches=[seed.loss]).collectives]
        assert comm.kind == "all_reduce" and comm.key.source == "bucket", str(comm)
        _explained(comm, names)
        assert "rides along" in comm.reason  # the fetched loss: no collective of its own
        # pricing counts the ops the bucket adds as the rank program holds them (beyond the
        # serial program, less the partition's rescaling of the mean: 4 ops)
        added = len(dist.rank_program(rank).global_block().ops) - len(seed.main.global_block().ops)
        assert sum(added_ops(dist.state, rank)) == added - 4
    if len(widths) == 4:  # the 1 MiB weight's gradient: alone, its plan is reduce_scatter + all_gather
        (big,) = [p for p in dist.state.reshards if p.index in bucket.members and p.plan.shape == (512, 512)]
        assert [s.kind for s in big.plan.steps] == ["all_reduce"]  # in the bucket: its all_reduce
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
