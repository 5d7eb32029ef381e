"""A GPT-2-style decoder, after OpenAI's GPT-2 as nanoGPT's ``model.py`` writes it: learned
position embeddings, pre-norm blocks (``ln_1``, fused ``c_attn`` q/k/v projection split three
ways, ``c_proj``; ``ln_2``, ``c_fc`` + GELU + ``c_proj``), a causal mask from a ``tril(ones)``
buffer applied with ``masked_fill``-style ``where``, the LM head tied to the token embedding
(``logits = h @ wte.T``), and the loss averaged over the tokens whose label is not ignored
(``ignore_index=-100``); ``Config.dropout`` > 0 trains with dropout where nanoGPT applies it
(after the embeddings, on the attention probabilities, after each residual projection). Static
Paddle, layers nested as the reference nests them.

Annotated as a Paddle semi-auto user annotates it: ``dp`` splits the batch; ``mp`` splits the
token embedding by vocabulary rows (the tied head's logits then come split by vocabulary: a
vocabulary-parallel cross-entropy), ``c_attn`` / ``c_fc`` by columns and the ``c_proj``s by
rows; ``pp`` puts consecutive blocks on ``mesh[i]`` — the embeddings with the first, the final
norm with the last; the tied weight is then read on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.zoo.placements import Stages, annotate, column, row, whole


@dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0  # training dropout (nanoGPT's places: embeddings, attention probs, residual projections)


IGNORE = -100
INPUTS, LABELS = ("idx",), ("targets",)  # the feeds the model and the loss take, in order


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None, virtual: int = 1,
    optimizer: str = "sgd", seed: int | None = 13,
) -> SeedProgram:  # fmt: skip
    """The training program (next-token cross-entropy over the labels that are not -100),
    annotated for ``mesh`` (None: serial)."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    stages = Stages(mesh, config.n_layer, virtual)
    with paddle.static.program_guard(main, startup):
        idx = paddle.static.data("idx", [batch, seq], "int64")
        targets = paddle.static.data("targets", [batch, seq], "int64")
        model = network(config, stages)
        if mesh is not None:
            _annotate(model, idx, targets, stages)
        loss = compute_loss(config, model(idx), targets)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"idx": idx, "targets": targets}, loss, {"model": model})


def network(config: Config = Config(), stages: Stages | None = None) -> Any:
    """The model, a ``paddle.nn.Layer`` made in the mode Paddle is in: static inside
    :func:`build`'s program guard, dynamic for Paddle's own semi-auto engine
    (``benchmarks/bench_vs_paddle.py``). ``stages``: the pipeline stage of each block (None: one mesh)."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    stages = stages if stages is not None else Stages(None, config.n_layer)
    head_dim = config.n_embd // config.n_head

    def drop(x: Any) -> Any:  # (no op at all when 0: programs without dropout stay as they were)
        return F.dropout(x, config.dropout, training=True) if config.dropout else x

    class CausalSelfAttention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd)

        def forward(self, x: Any, bias: Any) -> Any:
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(3, axis=2)
            q, k, v = (t.reshape([B, T, config.n_head, head_dim]).transpose([0, 2, 1, 3]) for t in (q, k, v))
            att = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(head_dim))
            att = paddle.where(bias[:, :, :T, :T] == 0, paddle.full_like(att, float("-inf")), att)
            y = paddle.matmul(drop(F.softmax(att, axis=-1)), v)
            return drop(self.c_proj(y.transpose([0, 2, 1, 3]).reshape([B, T, C])))

    class MLP(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

        def forward(self, x: Any) -> Any:
            return drop(self.c_proj(F.gelu(self.c_fc(x), approximate=True)))

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention()
            self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), MLP()

        def forward(self, x: Any, bias: Any) -> Any:
            x = x + self.attn(self.ln_1(x), bias)
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.h = nn.LayerList([Block() for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd)

        def forward(self, idx: Any) -> Any:
            t = idx.shape[1]
            pos = paddle.arange(0, t, dtype="int64")
            bias = paddle.tril(paddle.ones([config.block_size, config.block_size])).reshape(
                [1, 1, config.block_size, config.block_size]
            )
            x = drop(self.wte(idx) + self.wpe(pos))
            where = stages.first
            for i, block in enumerate(self.h):
                x = stages.moved(x, where, stages.of_layer(i))
                where = stages.of_layer(i)
                x = block(x, bias)
            return paddle.matmul(self.ln_f(x), self.wte.weight, transpose_y=True)  # the tied LM head

    return GPT()


def compute_loss(config: Config, logits: Any, targets: Any) -> Any:
    """Next-token cross-entropy over the targets that are not -100 (the model's outputs, then ``LABELS``)."""
    import paddle

    flat = targets.reshape([-1, 1])
    token_loss = paddle.nn.functional.cross_entropy(
        logits.reshape([-1, config.vocab_size]), flat, ignore_index=IGNORE, reduction="none"
    )
    valid = (flat != IGNORE).astype("float32")
    return (token_loss * valid).sum() / valid.sum()  # PyTorch's ignore_index mean: over the valid tokens


def _annotate(model: Any, idx: Any, targets: Any, stages: Stages) -> None:
    annotate(idx, stages.first, dp=0)
    annotate(targets, stages.last, dp=0)
    annotate(model.wte.weight, stages.first, mp=0)  # vocabulary rows
    whole(model.wpe, stages.first)
    for i, block in enumerate(model.h):
        mesh = stages.of_layer(i)
        column(block.attn.c_attn, mesh)
        row(block.attn.c_proj, mesh)
        column(block.mlp.c_fc, mesh)
        row(block.mlp.c_proj, mesh)
        whole(block.ln_1, mesh)
        whole(block.ln_2, mesh)
    whole(model.ln_f, stages.last)


def feeds(config: Config, batch: int, seq: int, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Token ids and targets, about one target in eight ignored (-100)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        targets = rng.integers(0, config.vocab_size, (batch, seq))
        targets[rng.random((batch, seq)) < 0.125] = IGNORE
        out.append({"idx": rng.integers(0, config.vocab_size, (batch, seq)), "targets": targets})
    return out
