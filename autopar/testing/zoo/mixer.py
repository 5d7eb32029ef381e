"""An MLP-Mixer, after Tolstikhin et al.'s reference (google-research/vision_transformer,
``models_mixer.py``): a patch stem convolution, blocks of a token-mixing MLP (applied across
the patches: the activations transposed to ``[batch, channels, patches]`` and back) and a
channel-mixing MLP, each pre-norm with a residual; a final LayerNorm, the mean over patches and
a linear head. Static Paddle, layers nested as the reference nests them
(``MlpMixer/MixerBlock_k/MlpBlock``). Chosen for the zoo because its tensor parallelism splits
an MLP that mixes the *sequence* dim, which no language model does.

Annotated as a Paddle semi-auto user annotates it: ``dp`` splits the images; ``mp`` splits
both MLPs Megatron-style (first Linear by columns, second by rows); ``pp`` puts consecutive
blocks on ``mesh[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.zoo.placements import Stages, annotate, column, row, whole


@dataclass(frozen=True)
class Config:
    img_size: int = 8
    patch_size: int = 2
    in_chans: int = 3
    num_classes: int = 5
    hidden_dim: int = 16
    tokens_mlp_dim: int = 8
    channels_mlp_dim: int = 32
    num_blocks: int = 2


INPUTS, LABELS = ("images",), ("labels",)  # the feeds the model and the loss take, in order


def build(
    config: Config = Config(), batch: int = 4, mesh: autopar.ProcessMesh | None = None, virtual: int = 1,
    optimizer: str = "sgd", seed: int | None = 23, **_: Any,
) -> SeedProgram:  # fmt: skip
    """The training program (cross-entropy), annotated for ``mesh`` (None: serial)."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    stages = Stages(mesh, config.num_blocks, virtual)
    with paddle.static.program_guard(main, startup):
        images = paddle.static.data("images", [batch, config.in_chans, config.img_size, config.img_size], "float32")
        labels = paddle.static.data("labels", [batch, 1], "int64")
        model = network(config, stages)
        if mesh is not None:
            annotate(images, stages.first, dp=0)
            annotate(labels, stages.last, dp=0)
            whole(model.stem, stages.first)
            for i, block in enumerate(model.blocks):
                mesh_i = stages.of_layer(i)
                for mlp in (block.token_mixing, block.channel_mixing):
                    column(mlp.fc1, mesh_i)
                    row(mlp.fc2, mesh_i)
                whole(block.norm1, mesh_i)
                whole(block.norm2, mesh_i)
            whole(model.pre_head_layer_norm, stages.last)
            whole(model.head, stages.last)
        loss = compute_loss(config, model(images), labels)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"images": images, "labels": labels}, loss, {"model": model})


def network(config: Config = Config(), stages: Stages | None = None) -> Any:
    """The model, a ``paddle.nn.Layer`` made in the mode Paddle is in: static inside
    :func:`build`'s program guard, dynamic for Paddle's own semi-auto engine
    (``benchmarks/bench_vs_paddle.py``). ``stages``: the pipeline stage of each block (None: one mesh)."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    stages = stages if stages is not None else Stages(None, config.num_blocks)
    tokens = (config.img_size // config.patch_size) ** 2

    class MlpBlock(nn.Layer):
        def __init__(self, dim: int, mlp_dim: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, dim)

        def forward(self, x: Any) -> Any:
            return self.fc2(F.gelu(self.fc1(x)))

    class MixerBlock(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.token_mixing = nn.LayerNorm(config.hidden_dim), MlpBlock(tokens, config.tokens_mlp_dim)
            self.norm2, self.channel_mixing = nn.LayerNorm(config.hidden_dim), MlpBlock(config.hidden_dim, config.channels_mlp_dim)

        def forward(self, x: Any) -> Any:
            y = self.norm1(x).transpose([0, 2, 1])
            x = x + self.token_mixing(y).transpose([0, 2, 1])
            return x + self.channel_mixing(self.norm2(x))

    class MlpMixer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2D(config.in_chans, config.hidden_dim, config.patch_size, stride=config.patch_size)
            self.blocks = nn.LayerList([MixerBlock() for _ in range(config.num_blocks)])
            self.pre_head_layer_norm = nn.LayerNorm(config.hidden_dim)
            self.head = nn.Linear(config.hidden_dim, config.num_classes)

        def forward(self, x: Any) -> Any:
            x = self.stem(x).flatten(2).transpose([0, 2, 1])  # [batch, tokens, hidden]
            where = stages.first
            for i, block in enumerate(self.blocks):
                x = stages.moved(x, where, stages.of_layer(i))
                where = stages.of_layer(i)
                x = block(x)
            return self.head(self.pre_head_layer_norm(x).mean(axis=1))

    return MlpMixer()


def compute_loss(config: Config, logits: Any, labels: Any) -> Any:
    """Cross-entropy of the class logits (the model's outputs, then ``LABELS``)."""
    import paddle

    return paddle.nn.functional.cross_entropy(logits, labels).mean()
