"""A Vision Transformer, after the original ViT (Dosovitskiy et al.) as timm's
``VisionTransformer`` writes it: a patch embedding convolution (kernel = stride = patch), a
class token expanded to the batch read at run time (``paddle.shape(x)[0]``) and concatenated
with the patch tokens, a learned position embedding, pre-norm blocks with a fused ``qkv``
projection laid out ``[3, heads, head_dim]`` (``reshape`` + ``transpose`` + ``unbind``), GELU
MLP, a final norm and a classifier on the class token; ``Config.dropout`` > 0 trains with
dropout where timm applies it (after the position embedding is added, on the attention
probabilities and after its projection, after the MLP's activation and its second linear).
Static Paddle, layers nested as timm
nests them (``VisionTransformer/Block_k/Attention``).

Annotated as a Paddle semi-auto user annotates it: ``dp`` splits the images and labels; ``mp``
splits ``qkv`` and ``fc1`` by columns and ``proj`` and ``fc2`` by rows (the ``[3, heads,
head_dim]`` layout does not line up with a column split: the qkv output is gathered before the
heads are taken apart — correct, not tensor parallel inside attention); ``pp`` puts consecutive
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
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 5
    embed_dim: int = 16
    depth: int = 2
    num_heads: int = 2
    mlp_ratio: float = 2.0
    dropout: float = 0.0  # training dropout (timm's drop_rate and attn_drop_rate alike), where timm applies it


INPUTS, LABELS = ("images",), ("labels",)  # the feeds the model and the loss take, in order


def build(
    config: Config = Config(), batch: int = 4, mesh: autopar.ProcessMesh | None = None, virtual: int = 1,
    optimizer: str = "sgd", seed: int | None = 17, **_: Any,
) -> SeedProgram:  # fmt: skip
    """The training program (cross-entropy of the class token's logits), annotated for
    ``mesh`` (None: serial)."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    stages = Stages(mesh, config.depth, virtual)
    with paddle.static.program_guard(main, startup):
        images = paddle.static.data("images", [batch, config.in_chans, config.img_size, config.img_size], "float32")
        labels = paddle.static.data("labels", [batch, 1], "int64")
        model = network(config, stages)
        if mesh is not None:
            annotate(images, stages.first, dp=0)
            annotate(labels, stages.last, dp=0)
            for name in ("cls_token", "pos_embed"):
                annotate(getattr(model, name), stages.first)
            whole(model.patch_embed, stages.first)
            for i, block in enumerate(model.blocks):
                mesh_i = stages.of_layer(i)
                column(block.attn.qkv, mesh_i)
                row(block.attn.proj, mesh_i)
                column(block.mlp.fc1, mesh_i)
                row(block.mlp.fc2, mesh_i)
                whole(block.norm1, mesh_i)
                whole(block.norm2, mesh_i)
            whole(model.norm, stages.last)
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
    stages = stages if stages is not None else Stages(None, config.depth)
    dim, heads = config.embed_dim, config.num_heads
    head_dim = dim // heads
    patches = (config.img_size // config.patch_size) ** 2

    def drop(x: Any) -> Any:  # (no op at all when 0: programs without dropout stay as they were)
        return F.dropout(x, config.dropout, training=True) if config.dropout else x

    class Attention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x: Any) -> Any:
            B, N, C = x.shape
            qkv = self.qkv(x).reshape([B, N, 3, heads, head_dim]).transpose([2, 0, 3, 1, 4])
            q, k, v = qkv.unbind(0)
            attn = drop(F.softmax(paddle.matmul(q, k, transpose_y=True) * head_dim**-0.5, axis=-1))
            return drop(self.proj(paddle.matmul(attn, v).transpose([0, 2, 1, 3]).reshape([B, N, C])))

    class Mlp(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            hidden = int(dim * config.mlp_ratio)
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

        def forward(self, x: Any) -> Any:
            return drop(self.fc2(drop(F.gelu(self.fc1(x)))))

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(dim, epsilon=1e-6), Attention()
            self.norm2, self.mlp = nn.LayerNorm(dim, epsilon=1e-6), Mlp()

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class VisionTransformer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.patch_embed = nn.Conv2D(config.in_chans, dim, config.patch_size, stride=config.patch_size)
            self.cls_token = self.create_parameter([1, 1, dim], default_initializer=nn.initializer.TruncatedNormal(std=0.02))
            self.pos_embed = self.create_parameter([1, patches + 1, dim], default_initializer=nn.initializer.TruncatedNormal(std=0.02))
            self.blocks = nn.LayerList([Block() for _ in range(config.depth)])
            self.norm, self.head = nn.LayerNorm(dim, epsilon=1e-6), nn.Linear(dim, config.num_classes)

        def forward(self, x: Any) -> Any:
            B = paddle.shape(x)[0]
            x = self.patch_embed(x).flatten(2).transpose([0, 2, 1])
            x = drop(paddle.concat([self.cls_token.expand((B, -1, -1)), x], axis=1) + self.pos_embed)
            where = stages.first
            for i, block in enumerate(self.blocks):
                x = stages.moved(x, where, stages.of_layer(i))
                where = stages.of_layer(i)
                x = block(x)
            return self.head(self.norm(x)[:, 0])

    return VisionTransformer()


def compute_loss(config: Config, logits: Any, labels: Any) -> Any:
    """Cross-entropy of the class logits (the model's outputs, then ``LABELS``)."""
    import paddle

    return paddle.nn.functional.cross_entropy(logits, labels).mean()
