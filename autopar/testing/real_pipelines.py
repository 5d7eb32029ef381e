"""A small decoder written the way public models for Paddle's semi-auto API write it, with the
constructs a pipeline of a real model meets (issue 35), each switchable so that a test can
build exactly the form it checks:

- ``mask="scalars"``: the causal mask as Llama's ``_make_causal_mask`` / GPT's writes it,
  ``paddle.where(causal, 0.0, paddle.finfo(dtype).min)`` (each scalar a ``full`` filled in
  place); ``mask="tensors"``: ``where(causal, zeros, full(min))``.
- ``padding``: the mask also hides padding tokens, so it is made from the ids (on the first
  stage, where the ids live).
- ``mask_on_mesh``: the mask annotated on the whole mesh, ``shard_tensor(mask, mesh,
  [Replicate()] * mesh.ndim)`` (Paddle's meaning: on every stage that reads it).
- ``criterion``: ``"masked_select"`` (``mean(masked_select(loss, labels != ignore))``, the
  Llama / GPT pretraining criterion), ``"positive"`` (the same with ``mask = loss > 0``), or
  ``"sum_count"`` (``sum(loss * valid) / sum(valid)``).
- ``cls_token``: a ViT-style class token prepended in the model's own forward, outside any
  layer (``cls_token.expand((paddle.shape(x)[0], -1, -1))``), from an unannotated parameter.
- ``dead_statistic``: a router-style statistic over the whole batch, computed in a layer and never
  read (kept, it would need the whole batch in every micro-batch).
- ``clip``: ``ClipGradByGlobalNorm(clip)`` on the optimizer.

Annotated the Paddle way on a mesh with a ``pp`` dim: layer ``i``'s parameters on
``mesh[stage]``, the residual stream ``autopar.reshard``-ed to the next stage; ``staged=False``
leaves the layers unannotated (for ``PipelineConfig(stages=n)``), keeping the reshards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.testing.models import SeedProgram, _static
from autopar.testing.zoo.placements import Stages, annotate, column, row, whole

IGNORE, PAD = -100, 0


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    hidden: int = 16
    heads: int = 2
    layers: int = 2
    mask: str = "scalars"  # "scalars" | "tensors"
    mask_on_mesh: bool = False
    padding: bool = False  # the mask also hides padding tokens (id 0): made from the ids
    criterion: str = "masked_select"  # "masked_select" | "positive" | "sum_count"
    cls_token: bool = False
    dead_statistic: bool = False
    clip: float | None = None
    lr: float = 0.1
    random_seed: int | None = 11


def build(
    config: Config = Config(), batch: int = 4, seq: int = 6, mesh: Any = None, staged: bool = True
) -> SeedProgram:
    """The training program; annotated for ``mesh`` (None: serial). ``staged=False``: the
    layers are left unannotated (the stage cut is ``PipelineConfig(stages=n)``'s)."""
    import paddle

    import autopar

    paddle_, main, startup = _static()
    if config.random_seed is not None:
        main.random_seed = startup.random_seed = config.random_seed
    nn, F = paddle.nn, paddle.nn.functional
    head_dim = config.hidden // config.heads
    stages = Stages(mesh if staged else None, config.layers)
    boundaries = Stages(mesh, config.layers)  # where the residual stream is resharded

    class Attention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
            self.out = nn.Linear(config.hidden, config.hidden)

        def forward(self, x: Any, mask: Any) -> Any:
            b, s, _ = x.shape  # (Llama's `bsz, q_len, _ = hidden_states.shape`)
            q, k, v = self.qkv(x).reshape([b, s, 3, config.heads, head_dim]).transpose([2, 0, 3, 1, 4]).unbind(0)
            scores = paddle.matmul(q, k, transpose_y=True) / float(np.sqrt(head_dim)) + mask
            y = paddle.matmul(F.softmax(scores, axis=-1), v)
            return self.out(y.transpose([0, 2, 1, 3]).reshape([b, s, config.hidden]))

    class Layer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(config.hidden), Attention()
            self.norm2 = nn.LayerNorm(config.hidden)
            self.up, self.down = (
                nn.Linear(config.hidden, 2 * config.hidden),
                nn.Linear(2 * config.hidden, config.hidden),
            )

        def forward(self, x: Any, mask: Any) -> Any:
            x = x + self.attn(self.norm1(x), mask)
            h = F.gelu(self.up(self.norm2(x)))
            if config.dead_statistic:  # a router statistic nobody reads
                self.load = paddle.mean(paddle.max(F.softmax(h, axis=-1), axis=0))  # (over the batch)
            return x + self.down(h)

    class Decoder(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(config.vocab, config.hidden)
            if config.cls_token:
                self.cls_token = self.create_parameter(
                    [1, 1, config.hidden], default_initializer=nn.initializer.Normal(std=0.02)
                )
            self.layers = nn.LayerList([Layer() for _ in range(config.layers)])
            self.norm = nn.LayerNorm(config.hidden)
            self.head = nn.Linear(config.hidden, config.vocab, bias_attr=False)

        def forward(self, ids: Any) -> Any:
            x = self.embed(ids)
            if config.cls_token:  # glue in the model's own forward, in no layer
                x = paddle.concat([self.cls_token.expand((paddle.shape(x)[0], -1, -1)), x[:, 1:]], axis=1)
            mask = causal_mask(ids.shape[1], x.dtype, config.mask)
            if config.padding:  # and no attention to padding tokens: made from the ids, on the first stage
                keep = (ids != PAD).astype(x.dtype).reshape([ids.shape[0], 1, 1, ids.shape[1]])
                mask = mask + (1.0 - keep) * paddle.finfo(x.dtype).min
            if config.mask_on_mesh and mesh is not None:
                mask = autopar.shard_tensor(mask, mesh, [autopar.Replicate()] * len(mesh.shape))
            where = boundaries.first
            for i, layer in enumerate(self.layers):
                x = boundaries.moved(x, where, boundaries.of_layer(i))
                where = boundaries.of_layer(i)
                x = layer(x, mask)
            return self.head(self.norm(x))

    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        model = Decoder()
        if mesh is not None:
            _annotate(model, ids, labels, stages, mesh)
        loss = criterion(model(ids), labels, config.criterion)
        clip = None if config.clip is None else nn.ClipGradByGlobalNorm(config.clip)
        paddle.optimizer.SGD(config.lr, grad_clip=clip).minimize(loss)
    del paddle_
    return SeedProgram(main, startup, {"ids": ids, "labels": labels}, loss, {"model": model})


def causal_mask(seq: Any, dtype: Any, form: str) -> Any:
    """``[1, 1, seq, seq]``: 0 where a position may attend, the dtype's minimum elsewhere."""
    import paddle

    causal = paddle.tril(paddle.ones([seq, seq], dtype="bool")).reshape([1, 1, seq, seq])
    if form == "scalars":
        return paddle.where(causal, 0.0, paddle.finfo(dtype).min)
    zeros = paddle.zeros([1, 1, seq, seq], dtype)
    return paddle.where(causal, zeros, paddle.full([1, 1, seq, seq], paddle.finfo(dtype).min, dtype))


def criterion(logits: Any, labels: Any, form: str) -> Any:
    """The mean token loss over the valid labels, written as ``form`` says."""
    import paddle

    loss = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=IGNORE, reduction="none")
    if form == "masked_select":
        mask = labels.unsqueeze(-1) != IGNORE
        return paddle.mean(paddle.masked_select(loss, mask))
    if form == "positive":
        return paddle.mean(paddle.masked_select(loss, loss > 0))
    valid = (labels.unsqueeze(-1) != IGNORE).astype("float32")
    return paddle.sum(loss * valid) / paddle.sum(valid)


def _annotate(model: Any, ids: Any, labels: Any, stages: Stages, mesh: Any) -> None:
    first, last = stages.first or mesh, stages.last or mesh
    annotate(ids, first, dp=0)
    annotate(labels, last, dp=0)
    if stages.count:  # layers placed on their stages (Paddle's way); else left to the cut
        whole(model.embed, first)
        for i, layer in enumerate(model.layers):
            where = stages.of_layer(i)
            column(layer.attn.qkv, where)
            row(layer.attn.out, where)
            column(layer.up, where)
            row(layer.down, where)
            whole(layer.norm1, where)
            whole(layer.norm2, where)
        whole(model.norm, last)
        whole(model.head, last)


def feeds(config: Config, batch: int, seq: int, steps: int, seed: int = 0, uneven: bool = True) -> list[dict[str, Any]]:
    """Token ids and labels; ``uneven``: ignored labels concentrated in the first rows (row r
    has about r/batch of its labels valid), so that a mean of micro-batch means differs from
    the mean over every valid token."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        labels = rng.integers(0, config.vocab, (batch, seq))
        if uneven:
            for r in range(batch):
                labels[r, rng.random(seq) > (r + 1) / batch] = IGNORE
            labels[0, 0] = rng.integers(0, config.vocab)  # (every row keeps one valid label)
        out.append({"ids": rng.integers(0, config.vocab, (batch, seq)), "labels": labels})
    return out
