"""A mixture-of-experts decoder in the DeepSeek-MoE shape: pre-norm blocks of causal attention
and an MoE feed-forward with one shared expert beside ``n_experts`` routed ones, each token sent
to its top-2 routed experts. The router is GShard's top-2 gating with a static capacity as
fairscale's ``top2gate.py`` writes it (and DeepSpeed's ``sharded_moe.py`` after it): softmax
gates; the first expert from ``topk``, the second from the gates with the first masked out;
each token's slot in its expert from a ``cumsum`` over the tokens of its one-hot choice; tokens
past the capacity dropped; the auxiliary load-balancing loss ``mean(me * ce) * E * E``; dispatch
and combine as ``einsum`` over a ``[tokens, experts, capacity]`` tensor, the experts applied to
the ``[experts, capacity, hidden]`` buffer with stacked weights. No gating noise (a
deterministic router: serial and distributed runs route the same tokens). Static Paddle, layers
nested as the reference nests them (``Transformer/Block_k/MoE/Router``).

Annotated as a Paddle semi-auto user annotates stacked experts (GSPMD's formulation), by the
mesh's dim names: ``dp`` splits the tokens' batch; ``ep`` splits the stacked experts' weights
by expert (dim 0) and, like ``dp``, the batch — each expert-parallel rank routes its own tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.zoo.placements import annotate, whole


@dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4  # routed experts (the shared one is beside them)
    expert_hidden: int = 32
    capacity_factor: float = 1.0  # GShard's: capacity = ceil(2 * tokens / experts * factor)
    aux_loss_weight: float = 0.01


INPUTS, LABELS = ("tokens",), ("labels",)


def capacity(config: Config, tokens: int) -> int:
    """Slots per expert for ``tokens`` routed tokens (top-2: each token takes two)."""
    return math.ceil(2 * tokens / config.n_experts * config.capacity_factor)


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None,
    optimizer: str = "sgd", seed: int | None = 17,
) -> SeedProgram:  # fmt: skip
    """The training program: next-token cross-entropy plus the routers' auxiliary losses,
    annotated for ``mesh`` (None: serial)."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        tokens = paddle.static.data("tokens", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        model = network(config)
        if mesh is not None:
            _annotate(model, tokens, labels, mesh)
        logits, aux = model(tokens)
        loss = compute_loss(config, logits, aux, labels)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"tokens": tokens, "labels": labels}, loss, {"model": model})


def network(config: Config = Config()) -> Any:
    """The model (a ``paddle.nn.Layer``); its forward returns the logits and the summed
    auxiliary loss of its routers."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    head_dim = config.dim // config.n_heads
    E = config.n_experts

    class Attention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(config.dim, 3 * config.dim)
            self.proj = nn.Linear(config.dim, config.dim)

        def forward(self, x: Any, mask: Any) -> Any:
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(3, axis=2)
            q, k, v = (t.reshape([B, T, config.n_heads, head_dim]).transpose([0, 2, 1, 3]) for t in (q, k, v))
            att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask
            y = paddle.matmul(F.softmax(att, axis=-1), v)
            return self.proj(y.transpose([0, 2, 1, 3]).reshape([B, T, C]))

    class Router(nn.Layer):
        """GShard top-2 gating (fairscale top2gate): combine weights ``[S, E, C]``, the dispatch
        mask, and the auxiliary loss."""

        def __init__(self) -> None:
            super().__init__()
            self.wg = nn.Linear(config.dim, E, bias_attr=False)

        def forward(self, x: Any) -> tuple[Any, Any, Any]:
            S = x.shape[0]
            C = capacity(config, S)
            gates = F.softmax(self.wg(x), axis=-1)  # [S, E]
            _, first = paddle.topk(gates, k=1, axis=-1)
            mask1 = F.one_hot(first.reshape([-1]), E)  # [S, E]
            _, second = paddle.topk(
                paddle.where(mask1 > 0, paddle.full_like(gates, float("-inf")), gates), k=1, axis=-1
            )
            mask2 = F.one_hot(second.reshape([-1]), E)
            locations1 = paddle.cumsum(mask1, axis=0) - 1  # each token's slot in its first expert
            locations2 = paddle.cumsum(mask2, axis=0) - 1 + mask1.sum(axis=0, keepdim=True)
            me, ce = gates.mean(axis=0), mask1.mean(axis=0)
            aux = (me * ce).mean() * E * E  # load balancing: fraction routed x mean gate, per expert
            mask1 = mask1 * (locations1 < C).astype("float32")  # tokens past the capacity dropped
            mask2 = mask2 * (locations2 < C).astype("float32")
            slot1 = (locations1 * mask1).sum(axis=1).astype("int64")
            slot2 = (locations2 * mask2).sum(axis=1).astype("int64")
            gate1, gate2 = (gates * mask1).sum(axis=1), (gates * mask2).sum(axis=1)
            denom = paddle.clip(gate1 + gate2, min=1e-9)
            gate1, gate2 = gate1 / denom, gate2 / denom
            combine = paddle.einsum("se,sc->sec", gate1.unsqueeze(1) * mask1, F.one_hot(slot1, C)) + paddle.einsum(
                "se,sc->sec", gate2.unsqueeze(1) * mask2, F.one_hot(slot2, C)
            )
            dispatch = (combine > 0).astype("float32")
            return combine, dispatch, aux

    class MoE(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.router = Router()
            init = nn.initializer.Normal(std=0.02)
            self.w_in = self.create_parameter([E, config.dim, config.expert_hidden], default_initializer=init)
            self.w_out = self.create_parameter([E, config.expert_hidden, config.dim], default_initializer=init)
            self.shared_in = nn.Linear(config.dim, config.expert_hidden)
            self.shared_out = nn.Linear(config.expert_hidden, config.dim)

        def forward(self, x: Any) -> tuple[Any, Any]:
            B, T, C = x.shape
            flat = x.reshape([B * T, C])
            combine, dispatch, aux = self.router(flat)
            buffer = paddle.einsum("sec,sm->ecm", dispatch, flat)  # [experts, capacity, dim]
            hidden = F.gelu(paddle.einsum("ecm,emh->ech", buffer, self.w_in))
            out = paddle.einsum("ech,ehm->ecm", hidden, self.w_out)
            routed = paddle.einsum("sec,ecm->sm", combine, out)
            shared = self.shared_out(F.gelu(self.shared_in(flat)))
            return (routed + shared).reshape([B, T, C]), aux

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(config.dim), Attention()
            self.ln_2, self.moe = nn.LayerNorm(config.dim), MoE()

        def forward(self, x: Any, mask: Any) -> tuple[Any, Any]:
            x = x + self.attn(self.ln_1(x), mask)
            moe, aux = self.moe(self.ln_2(x))
            return x + moe, aux

    class Transformer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.LayerList([Block() for _ in range(config.n_layers)])
            self.norm = nn.LayerNorm(config.dim)
            self.head = nn.Linear(config.dim, config.vocab_size, bias_attr=False)

        def forward(self, tokens: Any) -> tuple[Any, Any]:
            T = tokens.shape[1]
            mask = paddle.triu(paddle.full([T, T], float("-inf"), "float32"), diagonal=1)
            h, aux = self.embed(tokens), None
            for layer in self.layers:
                h, layer_aux = layer(h, mask)
                aux = layer_aux if aux is None else aux + layer_aux
            return self.head(self.norm(h)), aux

    return Transformer()


def compute_loss(config: Config, logits: Any, aux: Any, labels: Any) -> Any:
    """Next-token cross-entropy averaged over the tokens, plus the weighted auxiliary loss."""
    import paddle

    ce = paddle.nn.functional.cross_entropy(logits.reshape([-1, config.vocab_size]), labels.reshape([-1, 1])).mean()
    return ce + config.aux_loss_weight * aux


def _annotate(model: Any, tokens: Any, labels: Any, mesh: autopar.ProcessMesh) -> None:
    splits = {name: 0 for name in ("dp", "ep") if name in mesh.dim_names}
    annotate(tokens, mesh, **splits)
    annotate(labels, mesh, **splits)
    whole(model.embed, mesh)
    for layer in model.layers:
        for part in (layer.attn, layer.ln_1, layer.ln_2, layer.moe.router, layer.moe.shared_in, layer.moe.shared_out):
            whole(part, mesh)
        annotate(layer.moe.w_in, mesh, ep=0)  # stacked experts split by expert
        annotate(layer.moe.w_out, mesh, ep=0)
    whole(model.norm, mesh)
    whole(model.head, mesh)


def feeds(config: Config, batch: int, seq: int, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Token ids and next-token labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        {
            "tokens": rng.integers(0, config.vocab_size, (batch, seq)),
            "labels": rng.integers(0, config.vocab_size, (batch, seq)),
        }
        for _ in range(steps)
    ]
