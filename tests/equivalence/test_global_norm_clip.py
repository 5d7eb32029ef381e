"""Global-norm gradient clipping (``paddle.nn.ClipGradByGlobalNorm``) under data and tensor
parallelism: equal to serial, and no gradient moved twice (simulator).

Programs written as users write them: the clip handed to the optimizer, nothing annotated
but the batch (dp) or the Megatron weights (mp). What the clip costs is read from
``dist.comm_ops``: dp + clip moves the bytes of dp without clip (each partial gradient is
all-reduced once, in the gradient bucket, and the norm and the optimizer both read that
copy) plus at most a few scalars; mp + clip moves no gradient all_gather (the squared norm
of a split gradient is a pending sum of one scalar, reduced once for all gradients).
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.testing.models import SeedProgram
from autopar.testing.serial import random_feeds, run_serial

STEPS = 3
CLIP_NORM = 0.05  # below every step's global gradient norm here: the clip scales each step
# Adam is nearly blind to a wrong clip factor (its update is invariant to a constant gradient
# scale); Momentum and SGD are not: every equality case runs with one of them too
SCALARS = 2  # "a few scalars": reductions of norms clipping may add on top of the unclipped plan


def _optimizer(name: str, clip: bool):
    import paddle

    grad_clip = paddle.nn.ClipGradByGlobalNorm(CLIP_NORM) if clip else None
    if name == "adam":
        return paddle.optimizer.Adam(0.01, grad_clip=grad_clip)
    if name == "momentum":
        return paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=grad_clip)
    return paddle.optimizer.SGD(0.1, grad_clip=grad_clip)


def mlp(optimizer: str, clip: bool, batch: int = 8) -> SeedProgram:
    """Linear 16->32->16->10 with ReLU, cross-entropy."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 11
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 16], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        layers = {
            "linear1": paddle.nn.Linear(16, 32),
            "linear2": paddle.nn.Linear(32, 16),
            "linear3": paddle.nn.Linear(16, 10),
        }
        h = paddle.nn.functional.relu(layers["linear1"](x))
        h = paddle.nn.functional.relu(layers["linear2"](h))
        loss = paddle.mean(paddle.nn.functional.cross_entropy(layers["linear3"](h), label))
        _optimizer(optimizer, clip).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers)


def transformer(
    optimizer: str, clip: bool, batch: int = 4, seq: int = 4, hidden: int = 16, heads: int = 2, vocab: int = 24
) -> SeedProgram:
    """Embedding, one attention + MLP block with layer norms, LM head; qkv without bias (the key
    bias's true gradient is 0, rounding noise Adam would turn into lr-sized steps)."""
    import paddle

    paddle.enable_static()
    nn, F = paddle.nn, paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 11
    head_dim = hidden // heads
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        mods = {
            "embedding": nn.Embedding(vocab, hidden), "qkv0": nn.Linear(hidden, 3 * hidden, bias_attr=False),
            "proj0": nn.Linear(hidden, hidden), "fc1_0": nn.Linear(hidden, 4 * hidden), "fc2_0": nn.Linear(4 * hidden, hidden),
            "ln1_0": nn.LayerNorm(hidden), "ln2_0": nn.LayerNorm(hidden), "head": nn.Linear(hidden, vocab),
        }  # fmt: skip
        h = mods["embedding"](ids)
        x = paddle.transpose(paddle.reshape(mods["qkv0"](h), [batch, seq, heads, 3 * head_dim]), [0, 2, 1, 3])
        q, k, v = paddle.split(x, 3, axis=-1)
        att = F.softmax(paddle.matmul(q, k, transpose_y=True) * head_dim**-0.5, axis=-1)
        ctx = paddle.reshape(paddle.transpose(paddle.matmul(att, v), [0, 2, 1, 3]), [batch, seq, hidden])
        h = mods["ln1_0"](h + mods["proj0"](ctx))
        h = mods["ln2_0"](h + mods["fc2_0"](F.gelu(mods["fc1_0"](h))))
        loss = paddle.mean(F.cross_entropy(mods["head"](h), label))
        _optimizer(optimizer, clip).minimize(loss)
    return SeedProgram(main, startup, {"ids": ids, "label": label}, loss, mods)


MODELS = {"mlp": (mlp, "x", 10), "transformer": (transformer, "ids", 24)}


def compiled(
    model: str, optimizer: str, clip: bool, mesh: autopar.ProcessMesh
) -> tuple[SeedProgram, autopar.DistributedProgram]:
    build, feed, _ = MODELS[model]
    seed = build(optimizer, clip)
    if "dp" in mesh.dim_names:
        ndim = len(seed.feeds[feed].shape)
        autopar.shard_tensor(seed.feeds[feed], mesh, ["dp"] + [None] * (ndim - 1))
    if "mp" in mesh.dim_names:
        if model == "mlp":
            autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
            autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
            autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
        else:  # Megatron: qkv and fc1 column-parallel, proj and fc2 row-parallel
            for name in ("qkv0", "fc1_0"):
                autopar.shard_tensor(seed.layers[name].weight, mesh, [None, "mp"])
            autopar.shard_tensor(seed.layers["fc1_0"].bias, mesh, ["mp"])
            for name in ("proj0", "fc2_0"):
                autopar.shard_tensor(seed.layers[name].weight, mesh, ["mp", None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


def assert_equal_serial(model: str, seed: SeedProgram, dist: autopar.DistributedProgram) -> None:
    feeds = random_feeds(seed.feeds, STEPS, classes=MODELS[model][2])
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    result = autopar.simulate(dist, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg=f"loss at step {step}")
    assert serial.parameters.keys() == result.parameters.keys()
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def traffic(dist: autopar.DistributedProgram, rank: int = 0) -> tuple[int, int]:
    """(bytes, number of collectives) rank ``rank`` moves per step."""
    ops = dist.comm_ops(rank)
    return sum(c.bytes for c in ops), len(ops)


def assert_clip_adds_at_most_scalars(
    clipped: autopar.DistributedProgram, plain: autopar.DistributedProgram, rank: int = 0
) -> None:
    """The clipped plan is the unclipped one plus at most SCALARS reductions of one scalar."""
    (bytes_clip, count_clip), (bytes_plain, count_plain) = traffic(clipped, rank), traffic(plain, rank)
    extra = [c for c in clipped.comm_ops(rank) if c.kind == "all_reduce" and np.prod(c.shape) == 1]
    assert bytes_clip <= bytes_plain + SCALARS * 8, (bytes_clip, bytes_plain, [str(c) for c in clipped.comm_ops(rank)])
    assert count_clip <= count_plain + min(len(extra), SCALARS), [str(c) for c in clipped.comm_ops(rank)]
    gathers = lambda d: sorted(c.bytes for c in d.comm_ops(rank) if c.kind == "all_gather")  # noqa: E731
    assert gathers(clipped) == gathers(plain), "clipping all-gathers what the unclipped plan keeps split"


DP = autopar.ProcessMesh([0, 1], ["dp"])
MP = autopar.ProcessMesh([0, 1], ["mp"])
DP_MP = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_the_clip_is_active():
    """CLIP_NORM is below the gradient norms: every parameter ends elsewhere than unclipped."""
    runs = []
    for clip in (False, True):
        seed = mlp("sgd", clip)
        runs.append(run_serial(seed.main, seed.startup, random_feeds(seed.feeds, STEPS), [seed.loss]).parameters)
    plain, clipped = (list(run.values()) for run in runs)  # names differ per build, the order does not
    assert all(not np.allclose(a, b) for a, b in zip(plain, clipped))


# Traffic of data parallelism + clipping: each partial gradient is read twice, by its norm
# (complete) and by the multiply by the clip factor; propagation lets the multiply read the copy
# the norm's reduction already makes (Propagator._read_reduced), so one all_reduce serves both.


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_dp_clip_equals_serial(model, optimizer):
    seed, dist = compiled(model, optimizer, True, DP)
    assert not dist.report.unsupported_ops
    assert_equal_serial(model, seed, dist)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_dp_clip_all_reduces_each_gradient_once(model, optimizer):
    _, dist = compiled(model, optimizer, True, DP)
    _, plain = compiled(model, optimizer, False, DP)
    assert_clip_adds_at_most_scalars(dist, plain)
    assert traffic(dist)[1] == 1, [str(c) for c in dist.comm_ops(0)]  # the one gradient bucket


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
def test_mp_clip_equals_serial_and_gathers_no_gradient(model, optimizer):
    seed, dist = compiled(model, optimizer, True, MP)
    assert not dist.report.unsupported_ops
    assert_equal_serial(model, seed, dist)
    _, plain = compiled(model, optimizer, False, MP)
    assert_clip_adds_at_most_scalars(dist, plain)
    # the squared norms of the split gradients: one scalar pending sum, reduced once
    scalars = [c for c in dist.comm_ops(0) if np.prod(c.shape) == 1]
    assert len(scalars) == 1 and scalars[0].bytes == 4, [str(c) for c in scalars]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_dp2_x_mp2_clip_equals_serial(model):
    seed, dist = compiled(model, "momentum", True, DP_MP)
    assert not dist.report.unsupported_ops
    assert_equal_serial(model, seed, dist)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_dp2_x_mp2_clip_moves_the_unclipped_bytes_plus_a_scalar(model):
    _, dist = compiled(model, "adam", True, DP_MP)
    _, plain = compiled(model, "adam", False, DP_MP)
    for rank in DP_MP.ranks:
        assert_clip_adds_at_most_scalars(dist, plain, rank)
