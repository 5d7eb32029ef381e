"""The cost profile follows the hardware in use unless the Strategy names one, the report says
which and why, and gradient fusion weighs a bucket against each gradient's own cheapest plan.

On cpu-gloo a sub-group collective runs as a world exchange (the host backend), so the
cheapest *single* reshard of a dp x mp gradient replicated over mp is a world all_reduce
(make_partial on mp, then all 4 ranks), yet one dp bucket holding it beside the mp-split
gradients costs less than a world all_reduce per gradient: fusion prices both packings (each
gradient on its own plan's form, or on the direct all_reduce over dp) and keeps the cheaper.
"""

from __future__ import annotations

import platform

import numpy as np
import paddle
import pytest

import autopar
from autopar.cli import explain_text
from autopar.cost_model import default_cluster, hardware_profile
from autopar.testing.models import simple_net
from autopar.testing.serial import random_feeds, run_serial

ON_GPU = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def test_profile_from_the_device(monkeypatch):
    assert hardware_profile(cuda=False, shared_memory=False).name == "cpu-gloo"
    assert hardware_profile(cuda=False, shared_memory=True).name == "cpu-shm"
    assert hardware_profile(cuda=True).name == "h100-node"
    assert default_cluster(cuda=False, shared_memory=True).name == "cpu-shm" and default_cluster(cuda=True).name == "h100-node"
    cpu = "cpu-shm" if platform.machine().lower() in ("x86_64", "amd64") else "cpu-gloo"
    assert default_cluster().name == hardware_profile().name == ("h100-node" if ON_GPU else cpu)
    assert "chosen from the hardware" in str(hardware_profile(cuda=False))
    monkeypatch.setenv("AUTOPAR_HOST_COMM", "gloo")  # the CPU runtime's gloo collectives: their profile
    assert hardware_profile(cuda=False).name == "cpu-gloo"


def dp_mp(sizes=(8, 16, 8, 4), cluster: str | None = None):
    """SimpleNet on dp=2 x mp=2: batch split, linear1 column- and linear2 row-parallel; linear3
    (and the biases of linear2 / linear3) replicated over mp."""
    with paddle.utils.unique_name.guard():
        net = simple_net(batch=4, sizes=sizes)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    l1, l2 = net.layers["linear1"], net.layers["linear2"]
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(l1.weight, mesh, [None, "mp"])
    autopar.shard_tensor(l1.bias, mesh, ["mp"])
    autopar.shard_tensor(l2.weight, mesh, ["mp", None])
    strategy = autopar.Strategy(cluster=cluster) if cluster else None
    return net, autopar.compile(net.main, mesh, startup_program=net.startup, strategy=strategy)


def test_compile_takes_the_hardware_profile_and_the_strategy_overrides_it():
    _, dist = dp_mp()
    assert dist.state.cluster.name == hardware_profile().name
    report = str(dist.cost)
    assert f"predicted cost on {hardware_profile().name}" in report
    assert "cost profile: " + str(hardware_profile()) in report
    _, pinned = dp_mp(cluster="h100-node")
    assert pinned.state.cluster.name == "h100-node"
    assert "cost profile: h100-node, from Strategy(cluster='h100-node')" in str(pinned.cost)
    assert "chosen from the hardware" in explain_text(dist) and "from Strategy(cluster=" in explain_text(pinned)


def summary(dist, rank=0):
    return [(str(c.kind), c.group, c.bytes, c.key.source) for c in dist.comm_ops(rank)]


def test_dp_mp_gradients_share_one_bucket_on_gloo_as_on_h100():
    """The mp-replicated gradients (linear2 / linear3 biases and linear3's weight, 3 of 6) would
    each take a world all_reduce on their own on cpu-gloo; in the dp bucket they cost less."""
    _, gloo = dp_mp(cluster="cpu-gloo")
    _, h100 = dp_mp(cluster="h100-node")
    assert summary(gloo) == summary(h100) == [
        ("all_reduce", (0, 1), 64, "reshard"),  # the row-parallel output, over mp
        ("all_reduce", (0, 2), 720, "bucket"),  # 6 gradients over dp
    ]
    (bucket,) = gloo.state.buckets
    assert len(bucket.members) == 6
    # priced as emitted: one all_reduce over dp (on gloo a sub-group: a world exchange)
    assert bucket.time == pytest.approx(gloo.comm_ops(0)[1].time) and bucket.time > 10e-3


def test_big_replicated_gradients_take_a_world_bucket_on_gloo():
    """linear3's 4 MiB weight gradient would cost ~74 ms in the dp bucket (a sub-group runs as a
    world exchange, world x bytes); the gradients replicated over mp then share a world bucket
    instead (their copies zeroed on mp rank 1, one all_reduce over all 4 ranks) and the mp-split
    ones a dp bucket: priced lower than one dp bucket plus the big one alone. On h100-node all six
    share the dp bucket. Equal to serial in the simulator."""
    net, gloo = dp_mp(sizes=(8, 16, 1024, 1024), cluster="cpu-gloo")
    big = net.layers["linear3"].weight.name
    assert [(k, g) for k, g, _, _ in summary(gloo)] == [
        ("all_reduce", (0, 1)), ("all_reduce", (0, 1, 2, 3)), ("all_reduce", (0, 2)),
    ]  # fmt: skip
    world, dp = gloo.state.buckets
    assert world.zeroed == (1,) and world.mesh_dims == (0, 1) and len(world.members) == 3
    assert f"grad({big})" in gloo.comm_ops(0)[1].reason and dp.zeroed == () and len(dp.members) == 3
    _, h100 = dp_mp(sizes=(8, 16, 1024, 1024), cluster="h100-node")
    assert [len(b.members) for b in h100.state.buckets] == [6]  # NCCL sub-groups are native: one dp bucket
    feeds = random_feeds(net.feeds, 2, classes=1024)
    serial = run_serial(net.main, net.startup, feeds, [net.loss])
    result = autopar.simulate(gloo, feeds, [net.loss])
    for want, got in zip(serial.fetches, result.fetches):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
