"""Named (model, mesh, strategy) configurations covering every strategy autopar has, built the
same way for every tool that sweeps them (``autopar.check``'s no-false-positive test, its
benchmark). Each entry builds a fresh program and returns the seed and its DistributedProgram."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.testing.models import (
    SeedProgram,
    alexnet_program,
    annotate_megatron,
    gpt_block_program,
    linear_net,
    simple_net,
)
from autopar.testing.pipeline_models import residual_blocks, staged_mlp, tied_lm

Built = tuple[SeedProgram, Any]


def _mesh(shape: tuple[int, ...], names: list[str]) -> Any:
    import numpy as np

    import autopar

    return autopar.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), names)


def _compile(seed: SeedProgram, mesh: Any, **strategy: Any) -> Built:
    import autopar

    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))


def _simple(mode: str) -> Built:
    import autopar

    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    mesh = _mesh((2, 2), ["dp", "mp"]) if mode == "dp_mp" else _mesh((2,), [mode])
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    if "mp" in mesh.dim_names:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    return _compile(seed, mesh)


def _gpt(
    mesh_shape: tuple[int, ...], names: list[str], vocab_parallel: bool = False, optimizer: str = "momentum", dropout: float = 0.0,
    **strategy: Any,
) -> Built:  # fmt: skip
    import autopar

    seed = gpt_block_program(batch=4, seq=8, hidden=32, heads=4, vocab=64, layers=2, optimizer=optimizer, dropout=dropout)
    mesh = _mesh(mesh_shape, names)
    if "mp" in names:
        annotate_megatron(seed, mesh)
    if vocab_parallel:
        autopar.shard_tensor(seed.layers["embedding"].weight, mesh, ["mp", None])
        autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, "mp"])
    if "dp" in names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return _compile(seed, mesh, **strategy)


def _alexnet(classifier_mp: bool = False) -> Built:
    """Convolutions data parallel; ``classifier_mp``: the classifier tensor parallel too (the
    alexnet example's layout)."""
    import autopar

    seed = alexnet_program(batch=4, image=16)
    mesh = _mesh((2, 2), ["dp", "mp"]) if classifier_mp else _mesh((2,), ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None, None, None])
    if classifier_mp:
        autopar.shard_tensor(seed.layers["fc1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["fc2"].weight, mesh, ["mp", None])
    return _compile(seed, mesh)


def _conv_bn(mode: str) -> Built:
    """conv + BatchNorm2D + relu, a residual conv + BatchNorm2D, a linear head. ``"dp"``: the
    batch split (exact batch statistics over dp); ``"mp"``: the first conv's output channels
    split (the batch norms' statistics follow); ``"dp_mp"``: both."""
    import autopar
    from autopar.testing.models import _static

    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 11
    nn, F = paddle.nn, paddle.nn.functional
    mesh = _mesh((2, 2), ["dp", "mp"]) if mode == "dp_mp" else _mesh((2,), [mode])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 3, 6, 6], "float32")
        label = paddle.static.data("label", [4, 1], "int64")
        conv1, bn1 = nn.Conv2D(3, 4, 3, padding=1), nn.BatchNorm2D(4)
        conv2, bn2 = nn.Conv2D(4, 4, 3, padding=1), nn.BatchNorm2D(4, momentum=0.8)
        if "dp" in mesh.dim_names:
            autopar.shard_tensor(x, mesh, ["dp", None, None, None])
        if "mp" in mesh.dim_names:
            autopar.shard_tensor(conv1.weight, mesh, ["mp", None, None, None])
            autopar.shard_tensor(conv1.bias, mesh, ["mp"])
        h = F.relu(bn1(conv1(x)))
        h = h + bn2(conv2(h))
        loss = paddle.mean(F.cross_entropy(nn.Linear(4 * 36, 5)(paddle.flatten(h, 1)), label))
        paddle.optimizer.Momentum(0.1).minimize(loss)
    return _compile(SeedProgram(main, startup, {"x": x, "label": label}, loss), mesh)


def _linear_adam() -> Built:
    import autopar

    seed = linear_net()
    mesh = _mesh((2,), ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return _compile(seed, mesh)


def _pipeline(builder: Callable[[Any], SeedProgram], shape: tuple[int, ...], names: list[str], micro_batches: int, schedule: str) -> Built:
    import autopar

    mesh = _mesh(shape, names)
    seed = builder(mesh)
    return _compile(seed, mesh, pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))


CONFIGS: dict[str, Callable[[], Built]] = {
    "simple dp2": lambda: _simple("dp"),
    "simple mp2": lambda: _simple("mp"),
    "simple dp2xmp2": lambda: _simple("dp_mp"),
    "linear_net dp2 adam": _linear_adam,
    "alexnet dp2": _alexnet,
    "alexnet dp2xmp2": lambda: _alexnet(classifier_mp=True),
    "conv bn dp2": lambda: _conv_bn("dp"),
    "conv bn mp2": lambda: _conv_bn("mp"),
    "conv bn dp2xmp2": lambda: _conv_bn("dp_mp"),
    "gpt mp2": lambda: _gpt((2,), ["mp"]),
    "gpt dp2 dropout": lambda: _gpt((2,), ["dp"], dropout=0.1),
    "gpt dp2xmp2": lambda: _gpt((2, 2), ["dp", "mp"]),
    "gpt mp2 sequence parallel": lambda: _gpt((2,), ["mp"], sequence_parallel=True),
    "gpt mp2 recompute": lambda: _gpt((2,), ["mp"], recompute=True),
    "gpt mp2 vocab parallel": lambda: _gpt((2,), ["mp"], vocab_parallel=True),
    "gpt dp2 zero1": lambda: _gpt((2,), ["dp"], zero_stage=1),
    "gpt dp2 zero2": lambda: _gpt((2,), ["dp"], zero_stage=2),
    "gpt dp2 zero3": lambda: _gpt((2,), ["dp"], zero_stage=3),
    "mlp pp2 1F1B": lambda: _pipeline(lambda m: staged_mlp(m), (2,), ["pp"], 2, "1F1B"),
    "mlp pp2 interleaved": lambda: _pipeline(lambda m: staged_mlp(m, widths=(16, 16, 16, 16, 10), placement=(0, 1, 0, 1)), (2,), ["pp"], 2, "Interleaved1F1B"),
    "tied lm pp2 ZBH1": lambda: _pipeline(lambda m: tied_lm(m, (0, 1, 1), seed=3), (2,), ["pp"], 4, "ZBH1"),
    "residual pp2xmp2 FThenB": lambda: _pipeline(lambda m: residual_blocks(m, tensor_parallel="mp"), (2, 2), ["pp", "mp"], 2, "FThenB"),
}  # fmt: skip


def build(name: str) -> Built:
    """The seed program and DistributedProgram of the configuration ``name``."""
    return CONFIGS[name]()


def feeds(seed: SeedProgram, steps: int, rng_seed: int = 0) -> list[dict[str, Any]]:
    """Random feeds for any configuration here (integer feeds below 5: a valid label or token
    id of every model)."""
    from autopar.testing.serial import random_feeds

    return random_feeds(seed.feeds, steps, seed=rng_seed, classes=5)
