"""A mixture-of-experts decoder in the DeepSeek-MoE shape: pre-norm blocks of causal attention
and an MoE feed-forward with one shared expert beside ``n_experts`` routed ones, each token sent
to its top-k routed experts (``Config.top_k``, 2 by default). The router is GShard's top-2 gating
with a static capacity as fairscale's ``top2gate.py`` writes it (and DeepSpeed's
``sharded_moe.py`` after it), the k-th choice made as the second is: softmax gates; the first
expert from ``topk``, each next one from the gates with the earlier choices masked out; each
token's slot in its expert from a ``cumsum`` over the tokens of its one-hot choice, after the
slots of the earlier choices; tokens past the capacity dropped; the auxiliary load-balancing loss
``mean(me * ce) * E * E``; dispatch and combine as ``einsum`` over a ``[groups, tokens, experts,
capacity]`` tensor (GShard's groups: each routed on its own), the experts applied to the
``[experts, groups, capacity, hidden]`` buffer. No gating noise (a deterministic router: serial
and distributed runs route the same tokens). Static Paddle, layers nested as the reference nests
them (``Transformer/Block_k/MoE/Router``).

Two ways of writing the experts (``build(..., experts=...)``):

- ``"stacked"`` (GSPMD's formulation): annotated by the mesh's dim names, ``dp`` splits the
  tokens' batch; ``ep`` splits the stacked experts' weights by expert (dim 0) and, like ``dp``,
  the batch; ``mp`` splits the attention as Megatron does (q, k, v by columns, the projection
  by rows). The router sees ``Config.router_groups`` groups of the batch's tokens (1: the whole
  batch: its buffer is then summed over the ranks; as many groups as ranks splitting the batch:
  two all_to_alls each way, docs/moe.md). Under a pipeline, a multiple of the micro-batches routes
  per micro-batch (docs/moe.md, "Pipelines: routing per micro-batch").
- ``"local"`` (Paddle's way: an auto-parallel MoE with the gate in a ``LocalLayer`` and the experts
  on ``split_mesh(mesh, "ep")``): the router runs per rank in :func:`autopar.local_map.local_map`
  — each of the ``G`` groups of tokens (one per rank of the token-splitting dims ``dp`` x ``ep``)
  routed on its own, with its own capacity, so the serial reference routes per group too
  (GShard's groups); dispatch and combine are einsums over ``[G, S, E, C]``; expert ``e`` is its
  own two weights placed on the sub-mesh ``split_mesh(mesh, "ep")[e // (E / ep)]``, reading its
  rows of the dispatched buffer through :func:`~autopar.local_map.sub_mesh_tensors` and giving
  them back through :func:`~autopar.local_map.global_mesh_tensor` (Paddle's
  ``moe_sub_mesh_tensors`` / ``moe_global_mesh_tensor``). The auxiliary loss is the groups' mean.
  ``Config.router_groups = q x G`` has each copy route ``q`` groups of its rows, group-major
  (``local_map(..., groups=q)``): under a pipeline of ``m`` micro-batches dividing ``q``, each
  micro-batch routes whole groups (docs/moe.md, "Pipelines: routing per micro-batch").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.zoo.placements import annotate, column, row, whole


@dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4  # routed experts (the shared one is beside them)
    expert_hidden: int = 32
    capacity_factor: float = 1.0  # GShard's: capacity = ceil(top_k * tokens / experts * factor)
    # dropless routing: the worst-case capacity, every token of a group in one expert (capacity =
    # the group's tokens; capacity_factor unused). Nothing is dropped; the padding is sent
    # (explain says the bytes; Strategy(uneven_all_to_all=True) sends only the filled rows)
    dropless: bool = False
    aux_loss_weight: float = 0.01
    top_k: int = 2  # experts each token is sent to
    # stacked experts: the batch's tokens routed in this many groups, each on its own (GShard's
    # groups; 1: the whole batch at once). A multiple of a pipeline's micro-batches routes per
    # micro-batch: each micro-batch holds whole groups (docs/moe.md, "Pipelines"). Local experts:
    # 1 routes one group per copy of the router (dp x ep); a multiple q x copies routes q groups
    # per copy, group-major (autopar.local_map's groups; the per-micro-batch opt-in)
    router_groups: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k is between 1 and n_experts ({self.n_experts}), got {self.top_k}")
        if self.router_groups < 1:
            raise ValueError(f"router_groups is >= 1, got {self.router_groups}")


INPUTS, LABELS = ("tokens",), ("labels",)


def capacity(config: Config, tokens: int) -> int:
    """Slots per expert for ``tokens`` routed tokens (each takes ``top_k``, at most one slot of an
    expert): dropless, all of them (the worst case); else GShard's static capacity."""
    if config.dropless:
        return tokens
    return math.ceil(config.top_k * tokens / config.n_experts * config.capacity_factor)


TOKEN_DIMS = ("dp", "ep")  # the mesh dims that split the tokens (the local router's groups)


def local_copies(mesh: autopar.ProcessMesh) -> int:
    """The local router's copies on ``mesh``: one per rank of its token dims (dp x ep)."""
    return math.prod(mesh.dim_size(n) for n in TOKEN_DIMS if n in mesh.dim_names)


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None,
    optimizer: str = "sgd", seed: int | None = 17, experts: str = "stacked",
) -> SeedProgram:  # fmt: skip
    """The training program: next-token cross-entropy plus the routers' auxiliary losses,
    annotated for ``mesh`` (None: serial; ``experts="local"`` needs a mesh with an ``ep`` dim:
    its groups and sub-meshes are the mesh's)."""
    if experts not in ("stacked", "local"):
        raise ValueError(f"experts is 'stacked' or 'local', got {experts!r}")
    if experts == "local" and (mesh is None or "ep" not in mesh.dim_names):
        raise ValueError("experts='local' places the experts on the sub-meshes of the mesh's 'ep' dim: give a mesh with one")
    if experts == "local" and config.n_experts % mesh.dim_size("ep"):
        raise ValueError(f"experts='local' places n_experts / ep experts on each ep rank: {config.n_experts} experts do not divide over ep={mesh.dim_size('ep')}")
    if experts == "local" and config.router_groups != 1 and config.router_groups % local_copies(mesh):
        raise ValueError(
            f"experts='local' routes per group of the mesh's token dims (dp x ep: {local_copies(mesh)} copies); router_groups is 1 "
            f"(one group a copy) or a multiple of them, got {config.router_groups}"
        )
    if (batch * seq) % config.router_groups:
        raise ValueError(f"router_groups ({config.router_groups}) does not divide the batch's {batch * seq} tokens")
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        tokens = paddle.static.data("tokens", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        model = network(config, mesh if experts == "local" else None)
        if mesh is not None:
            _annotate(model, tokens, labels, mesh)
        logits, aux = model(tokens)
        loss = compute_loss(config, logits, aux, labels)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"tokens": tokens, "labels": labels}, loss, {"model": model})


def network(config: Config = Config(), local_mesh: autopar.ProcessMesh | None = None) -> Any:
    """The model (a ``paddle.nn.Layer``); its forward returns the logits and the summed
    auxiliary loss of its routers. ``local_mesh``: the experts written Paddle's way on its
    ``ep`` sub-meshes, the router per group of tokens (module docstring)."""
    import paddle

    from autopar.local_map import global_mesh_tensor, local_map, sub_mesh_tensors

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
        """GShard top-k gating (fairscale top2gate, generalised to ``config.top_k``) over
        ``[groups, tokens, dim]``, each group routed on its own (its cumsum over token slots, its
        capacity, its statistics): combine weights ``[G, S, E, C]``, the dispatch mask, and the
        auxiliary loss (the groups' mean)."""

        def __init__(self) -> None:
            super().__init__()
            self.wg = nn.Linear(config.dim, E, bias_attr=False)

        def forward(self, x: Any) -> tuple[Any, Any, Any]:
            S = x.shape[1]
            C = capacity(config, S)
            gates = F.softmax(self.wg(x), axis=-1)  # [G, S, E]
            masks, rest = [], gates
            for _ in range(config.top_k):  # the i-th expert: the best of the gates with the first i-1 masked out
                _, choice = paddle.topk(rest, k=1, axis=-1)
                masks.append(F.one_hot(choice.squeeze(-1), E))  # [G, S, E]
                rest = paddle.where(masks[-1] > 0, paddle.full_like(gates, float("-inf")), rest)
            me, ce = gates.mean(axis=1), masks[0].mean(axis=1)  # [G, E]
            aux = (me * ce).mean() * E * E  # load balancing: fraction routed x mean gate, per expert and group
            kept, taken = [], None
            for mask in masks:  # each token's slot in its i-th expert: after the slots of the choices before
                locations = paddle.cumsum(mask, axis=1) - 1 + (0 if taken is None else taken)
                taken = mask.sum(axis=1, keepdim=True) + (0 if taken is None else taken)
                mask = mask * (locations < C).astype("float32")  # tokens past the capacity dropped
                slot = (locations * mask).sum(axis=2).astype("int64")
                kept.append((mask, (gates * mask).sum(axis=2), slot))
            if config.top_k > 1:  # top-k weights renormalised over the kept choices (top-1: Switch's raw gate)
                denom = paddle.clip(paddle.add_n([g for _, g, _ in kept]), min=1e-9)
                kept = [(mask, g / denom, slot) for mask, g, slot in kept]
            combine = paddle.add_n(
                [paddle.einsum("gse,gsc->gsec", g.unsqueeze(2) * mask, F.one_hot(slot, C)) for mask, g, slot in kept]
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
            G = config.router_groups
            grouped = x.reshape([G, B * T // G, C])
            combine, dispatch, aux = self.router(grouped)
            buffer = paddle.einsum("gsec,gsm->egcm", dispatch, grouped)  # [experts, groups, capacity, dim]
            hidden = F.gelu(paddle.einsum("egcm,emh->egch", buffer, self.w_in))
            out = paddle.einsum("egch,ehm->egcm", hidden, self.w_out)
            routed = paddle.einsum("gsec,egcm->gsm", combine, out).reshape([B * T, C])
            flat = x.reshape([B * T, C])
            shared = self.shared_out(F.gelu(self.shared_in(flat)))
            return (routed + shared).reshape([B, T, C]), aux

    class Expert(nn.Layer):
        """One routed expert: ``gelu(x w_in) w_out`` over its ``[..., dim]`` rows."""

        def __init__(self) -> None:
            super().__init__()
            init = nn.initializer.Normal(std=0.02)
            self.w_in = self.create_parameter([config.dim, config.expert_hidden], default_initializer=init)
            self.w_out = self.create_parameter([config.expert_hidden, config.dim], default_initializer=init)

        def forward(self, x: Any) -> Any:
            return paddle.matmul(F.gelu(paddle.matmul(x, self.w_in)), self.w_out)

    class LocalMoE(nn.Layer):
        """The MoE written Paddle's way on ``local_mesh`` (module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self.router = Router()
            self.experts = nn.LayerList([Expert() for _ in range(E)])
            self.shared_in = nn.Linear(config.dim, config.expert_hidden)
            self.shared_out = nn.Linear(config.expert_hidden, config.dim)

        def forward(self, x: Any) -> tuple[Any, Any]:
            mesh = local_mesh
            B, T, C = x.shape
            flat = x.reshape([B * T, C])
            names = [n for n in TOKEN_DIMS if n in mesh.dim_names]
            copies = local_copies(mesh)
            per_copy = max(config.router_groups // copies, 1)  # groups each copy routes, group-major (local_map's groups)
            G = copies * per_copy
            tokens = [autopar.Shard(0) if n in names else autopar.Replicate() for n in mesh.dim_names]
            summed = [autopar.Partial() if n in names else autopar.Replicate() for n in mesh.dim_names]
            router = _one_group(self.router) if per_copy == 1 else self.router
            combine, dispatch, aux = local_map(router, [tokens], [tokens, tokens, summed], mesh, groups=per_copy)(flat)
            S = B * T // G
            combine, dispatch = (t.reshape([G, S, E, t.shape[-1]]) for t in (combine, dispatch))
            grouped = flat.reshape([G, S, C])
            buffer = paddle.einsum("gsec,gsm->egcm", dispatch, grouped)  # [experts, groups, capacity, dim]
            by_expert = [autopar.Shard(0) if n == "ep" else autopar.Shard(1) if n in names else autopar.Replicate() for n in mesh.dim_names]
            per_rank = E // mesh.dim_size("ep")
            outs = []
            for i, rows in enumerate(sub_mesh_tensors(buffer, mesh, by_expert, "ep")):
                chunks = paddle.split(rows, per_rank, axis=0) if per_rank > 1 else [rows]
                done = [self.experts[i * per_rank + j](chunk) for j, chunk in enumerate(chunks)]
                outs.append(paddle.concat(done, axis=0) if per_rank > 1 else done[0])
            out = global_mesh_tensor(outs, mesh, by_expert, "ep")
            by_group = [autopar.Shard(1) if n in names else autopar.Replicate() for n in mesh.dim_names]
            out = autopar.reshard(out, mesh, by_group)  # back to each group's ranks (Paddle's dist.reshard)
            routed = paddle.einsum("gsec,egcm->gsm", combine, out).reshape([B * T, C])
            shared = self.shared_out(F.gelu(self.shared_in(flat)))
            return (routed + shared).reshape([B, T, C]), aux / copies  # (each copy's aux: the mean over its groups)

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(config.dim), Attention()
            self.ln_2, self.moe = nn.LayerNorm(config.dim), (MoE() if local_mesh is None else LocalMoE())

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


def _one_group(router: Any) -> Any:
    """``router`` on the ``[tokens, dim]`` of one group (a local_map copy): its results without the group dim."""

    def routed(x: Any) -> tuple[Any, Any, Any]:
        combine, dispatch, aux = router(x.unsqueeze(0))
        return combine.squeeze(0), dispatch.squeeze(0), aux

    return routed


def compute_loss(config: Config, logits: Any, aux: Any, labels: Any) -> Any:
    """Next-token cross-entropy averaged over the tokens, plus the weighted auxiliary loss."""
    import paddle

    ce = paddle.nn.functional.cross_entropy(logits.reshape([-1, config.vocab_size]), labels.reshape([-1, 1])).mean()
    return ce + config.aux_loss_weight * aux


def _annotate(model: Any, tokens: Any, labels: Any, mesh: autopar.ProcessMesh) -> None:
    from autopar.local_map import split_mesh

    splits = {name: 0 for name in TOKEN_DIMS if name in mesh.dim_names}
    annotate(tokens, mesh, **splits)
    annotate(labels, mesh, **splits)
    whole(model.embed, mesh)
    for layer in model.layers:
        if "mp" in mesh.dim_names:  # tensor-parallel attention (Megatron's): q, k, v by columns, the projection by rows
            column(layer.attn.qkv, mesh)
            row(layer.attn.proj, mesh)
        else:
            whole(layer.attn, mesh)
        for part in (layer.ln_1, layer.ln_2, layer.moe.router, layer.moe.shared_in, layer.moe.shared_out):
            whole(part, mesh)
        if hasattr(layer.moe, "experts"):  # expert e on the sub-mesh of the ep rank holding it, whole there
            subs = split_mesh(mesh, "ep")
            per_rank = len(layer.moe.experts) // len(subs)
            for e, expert in enumerate(layer.moe.experts):
                whole(expert, subs[e // per_rank])
            continue
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
