"""A Llama-style decoder, after Meta's reference ``llama/model.py`` (RMSNorm, rotary position
tables built in the graph, grouped-query attention with ``repeat_kv``, SwiGLU feed-forward, a
causal mask from ``triu(full(-inf))``), with the rotate-half rotary spelling of Hugging Face's
port (no complex tensors on Paddle's CPU build). Static Paddle, layers nested as the reference
nests them (``Transformer/TransformerBlock_k/Attention``).

Annotated as a Paddle semi-auto user annotates it, by the mesh's dim names: ``dp`` splits the
tokens' batch; ``mp`` splits wq / wk / wv and w1 / w3 by columns and wo / w2 by rows (heads and
the feed-forward's hidden dim per rank); ``pp`` puts consecutive blocks on ``mesh[i]`` (the
embedding with the first, the norm and output head with the last) and reshards the hidden
state onto the next stage's mesh.
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
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    multiple_of: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


INPUTS, LABELS = ("tokens",), ("labels",)  # the feeds the model and the loss take, in order


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None, virtual: int = 1,
    optimizer: str = "sgd", seed: int | None = 11,
) -> SeedProgram:  # fmt: skip
    """The training program (next-token cross-entropy), annotated for ``mesh`` (None: serial)."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    stages = Stages(mesh, config.n_layers, virtual)
    with paddle.static.program_guard(main, startup):
        tokens = paddle.static.data("tokens", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        model = network(config, stages)
        if mesh is not None:
            _annotate(model, tokens, labels, stages)
        loss = compute_loss(config, model(tokens), labels)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"tokens": tokens, "labels": labels}, loss, {"model": model})


def network(config: Config = Config(), stages: Stages | None = None) -> Any:
    """The model, a ``paddle.nn.Layer`` made in the mode Paddle is in: static inside
    :func:`build`'s program guard, dynamic for Paddle's own semi-auto engine
    (``benchmarks/bench_vs_paddle.py``). ``stages``: the pipeline stage of each block (None: one mesh)."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    head_dim = config.dim // config.n_heads
    stages = stages if stages is not None else Stages(None, config.n_layers)

    class RMSNorm(nn.Layer):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.eps = eps
            self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

        def forward(self, x: Any) -> Any:
            return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rotary_tables(length: int) -> tuple[Any, Any]:
        freqs = 1.0 / (config.rope_theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
        angles = paddle.outer(paddle.arange(length, dtype="float32"), freqs)
        emb = paddle.concat([angles, angles], axis=-1)  # [seq, head_dim]
        return paddle.cos(emb).reshape([1, length, 1, head_dim]), paddle.sin(emb).reshape([1, length, 1, head_dim])

    def rotate_half(x: Any) -> Any:
        return paddle.concat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], axis=-1)

    def repeat_kv(x: Any, n_rep: int) -> Any:
        if n_rep == 1:
            return x
        bs, slen, n_kv, hd = x.shape
        return x.unsqueeze(3).expand([bs, slen, n_kv, n_rep, hd]).reshape([bs, slen, n_kv * n_rep, hd])

    class Attention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(config.dim, config.n_heads * head_dim, bias_attr=False)
            self.wk = nn.Linear(config.dim, config.n_kv_heads * head_dim, bias_attr=False)
            self.wv = nn.Linear(config.dim, config.n_kv_heads * head_dim, bias_attr=False)
            self.wo = nn.Linear(config.n_heads * head_dim, config.dim, bias_attr=False)

        def forward(self, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
            bsz, seqlen, _ = x.shape
            q = self.wq(x).reshape([bsz, seqlen, -1, head_dim])
            k = self.wk(x).reshape([bsz, seqlen, -1, head_dim])
            v = self.wv(x).reshape([bsz, seqlen, -1, head_dim])
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            n_rep = config.n_heads // config.n_kv_heads
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
            scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask
            out = paddle.matmul(F.softmax(scores, axis=-1), v).transpose([0, 2, 1, 3])
            return self.wo(out.reshape([bsz, seqlen, -1]))

    class FeedForward(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            hidden = int(2 * 4 * config.dim / 3)
            hidden = config.multiple_of * ((hidden + config.multiple_of - 1) // config.multiple_of)
            self.w1 = nn.Linear(config.dim, hidden, bias_attr=False)
            self.w2 = nn.Linear(hidden, config.dim, bias_attr=False)
            self.w3 = nn.Linear(config.dim, hidden, bias_attr=False)

        def forward(self, x: Any) -> Any:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class TransformerBlock(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.feed_forward = Attention(), FeedForward()
            self.attention_norm = RMSNorm(config.dim, config.norm_eps)
            self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

        def forward(self, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
            h = x + self.attention(self.attention_norm(x), cos, sin, mask)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.LayerList([TransformerBlock() for _ in range(config.n_layers)])
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias_attr=False)

        def forward(self, tokens: Any) -> Any:
            seqlen = tokens.shape[1]
            h = self.tok_embeddings(tokens)
            cos, sin = rotary_tables(seqlen)
            mask = paddle.triu(paddle.full([seqlen, seqlen], float("-inf"), "float32"), diagonal=1)
            where = stages.first
            for i, layer in enumerate(self.layers):
                h = stages.moved(h, where, stages.of_layer(i))
                where = stages.of_layer(i)
                h = layer(h, cos, sin, mask)
            return self.output(self.norm(h))

    return Transformer()


def compute_loss(config: Config, logits: Any, labels: Any) -> Any:
    """Next-token cross-entropy, averaged over every token (the model's outputs, then ``LABELS``)."""
    import paddle

    return paddle.nn.functional.cross_entropy(logits.reshape([-1, config.vocab_size]), labels.reshape([-1, 1])).mean()


def _annotate(model: Any, tokens: Any, labels: Any, stages: Stages) -> None:
    annotate(tokens, stages.first, dp=0)
    annotate(labels, stages.last, dp=0)
    whole(model.tok_embeddings, stages.first)
    for i, layer in enumerate(model.layers):
        mesh = stages.of_layer(i)
        for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1, layer.feed_forward.w3):
            column(linear, mesh)
        row(layer.attention.wo, mesh)
        row(layer.feed_forward.w2, mesh)
        whole(layer.attention_norm, mesh)
        whole(layer.ffn_norm, mesh)
    whole(model.norm, stages.last)
    whole(model.output, stages.last)
