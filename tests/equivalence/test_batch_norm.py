"""Batch norm over a batch split between ranks, in the simulator: equal to serial, and the only
communication BatchNorm adds is an all_reduce of 2·C values forward and one backward.

A conv net written the way a user writes it (conv2d + BatchNorm2D + relu + pool, twice, then
a linear head), the input annotated ``["dp", None, None, None]`` on dp=2 and on dp=2 x mp=2.
Losses every step, every parameter after 3 steps and the running mean / variance (persistable
states updated in place by ``batch_norm_``) equal serial, rtol 1e-5 (fp32). From rank 0's
collectives: no all_gather of an activation, and each BatchNorm's collectives are all_reduces
of ``[2, C]`` (the per-channel sums). An eval-mode (is_test) program keeps its split without
any collective; Paddle's own kernel fixes the statistics' formulas (biased variance in the
running variance, ``saved_variance`` is 1/sqrt(var + eps)).
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.testing.models import SeedProgram, make_optimizer
from autopar.testing.serial import random_feeds, run_serial

MESHES = {
    "dp2": autopar.ProcessMesh([0, 1], ["dp"]),
    "dp2xmp2": autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}
CHANNELS = (4, 6)


def conv_bn_net(batch: int = 4, image: int = 8, classes: int = 5, optimizer: str = "momentum", train: bool = True):
    """conv2d + BatchNorm2D + relu + max pool, twice, flatten, Linear; mean cross-entropy."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 11
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 3, image, image], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        mods = {
            "conv1": nn.Conv2D(3, CHANNELS[0], 3, padding=1),
            "bn1": nn.BatchNorm2D(CHANNELS[0]),
            "conv2": nn.Conv2D(CHANNELS[0], CHANNELS[1], 3, padding=1),
            "bn2": nn.BatchNorm2D(CHANNELS[1], momentum=0.8),
        }
        if not train:
            for layer in mods.values():
                layer.eval()
        h = F.max_pool2d(F.relu(mods["bn1"](mods["conv1"](x))), 2)
        h = F.max_pool2d(F.relu(mods["bn2"](mods["conv2"](h))), 2)
        mods["fc"] = nn.Linear(CHANNELS[1] * (image // 4) ** 2, classes)
        loss = paddle.mean(F.cross_entropy(mods["fc"](paddle.flatten(h, 1)), label))
        if train:
            make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)


def compiled(seed: SeedProgram, mesh: autopar.ProcessMesh):
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None, None, None])
    autopar.shard_tensor(seed.feeds["label"], mesh, ["dp", None])
    return autopar.compile(seed.main, mesh, startup_program=seed.startup)


def running_stats(seed: SeedProgram) -> list[str]:
    return [seed.layers[n]._mean.name for n in ("bn1", "bn2")] + [seed.layers[n]._variance.name for n in ("bn1", "bn2")]


def assert_equal_serial(seed, dist, steps=3, rtol=1e-5, atol=1e-6):
    feeds = random_feeds(seed.feeds, steps, classes=5)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    result = autopar.simulate(dist, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol * 0.1, err_msg=f"loss at step {step}")
    assert set(running_stats(seed)) <= set(serial.parameters)
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)
    return serial, result


def batch_norm_collectives(dist, rank=0):
    return [c for c in dist.comm_ops(rank) if c.key.source == "batch_norm"]


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_conv_bn_net_dp_equals_serial(mesh, optimizer):
    seed = conv_bn_net(optimizer=optimizer)
    dist = compiled(seed, mesh)
    assert not dist.report.unsupported_ops
    serial, _ = assert_equal_serial(seed, dist)
    assert any(not np.allclose(serial.parameters[n], 0.0) for n in running_stats(seed))  # they were updated
    for rank in mesh.ranks:
        comm = dist.comm_ops(rank)
        assert [c for c in comm if c.kind == "all_gather"] == [], [str(c) for c in comm]
        bn = batch_norm_collectives(dist, rank)
        assert [(str(c.kind), c.shape) for c in bn] == [
            ("all_reduce", (2, CHANNELS[0])), ("all_reduce", (2, CHANNELS[1])),  # forward: sums of x, x²
            ("all_reduce", (2, CHANNELS[1])), ("all_reduce", (2, CHANNELS[0])),  # backward: sums of dy, dy·x̂
        ]  # fmt: skip
        grad_sync = {c.group for c in comm if c.key.source != "batch_norm"}  # the data-parallel gradient sums
        assert {c.group for c in bn} == grad_sync and len(grad_sync) == 1


def test_bn_statistics_are_not_gradient_synced():
    """scale_grad / bias_grad come out complete from the backward's 2·C all_reduce: the only other
    collectives are the gradient sums of the convolutions and the linear layer."""
    seed = conv_bn_net(optimizer="sgd")
    dist = compiled(seed, MESHES["dp2"])
    bn_params = {p.name for n in ("bn1", "bn2") for p in (seed.layers[n].weight, seed.layers[n].bias)}
    others = [c for c in dist.comm_ops(0) if c.key.source != "batch_norm"]
    assert not any(name in c.reason for c in others for name in bn_params), [c.reason for c in others]


def test_channel_split_needs_no_statistics_collective():
    """x split on channels over mp (and on the batch over dp): the sums are all-reduced over dp
    only, C/2 channels per rank."""
    mesh = MESHES["dp2xmp2"]
    seed = conv_bn_net(optimizer="sgd")
    autopar.shard_tensor(seed.layers["conv1"].weight, mesh, ["mp", None, None, None])
    dist = compiled(seed, mesh)
    assert_equal_serial(seed, dist)
    first = batch_norm_collectives(dist, 0)[0]
    assert (
        first.kind == "all_reduce" and first.shape == (2, CHANNELS[0]) and first.output_shape == (2, CHANNELS[0] // 2)
    )
    assert first.group == (0, 2)


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_eval_mode_keeps_split_without_collectives(mesh):
    seed = conv_bn_net(train=False)
    dist = compiled(seed, mesh)
    assert batch_norm_collectives(dist, 0) == []
    assert [c for c in dist.comm_ops(0) if c.kind == "all_gather" and "x" in c.value] == []
    feeds = random_feeds(seed.feeds, 2, classes=5)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    result = autopar.simulate(dist, feeds, [seed.loss])
    for want, got in zip(serial.fetches, result.fetches):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-7)


def test_kernel_formulas_match_paddle():
    """What the rewrite reproduces, checked on Paddle's kernel (training mode)."""
    import paddle

    paddle.disable_static()
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(1.0, 2.0, (6, 3, 4, 5)).astype("float32")
        rm, rv = rng.normal(size=3).astype("float32"), rng.uniform(0.5, 2, size=3).astype("float32")
        w, b = rng.normal(size=3).astype("float32"), rng.normal(size=3).astype("float32")
        t = paddle.to_tensor
        out, mean_out, var_out, saved_mean, saved_var, _ = paddle._C_ops.batch_norm(
            t(x), t(rm), t(rv), t(w), t(b), False, 0.9, 1e-5, "NCHW", False, False
        )
        mu, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
        np.testing.assert_allclose(saved_mean.numpy(), mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(saved_var.numpy(), 1 / np.sqrt(var + 1e-5), rtol=1e-5)
        np.testing.assert_allclose(mean_out.numpy(), 0.9 * rm + 0.1 * mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var_out.numpy(), 0.9 * rv + 0.1 * var, rtol=1e-5)  # biased variance
        y = paddle.nn.functional.batch_norm(t(x), t(rm), t(rv), t(w), t(b), training=True)
        want = (x - mu[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5) * w[None, :, None, None]
        np.testing.assert_allclose(y.numpy(), want + b[None, :, None, None], rtol=1e-4, atol=1e-5)
    finally:
        paddle.enable_static()


def tensor_parallel_conv_bn(mesh, channels: int = 4, batch: int = 4, image: int = 6):
    """A user's tensor-parallel CNN: conv1's output channels split over mp (weight ``["mp", None,
    None, None]``, bias ``["mp"]``), then conv2 + BatchNorm2D + a residual add, the BatchNorm's
    own parameters and statistics left to propagation; dp (when the mesh has it) splits the batch."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5  # (assert_equal_serial runs serial first)
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 3, image, image], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        conv1, conv2, bn = nn.Conv2D(3, channels, 3, padding=1), nn.Conv2D(channels, channels, 3, padding=1), nn.BatchNorm2D(channels)
        autopar.shard_tensor(conv1.weight, mesh, ["mp", None, None, None])
        autopar.shard_tensor(conv1.bias, mesh, ["mp"])
        if "dp" in mesh.dim_names:
            autopar.shard_tensor(x, mesh, ["dp", None, None, None])
        h = F.relu(conv1(x))
        h = h + bn(conv2(h))
        fc = nn.Linear(channels * image * image, 5)
        loss = paddle.mean(F.cross_entropy(fc(paddle.flatten(h, 1)), label))
        make_optimizer("momentum").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, {"bn1": bn, "bn2": bn})


@pytest.mark.parametrize(
    "mesh, channels",
    [(autopar.ProcessMesh([0, 1], ["mp"]), 4), (autopar.ProcessMesh([0, 1, 2], ["mp"]), 4),
     (autopar.ProcessMesh([0, 1, 2], ["mp"]), 5), (MESHES["dp2xmp2"], 4)],
    ids=["mp2", "mp3-uneven", "mp3-uneven-5", "dp2xmp2"],
)  # fmt: skip
def test_tensor_parallel_conv_with_unannotated_batch_norm(mesh, channels):
    """Refused before ("batch_norm_ updates batch_norm2d_K.w_1 in place but needs it as [S(0)]
    while it is [R]"): the running statistics, parameters updated in place, now take the
    channel split the op needs, like states updated in place."""
    seed = tensor_parallel_conv_bn(mesh, channels)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    bn = seed.layers["bn1"]
    mp = mesh.dim_names.index("mp")
    for stat in (bn._mean, bn._variance):
        assert dist.dist_attr(stat.name).mapping[0] == (mp,), dist.dist_attr(stat.name)
    assert_equal_serial(seed, dist)
