"""``Strategy(local_batch_norm=True)``: classic per-rank batch norm (NOT equal to serial), in the
simulator.

- Plan: no statistics all_reduce in the normalization, forward or backward; one all_reduce of
  2·C values per batch norm per step averages the running mean / variance over dp (the policy,
  passes/batch_norm_stats.py); BatchNorm's scale / bias gradients join the gradient bucket.
- Each rank's normalized output equals batch norm of its own rows alone (numpy, Paddle's
  formulas: biased variance, eps 1e-5), on an even and an uneven split of the batch.
- Running statistics follow the policy step after step (numpy recursion over the fetched
  inputs of the batch norm: each rank's batch mean / variance weighted by its share of the
  rows), so the running mean of the first step equals serial's exactly; replicas of every
  parameter and running statistic are bit-identical after several steps (``simulate`` checks
  every replicated copy), and without the averaging they would not be.
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.serial import random_feeds, run_serial

EPS, MOMENTUM, CHANNELS = 1e-5, 0.9, 4
LOCAL = autopar.Strategy(local_batch_norm=True)


def conv_bn(batch: int):
    """conv2d -> BatchNorm2D -> relu -> pool -> Linear; Momentum. Returns the program pieces and
    the batch norm's input and output."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 3
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 3, 6, 6], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        conv, bn, fc = nn.Conv2D(3, CHANNELS, 3, padding=1), nn.BatchNorm2D(CHANNELS, momentum=MOMENTUM), nn.Linear(CHANNELS * 9, 5)
        y = conv(x)
        z = bn(y)
        loss = paddle.mean(F.cross_entropy(fc(paddle.flatten(F.max_pool2d(F.relu(z), 2), 1)), label))
        paddle.optimizer.Momentum(0.1, momentum=0.9).minimize(loss)
    return dict(main=main, startup=startup, feeds={"x": x, "label": label}, loss=loss, y=y, z=z, bn=bn)


def compiled(net, mesh, strategy=LOCAL):
    autopar.shard_tensor(net["feeds"]["x"], mesh, ["dp", None, None, None])
    autopar.shard_tensor(net["feeds"]["label"], mesh, ["dp", None])
    return autopar.compile(net["main"], mesh, startup_program=net["startup"], strategy=strategy)


def rows(batch: int, ranks: int) -> list[np.ndarray]:
    """The rows each rank holds (numpy.array_split bounds, as autopar splits)."""
    return np.array_split(np.arange(batch), ranks)


def test_plan_no_statistics_all_reduce_one_running_average_per_batch_norm():
    net = conv_bn(batch=8)
    dist = compiled(net, autopar.ProcessMesh([0, 1], ["dp"]))
    exact = compiled(conv_bn(batch=8), autopar.ProcessMesh([0, 1], ["dp"]), strategy=None)
    assert "local_batch_norm()" in str(dist.passes) and "op_lowering()" in str(dist.passes)
    for rank in (0, 1):
        bn = [c for c in dist.comm_ops(rank) if c.key.source == "batch_norm"]
        assert [(str(c.kind), c.shape, c.group, c.bytes) for c in bn] == [("all_reduce", (2, CHANNELS), (0, 1), 2 * CHANNELS * 4)]
        assert bn[0].reason.startswith("local batch-norm running statistics in BatchNorm2D")
        assert "running mean and variance" in bn[0].reason
    assert len([c for c in exact.comm_ops(0) if c.key.source == "batch_norm"]) == 2  # exact: forward sums + backward sums
    (bucket,) = [c for c in dist.comm_ops(0) if c.key.source == "bucket"]
    for param in (net["bn"].weight.name, net["bn"].bias.name):  # per-rank sums of dy, dy·x̂: partial, synced with the rest
        assert f"grad({param})" in bucket.reason


def test_channel_split_averages_each_rank_s_channels_over_dp():
    net = conv_bn(batch=8)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    autopar.shard_tensor(net["bn"].weight, mesh, ["mp"])  # channels over mp: BatchNorm's vectors follow
    dist = compiled(net, mesh)
    (average,) = [c for c in dist.comm_ops(0) if c.key.source == "batch_norm"]
    assert average.group == (0, 2) and average.output_shape == (2, CHANNELS // 2)
    _run(net, dist, steps=3)


def local_reference(y: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    """Batch norm of each rank's rows with their own statistics (scale 1, bias 0: the start)."""
    out = np.empty_like(y)
    for part in parts:
        block = y[part]
        mean, var = block.mean(axis=(0, 2, 3), keepdims=True), block.var(axis=(0, 2, 3), keepdims=True)
        out[part] = (block - mean) / np.sqrt(var + EPS)
    return out


def running_reference(ys: list[np.ndarray], parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The policy, step by step: running = m·running + (1-m)·Σ_rank (n_rank/N)·batch statistic."""
    mean, var = np.zeros(CHANNELS), np.ones(CHANNELS)
    for y in ys:
        n = y.shape[0]
        batch_mean = sum(len(p) / n * y[p].mean(axis=(0, 2, 3)) for p in parts)
        batch_var = sum(len(p) / n * y[p].var(axis=(0, 2, 3)) for p in parts)
        mean, var = MOMENTUM * mean + (1 - MOMENTUM) * batch_mean, MOMENTUM * var + (1 - MOMENTUM) * batch_var
    return mean, var


def _run(net, dist, steps):
    feeds = random_feeds(net["feeds"], steps, classes=5)
    return feeds, autopar.simulate(dist, feeds, [net["loss"], net["y"], net["z"]])


@pytest.mark.parametrize("batch", [8, 5], ids=["even", "uneven"])
def test_each_rank_normalizes_its_rows_and_the_running_statistics_are_averaged(batch):
    net = conv_bn(batch)
    dist = compiled(net, autopar.ProcessMesh([0, 1], ["dp"]))
    feeds, result = _run(net, dist, steps=4)  # simulate refuses replicas that differ: they are identical
    parts = rows(batch, 2)
    _, y0, z0 = result.fetches[0]
    np.testing.assert_allclose(z0, local_reference(y0, parts), rtol=1e-4, atol=1e-5)  # (a), first step
    serial = run_serial(net["main"], net["startup"], feeds[:1], [net["loss"], net["z"]])
    assert not np.allclose(serial.fetches[0][1], z0, atol=1e-3)  # not serial: the statistics are the rank's
    mean, var = running_reference([f[1] for f in result.fetches], parts)
    np.testing.assert_allclose(result.parameters[net["bn"]._mean.name], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.parameters[net["bn"]._variance.name], var, rtol=1e-5, atol=1e-6)
    one_step = autopar.simulate(dist, feeds[:1], [])
    np.testing.assert_allclose(  # the weighted mean of the ranks' batch means is the batch mean
        one_step.parameters[net["bn"]._mean.name], serial.parameters[net["bn"]._mean.name], rtol=1e-5, atol=1e-6
    )


def test_without_the_average_replicas_would_differ(monkeypatch):
    from autopar.passes.batch_norm_stats import StatKernels

    monkeypatch.setattr(StatKernels, "average_running", lambda self, serial, operands, inplace: None)
    net = conv_bn(batch=8)
    dist = compiled(net, autopar.ProcessMesh([0, 1], ["dp"]))
    assert not [c for c in dist.comm_ops(0) if c.key.source == "batch_norm"]
    with pytest.raises(AutoparError, match="batch_norm2d"):
        _run(net, dist, steps=1)


def test_local_batch_norm_is_type_checked():
    with pytest.raises(AutoparError, match="local_batch_norm must be True or False"):
        autopar.Strategy(local_batch_norm=1)
