"""A BERT-style encoder, after Google's BERT as Hugging Face's ``BertModel`` /
``BertForPreTraining`` write it: word + position (``arange`` expanded to the batch) + token-type
embeddings and a LayerNorm; post-norm encoder layers (separate query / key / value, the
padding mask built from the input ids, ``(1 - mask) * -10000`` added to the scores); a tanh
pooler on the first token; two heads — masked-LM (transform + decoder tied to the word
embeddings, plus a bias) and next-sentence (on the pooled output) — and their summed losses.
Static Paddle, layers nested as the reference nests them (``BertForPreTraining/BertModel/
BertEncoder/BertLayer_k/...``). ``Config.dropout`` > 0 trains with dropout where BERT applies it
(after the embeddings' LayerNorm, on the attention probabilities, on the attention-output and
output dense before their residual LayerNorms); 0 (the default) makes no dropout op.

Annotated as a Paddle semi-auto user annotates it: ``dp`` splits the batch; ``mp`` splits
query / key / value and the intermediate dense by columns, the attention-output and output
dense by rows, and the word embeddings by vocabulary rows (the tied decoder then gives logits
split by vocabulary); ``pp`` puts consecutive layers on ``mesh[i]``, the embeddings with the
first, the pooler and heads with the last.
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
    hidden_size: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 32
    max_position_embeddings: int = 16
    type_vocab_size: int = 2
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-12
    dropout: float = 0.0  # training dropout (hidden and attention probs alike), where BERT applies it


# the feeds the model and the loss take, in order
INPUTS, LABELS = ("input_ids", "token_type_ids"), ("mlm_labels", "nsp_labels")


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None, virtual: int = 1,
    optimizer: str = "sgd", seed: int | None = 19,
) -> SeedProgram:  # fmt: skip
    """The pre-training program (masked-LM + next-sentence losses), annotated for ``mesh``."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    stages = Stages(mesh, config.num_hidden_layers, virtual)
    with paddle.static.program_guard(main, startup):
        input_ids = paddle.static.data("input_ids", [batch, seq], "int64")
        token_type_ids = paddle.static.data("token_type_ids", [batch, seq], "int64")
        mlm_labels = paddle.static.data("mlm_labels", [batch, seq], "int64")
        nsp_labels = paddle.static.data("nsp_labels", [batch, 1], "int64")
        model = network(config, stages)
        if mesh is not None:
            _annotate(model, (input_ids, token_type_ids), (mlm_labels, nsp_labels), stages)
        prediction, relationship = model(input_ids, token_type_ids)
        loss = compute_loss(config, prediction, relationship, mlm_labels, nsp_labels)
        make_optimizer(optimizer).minimize(loss)
    feeds = {"input_ids": input_ids, "token_type_ids": token_type_ids, "mlm_labels": mlm_labels, "nsp_labels": nsp_labels}
    return SeedProgram(main, startup, feeds, loss, {"model": model})


def network(config: Config = Config(), stages: Stages | None = None) -> Any:
    """The model, a ``paddle.nn.Layer`` made in the mode Paddle is in: static inside
    :func:`build`'s program guard, dynamic for Paddle's own semi-auto engine
    (``benchmarks/bench_vs_paddle.py``). ``stages``: the pipeline stage of each layer (None: one mesh)."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    H, heads = config.hidden_size, config.num_attention_heads
    head_dim = H // heads
    stages = stages if stages is not None else Stages(None, config.num_hidden_layers)

    def drop(x: Any) -> Any:  # (no op at all when 0: programs without dropout stay as they were)
        return F.dropout(x, config.dropout, training=True) if config.dropout else x

    class BertEmbeddings(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(config.vocab_size, H)
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, H)
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, H)
            self.LayerNorm = nn.LayerNorm(H, epsilon=config.layer_norm_eps)

        def forward(self, input_ids: Any, token_type_ids: Any) -> Any:
            position_ids = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0).expand(input_ids.shape)
            e = self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
            return drop(self.LayerNorm(e))

    class BertSelfAttention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

        def forward(self, hidden: Any, mask: Any) -> Any:
            B, S, _ = hidden.shape

            def heads_of(t: Any) -> Any:
                return t.reshape([B, S, heads, head_dim]).transpose([0, 2, 1, 3])

            q, k, v = heads_of(self.query(hidden)), heads_of(self.key(hidden)), heads_of(self.value(hidden))
            scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask
            context = paddle.matmul(drop(F.softmax(scores, axis=-1)), v).transpose([0, 2, 1, 3])
            return context.reshape([B, S, H])

    class BertLayer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.attention = BertSelfAttention()
            self.attention_output = nn.Linear(H, H)
            self.attention_norm = nn.LayerNorm(H, epsilon=config.layer_norm_eps)
            self.intermediate = nn.Linear(H, config.intermediate_size)
            self.output = nn.Linear(config.intermediate_size, H)
            self.output_norm = nn.LayerNorm(H, epsilon=config.layer_norm_eps)

        def forward(self, hidden: Any, mask: Any) -> Any:
            attended = self.attention_norm(drop(self.attention_output(self.attention(hidden, mask))) + hidden)
            return self.output_norm(drop(self.output(F.gelu(self.intermediate(attended)))) + attended)

    class BertEncoder(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.LayerList([BertLayer() for _ in range(config.num_hidden_layers)])

        def forward(self, hidden: Any, mask: Any) -> Any:
            where = stages.first
            for i, layer in enumerate(self.layer):
                hidden = stages.moved(hidden, where, stages.of_layer(i))
                where = stages.of_layer(i)
                hidden = layer(hidden, mask)
            return hidden

    class BertModel(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embeddings, self.encoder = BertEmbeddings(), BertEncoder()
            self.pooler = nn.Linear(H, H)

        def forward(self, input_ids: Any, token_type_ids: Any) -> tuple[Any, Any]:
            attention_mask = (input_ids != config.pad_token_id).astype("float32")
            extended = (1.0 - attention_mask.unsqueeze(1).unsqueeze(2)) * -10000.0
            sequence = self.encoder(self.embeddings(input_ids, token_type_ids), extended)
            return sequence, paddle.tanh(self.pooler(sequence[:, 0]))

    class BertForPreTraining(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel()
            self.transform = nn.Linear(H, H)
            self.transform_norm = nn.LayerNorm(H, epsilon=config.layer_norm_eps)
            self.decoder_bias = self.create_parameter([config.vocab_size], is_bias=True)
            self.seq_relationship = nn.Linear(H, 2)

        def forward(self, input_ids: Any, token_type_ids: Any) -> tuple[Any, Any]:
            sequence, pooled = self.bert(input_ids, token_type_ids)
            h = self.transform_norm(F.gelu(self.transform(sequence)))
            word = self.bert.embeddings.word_embeddings.weight
            return paddle.matmul(h, word, transpose_y=True) + self.decoder_bias, self.seq_relationship(pooled)

    return BertForPreTraining()


def compute_loss(config: Config, prediction: Any, relationship: Any, mlm_labels: Any, nsp_labels: Any) -> Any:
    """Masked-LM plus next-sentence cross-entropy (the model's outputs, then ``LABELS``)."""
    import paddle

    F = paddle.nn.functional
    mlm = F.cross_entropy(prediction.reshape([-1, config.vocab_size]), mlm_labels.reshape([-1, 1])).mean()
    return mlm + F.cross_entropy(relationship, nsp_labels).mean()


def _annotate(model: Any, inputs: tuple[Any, ...], labels: tuple[Any, ...], stages: Stages) -> None:
    for feed in inputs:
        annotate(feed, stages.first, dp=0)
    for feed in labels:
        annotate(feed, stages.last, dp=0)
    embeddings = model.bert.embeddings
    annotate(embeddings.word_embeddings.weight, stages.first, mp=0)  # vocabulary rows
    for layer in (embeddings.position_embeddings, embeddings.token_type_embeddings, embeddings.LayerNorm):
        whole(layer, stages.first)
    for i, layer in enumerate(model.bert.encoder.layer):
        mesh = stages.of_layer(i)
        for linear in (layer.attention.query, layer.attention.key, layer.attention.value, layer.intermediate):
            column(linear, mesh)
        row(layer.attention_output, mesh)
        row(layer.output, mesh)
        whole(layer.attention_norm, mesh)
        whole(layer.output_norm, mesh)
    for layer in (model.bert.pooler, model.transform, model.transform_norm, model.seq_relationship):
        whole(layer, stages.last)
    annotate(model.decoder_bias, stages.last, mp=0)


def feeds(config: Config, batch: int, seq: int, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Token ids with a padded tail on some rows, sentence ids, masked-LM and next-sentence labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(1, config.vocab_size, (batch, seq))
        for row_, length in enumerate(rng.integers(seq // 2, seq + 1, batch)):
            ids[row_, length:] = config.pad_token_id
        out.append({
            "input_ids": ids, "token_type_ids": (np.arange(seq) >= seq // 2).astype("int64")[None].repeat(batch, 0),
            "mlm_labels": rng.integers(0, config.vocab_size, (batch, seq)), "nsp_labels": rng.integers(0, 2, (batch, 1)),
        })  # fmt: skip
    return out
