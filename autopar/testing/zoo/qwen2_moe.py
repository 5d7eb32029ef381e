"""A Qwen2-MoE decoder ported from PaddleNLP's own (non-auto) MoE code, in its authors' spelling:

- ``PaddlePaddle/PaddleNLP`` @ ``801f0ff1d8d9bbed5007f9082f0ab2a45f80dedf``,
  ``paddlenlp/transformers/moe_gate.py``: ``PretrainedMoEGate.top2gating`` (softmax gates;
  the first expert by ``argmax``, the second by ``argmax`` of the logits with the first
  ``masked_fill``-ed to ``-inf``; slots from ``cumsum`` of the int64 one-hot masks, the second
  choices after every first choice; ``_capacity`` = ``int((tokens // experts) *
  capacity_factor)``; tokens past it dropped; ``einsum`` renormalisation of the two kept gates;
  ``_cal_aux_loss`` = ``sum(mean(gates) * mean(mask1)) * E``; ``_cal_z_loss``);
- the same commit, ``paddlenlp/transformers/moe_layer.py``: ``MoELayer.forward`` (dispatch
  ``einsum("sec,sm->ecm")``, ``reshape`` to ``[ep, experts per device, capacity, dim]``,
  ``expert_forward`` by ``unbind(1)`` / ``stack(axis=1)``, combine ``einsum("sec,ecm->sm")``);
- ``PaddlePaddle/PaddleNLP`` @ ``00c76f50194f528f393bcfa3bc843e43bef6d9af``,
  ``paddlenlp/transformers/qwen2_moe/modeling.py``: ``Qwen2MoeGate`` (``F.linear`` of a
  ``[hidden, experts]`` weight), ``Qwen2MoeSparseMoEBlock`` (the routed experts plus one
  shared expert scaled by ``sigmoid(shared_expert_gate(x))``, the z-loss dropped),
  ``Qwen2MoeMLP`` (``down_proj(silu(gate_proj(x)) * up_proj(x))``), the decoder layer
  (RMSNorm, attention with q/k/v biases, rotary tables, grouped-query heads).

Where the port departs from the reference, and why: the gate calls ``top2gating`` with
``top2_2nd_expert_sampling=False`` and ``drop_tokens=True`` (the reference's Qwen2-MoE block
passes ``drop_tokens=False``, whose capacity ``int(paddle.max(exp_counts))`` is read from the
batch's routing at run time, which a static program cannot; Gumbel sampling of the second
expert would route serial and distributed runs differently); the gate weight is initialised
``Normal(0, initializer_range)`` (the reference's ``Constant(1.0)`` is overwritten by a
checkpoint; a constant gate sends every token to experts 0 and 1); ``paddle.no_grad``
decorators are left off (the one-hots have no gradient in a static program either); the
``_AllToAll`` PyLayer calls are not written: the annotations below say where the experts live
and autopar plans the all_to_alls. The aux loss is added to the loss as
``router_aux_loss_coef * sum of the layers' l_aux``.

Annotated as a Paddle semi-auto user writes expert parallelism (``build(mesh=...)``, by the
mesh's dim names): ``dp`` and ``ep`` split the batch; the gate and the dispatch einsum run per
rank in :func:`autopar.local_map.local_map` (Paddle's ``LocalLayer``), on that rank's tokens, so
the serial program routes each rank's group of tokens on its own (GShard's groups); expert ``e``
is placed whole on ``split_mesh(mesh, "ep")[e // (E / ep)]`` and reads its rows of the
dispatched ``[experts, capacity, hidden]`` buffer through
:func:`~autopar.local_map.sub_mesh_tensors` (Paddle's ``moe_sub_mesh_tensors``), gives them back
through :func:`~autopar.local_map.global_mesh_tensor`, and ``autopar.reshard`` returns them to
each group's ranks for the combine einsum, also per rank in ``local_map``. ``mp`` splits the
attention as Megatron does. Without ``ep`` the experts are whole on the mesh (the reference's
expert-parallel degree 1); without a mesh the gate routes the whole batch, as the reference
does on one device. ``build(routing="whole_batch")`` keeps that one-device gate on the mesh
too (one gate over every token; its cumsum over token slots then needs every token).
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
    """Qwen2MoeConfig's fields the model reads (small sizes)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_experts: int = 4
    num_experts_per_tok: int = 2  # top-2: the gate is top2gating
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 32
    capacity_factor: float = 2.0  # the gate's: capacity = int((tokens // experts) * capacity_factor)
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_experts_per_tok != 2:
            raise ValueError(f"the ported gate is PaddleNLP's top2gating: num_experts_per_tok is 2, got {self.num_experts_per_tok}")
        if self.num_experts < 2:
            raise ValueError(f"top-2 gating needs 2 experts or more, got {self.num_experts}")


INPUTS, LABELS = ("tokens",), ("labels",)
TOKEN_DIMS = ("dp", "ep")  # the mesh dims that split the tokens: each rank's gate routes its own


def build(
    config: Config = Config(), batch: int = 4, seq: int = 8, mesh: autopar.ProcessMesh | None = None,
    optimizer: str = "sgd", seed: int | None = 23, routing: str = "per_rank",
) -> SeedProgram:  # fmt: skip
    """The training program (next-token cross-entropy plus the weighted aux losses), annotated
    for ``mesh`` (None: serial, the gate over the whole batch). ``routing="per_rank"``: the gate
    and the dispatch / combine einsums per rank of ``dp`` x ``ep`` in ``local_map``, each rank's
    tokens routed on their own, as the reference's ranks route under expert parallelism;
    ``"whole_batch"``: the reference's one-device spelling kept on the mesh, one gate over every
    token (its cumsum over token slots then needs the whole batch: gathered)."""
    if routing not in ("per_rank", "whole_batch"):
        raise ValueError(f"routing is 'per_rank' or 'whole_batch', got {routing!r}")
    if mesh is not None and "ep" in mesh.dim_names and config.num_experts % mesh.dim_size("ep"):
        raise ValueError(f"{config.num_experts} experts do not divide over ep={mesh.dim_size('ep')}")
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        tokens = paddle.static.data("tokens", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        model = network(config, mesh, routing)
        if mesh is not None:
            _annotate(model, tokens, labels, mesh)
        logits, aux = model(tokens)
        loss = compute_loss(config, logits, aux, labels)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"tokens": tokens, "labels": labels}, loss, {"model": model})


def network(config: Config = Config(), mesh: autopar.ProcessMesh | None = None, routing: str = "per_rank") -> Any:
    """The model (``Qwen2MoeForCausalLM``'s layers); its forward returns the logits and the
    summed ``l_aux`` of its layers. ``mesh``: where its MoE layers place the experts and run the
    gate (module docstring); ``routing``: as in :func:`build`."""
    import paddle

    from autopar.local_map import global_mesh_tensor, local_map, sub_mesh_tensors

    nn, F = paddle.nn, paddle.nn.functional
    head_dim = config.hidden_size // config.num_attention_heads
    init = nn.initializer.Normal(std=config.initializer_range)

    class Qwen2MoeRMSNorm(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.weight = self.create_parameter([config.hidden_size], default_initializer=nn.initializer.Constant(1.0))
            self.variance_epsilon = config.rms_norm_eps

        def forward(self, hidden_states: Any) -> Any:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = paddle.rsqrt(variance + self.variance_epsilon) * hidden_states
            return hidden_states * self.weight

    def rotate_half(x: Any) -> Any:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return paddle.concat([-x2, x1], axis=-1)

    def rotary_tables(length: int) -> tuple[Any, Any]:
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
        freqs = paddle.outer(paddle.arange(length, dtype="float32"), inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        return paddle.cos(emb).reshape([1, length, 1, head_dim]), paddle.sin(emb).reshape([1, length, 1, head_dim])

    class Qwen2MoeAttention(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            kv = config.num_key_value_heads * head_dim
            self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
            self.k_proj = nn.Linear(config.hidden_size, kv)
            self.v_proj = nn.Linear(config.hidden_size, kv)
            self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias_attr=False)

        def forward(self, hidden_states: Any, cos: Any, sin: Any, mask: Any) -> Any:
            bsz, q_len, _ = hidden_states.shape
            query_states = self.q_proj(hidden_states).reshape([bsz, q_len, -1, head_dim])
            key_states = self.k_proj(hidden_states).reshape([bsz, q_len, -1, head_dim])
            value_states = self.v_proj(hidden_states).reshape([bsz, q_len, -1, head_dim])
            query_states = query_states * cos + rotate_half(query_states) * sin
            key_states = key_states * cos + rotate_half(key_states) * sin
            n_rep = config.num_attention_heads // config.num_key_value_heads
            if n_rep > 1:  # repeat_kv
                b, s, n_kv, d = key_states.shape
                key_states = key_states.unsqueeze(3).expand([b, s, n_kv, n_rep, d]).reshape([b, s, n_kv * n_rep, d])
                value_states = value_states.unsqueeze(3).expand([b, s, n_kv, n_rep, d]).reshape([b, s, n_kv * n_rep, d])
            q, k, v = (t.transpose([0, 2, 1, 3]) for t in (query_states, key_states, value_states))
            attn_weights = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask
            attn_output = paddle.matmul(F.softmax(attn_weights, axis=-1), v).transpose([0, 2, 1, 3])
            return self.o_proj(attn_output.reshape([bsz, q_len, -1]))

    class Qwen2MoeMLP(nn.Layer):
        def __init__(self, intermediate_size: int) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias_attr=False)
            self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias_attr=False)
            self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias_attr=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Qwen2MoeGate(nn.Layer):
        """``Qwen2MoeGate(PretrainedMoEGate)`` with ``top2gating`` (module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self.num_experts = config.num_experts
            self.capacity_factor = config.capacity_factor
            self.min_capacity, self.max_capacity = 1.0, pow(2, 32)
            self.drop_tokens, self.top2_2nd_expert_sampling = True, False
            # [hidden_size, n_expert]
            self.weight = self.create_parameter([config.hidden_size, config.num_experts], default_initializer=init)

        def forward(self, hidden_states: Any) -> tuple[Any, ...]:
            logits = F.linear(hidden_states, self.weight, None)
            return self.top2gating(logits)

        def gate_score_func(self, logits: Any) -> Any:
            return F.softmax(logits.cast("float32"), axis=-1)

        def _one_hot_to_float(self, x: Any, num_classes: int) -> Any:
            if x.dtype not in (paddle.int32, paddle.int64):
                x = paddle.cast(x, paddle.int64)
            return F.one_hot(x, num_classes=num_classes).cast(paddle.get_default_dtype())

        def _one_hot_to_int64(self, x: Any, num_classes: int) -> Any:
            if x.dtype not in (paddle.int32, paddle.int64):
                x = paddle.cast(x, paddle.int64)
            return F.one_hot(x, num_classes=num_classes).cast(paddle.int64)

        def _capacity(self, gates: Any, capacity_factor: float, max_capacity: int, min_capacity: int) -> int:
            num_tokens, num_experts = gates.shape[0], gates.shape[1]
            capacity = int((num_tokens // num_experts) * capacity_factor)
            if capacity < min_capacity:
                capacity = min_capacity
            if capacity > max_capacity:
                capacity = max_capacity
            assert capacity > 0, f"requires capacity > 0, capacity_factor: {capacity_factor}, input_shape: {gates.shape}"
            return int(capacity)

        def _cal_aux_loss(self, gates: Any, mask: Any) -> Any:
            me = paddle.mean(gates, axis=0)
            ce = paddle.mean(mask.cast("float32"), axis=0)
            return paddle.sum(me * ce) * float(self.num_experts)

        def _cal_z_loss(self, logits: Any) -> Any:
            return logits.exp().sum(1).log().square().mean()

        def top2gating(self, logits: Any) -> tuple[Any, ...]:
            # everything is in fp32 in this function
            gates = self.gate_score_func(logits=logits)

            # Create a mask for 1st's expert per token.
            indices1_s = paddle.argmax(gates, axis=1)  # [S, 1]
            mask1 = self._one_hot_to_int64(indices1_s, self.num_experts)  # [S, E]

            # Replace top-expert with min value
            logits_except1 = logits.masked_fill(mask1.cast(paddle.bool), float("-inf"))  # [S, E]
            indices2_s = paddle.argmax(logits_except1, axis=1)  # [S, 1]
            mask2 = self._one_hot_to_int64(indices2_s, self.num_experts)  # [S, E]

            # Compute locations in capacity buffer.
            locations1 = paddle.cumsum(mask1, axis=0) - 1  # [S, E]
            locations2 = paddle.cumsum(mask2, axis=0) - 1  # [S, E]
            # Update 2nd's location by accounting for locations of 1st.
            locations2 += paddle.sum(mask1, axis=0, keepdim=True)

            l_aux = self._cal_aux_loss(gates, mask1)
            l_zloss = self._cal_z_loss(logits)

            # gating decisions
            exp_counts = paddle.sum(mask1 + mask2, axis=0)
            # Calculate configured capacity and remove locations outside capacity from mask
            capacity = self._capacity(gates, self.capacity_factor, self.max_capacity, self.min_capacity)
            # Remove locations outside capacity from mask.
            mask1 *= (locations1 < capacity).cast(paddle.int64)
            mask2 *= (locations2 < capacity).cast(paddle.int64)

            # Store the capacity location for each token.
            locations1_s = paddle.sum(locations1 * mask1, axis=1)
            locations2_s = paddle.sum(locations2 * mask2, axis=1)

            # Normalize gate probabilities
            mask1_float = mask1.cast(paddle.float32)
            mask2_float = mask2.cast(paddle.float32)
            gates1_s = paddle.einsum("se,se->s", gates, mask1_float)
            gates2_s = paddle.einsum("se,se->s", gates, mask2_float)
            denom_s = gates1_s + gates2_s
            # Avoid divide-by-zero
            denom_s = paddle.clip(denom_s, min=paddle.finfo(denom_s.dtype).eps)
            gates1_s /= denom_s
            gates2_s /= denom_s

            # Calculate combine_weights and dispatch_mask
            gates1 = paddle.einsum("s,se->se", gates1_s, mask1_float)
            gates2 = paddle.einsum("s,se->se", gates2_s, mask2_float)
            locations1_sc = self._one_hot_to_float(locations1_s, capacity)
            locations2_sc = self._one_hot_to_float(locations2_s, capacity)
            combine1_sec = paddle.einsum("se,sc->sec", gates1, locations1_sc)
            combine2_sec = paddle.einsum("se,sc->sec", gates2, locations2_sc)
            combine_weights = combine1_sec + combine2_sec
            dispatch_mask = combine_weights.cast(paddle.bool)

            return capacity, combine_weights, dispatch_mask, exp_counts, l_aux, l_zloss

    class MoELayer(nn.Layer):
        """``MoELayer`` with one device's experts (``expert_parallel_degree`` 1: no mesh, or a
        mesh without ``ep``, the gate then per rank of ``dp``)."""

        def __init__(self) -> None:
            super().__init__()
            self.moe_num_experts = config.num_experts
            self.expert_parallel_degree, self.moe_rank = 1, 0
            self.moe_num_experts_per_device = config.num_experts
            self.experts = nn.LayerList([Qwen2MoeMLP(config.moe_intermediate_size) for _ in range(config.num_experts)])
            self.gate = Qwen2MoeGate()

        def expert_forward(self, dispatched_input: Any) -> Any:
            true_experts = self.experts[
                self.moe_rank * self.moe_num_experts_per_device : (self.moe_rank + 1) * self.moe_num_experts_per_device
            ]
            expert_outputs = []
            chunks = dispatched_input.unbind(1)
            assert len(chunks) == len(true_experts), (len(chunks), len(true_experts))
            for chunk, expert in zip(chunks, true_experts):
                expert_outputs += [expert(chunk)]
            return paddle.stack(expert_outputs, axis=1)  # [ecm]

        def gate_and_dispatch(self, reshaped_input: Any) -> tuple[Any, Any, Any]:
            capacity, combine_weights, dispatch_mask, exp_counts, l_aux, l_zloss = self.gate(reshaped_input)
            dispatched_input = paddle.einsum("sec,sm->ecm", paddle.cast(dispatch_mask, reshaped_input.dtype), reshaped_input)
            return dispatched_input, combine_weights, l_aux

        def route(self, reshaped_input: Any) -> tuple[Any, Any, Any]:
            """The gate and the dispatch einsum: per rank of the token dims in ``local_map``
            (Paddle's LocalLayer; the aux loss the groups' mean), or over every token at once."""
            if mesh is None or routing == "whole_batch":
                return self.gate_and_dispatch(reshaped_input)
            tokens, slots, summed, groups = _token_placements(mesh)
            dispatched_input, combine_weights, l_aux = local_map(self.gate_and_dispatch, [tokens], [slots, tokens, summed], mesh)(reshaped_input)
            return dispatched_input, combine_weights, l_aux / groups

        def combine(self, combine_weights: Any, expert_output: Any, hidden_state: Any) -> Any:
            """The combine einsum, per rank where the gate is."""

            def combining(combine_weights: Any, expert_output: Any) -> Any:
                return paddle.einsum("sec,ecm->sm", combine_weights.cast(hidden_state[0].dtype), expert_output)

            if mesh is None or routing == "whole_batch":
                return combining(combine_weights, expert_output)
            tokens, slots, _, _ = _token_placements(mesh)
            return local_map(combining, [tokens, slots], [tokens], mesh)(combine_weights, expert_output)

        def forward(self, hidden_state: Any) -> tuple[Any, Any]:
            batch_size, seq_len, d_model = hidden_state.shape
            reshaped_input = hidden_state.reshape([-1, d_model])
            dispatched_input, combine_weights, l_aux = self.route(reshaped_input)
            # Re-shape after all-to-all: ecm -> gecm
            dispatched_input = dispatched_input.reshape([self.expert_parallel_degree, self.moe_num_experts_per_device, -1, d_model])
            expert_output = self.expert_forward(dispatched_input)
            # Re-shape before drop_tokens: gecm -> ecm
            expert_output = expert_output.reshape([self.expert_parallel_degree * self.moe_num_experts_per_device, -1, d_model])
            combined_output = self.combine(combine_weights, expert_output, hidden_state)
            return combined_output.reshape(hidden_state.shape), l_aux

    class ExpertParallelMoELayer(MoELayer):
        """``MoELayer`` on a mesh with ``ep``: expert ``e`` on ``split_mesh(mesh, "ep")[e //
        experts per device]``; where the reference calls ``_AllToAll``, the buffer moves to the
        experts' sub-meshes and back by views and a reshard (module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self.expert_parallel_degree = mesh.dim_size("ep")
            self.moe_num_experts_per_device = config.num_experts // self.expert_parallel_degree

        def forward(self, hidden_state: Any) -> tuple[Any, Any]:
            batch_size, seq_len, d_model = hidden_state.shape
            reshaped_input = hidden_state.reshape([-1, d_model])
            dispatched_input, combine_weights, l_aux = self.route(reshaped_input)
            _, slots, _, _ = _token_placements(mesh)
            by_expert = [autopar.Shard(0) if n == "ep" else p for n, p in zip(mesh.dim_names, slots)]
            outs = []
            for moe_rank, rows in enumerate(sub_mesh_tensors(dispatched_input, mesh, by_expert, "ep")):
                self.moe_rank = moe_rank  # expert_forward picks this ep rank's experts, as on that rank
                # Re-shape after all-to-all: ecm -> gecm (this rank's experts)
                rows = rows.reshape([1, self.moe_num_experts_per_device, -1, d_model])
                outs.append(self.expert_forward(rows).reshape([self.moe_num_experts_per_device, -1, d_model]))
            expert_output = global_mesh_tensor(outs, mesh, by_expert, "ep")
            expert_output = autopar.reshard(expert_output, mesh, slots)  # back to each group's ranks (Paddle's dist.reshard)
            combined_output = self.combine(combine_weights, expert_output, hidden_state)
            return combined_output.reshape(hidden_state.shape), l_aux

    class Qwen2MoeSparseMoEBlock(ExpertParallelMoELayer if mesh is not None and "ep" in mesh.dim_names else MoELayer):
        def __init__(self) -> None:
            super().__init__()
            self.shared_expert = Qwen2MoeMLP(config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias_attr=False)

        def forward(self, hidden_states: Any) -> tuple[Any, Any]:
            final_hidden_states, l_aux = super().forward(hidden_states)

            shared_expert_output = self.shared_expert(hidden_states)
            shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
            final_hidden_states = final_hidden_states + shared_expert_output

            return final_hidden_states, l_aux

    class Qwen2MoeDecoderLayer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Qwen2MoeAttention()
            self.mlp = Qwen2MoeSparseMoEBlock()
            self.input_layernorm = Qwen2MoeRMSNorm()
            self.post_attention_layernorm = Qwen2MoeRMSNorm()

        def forward(self, hidden_states: Any, cos: Any, sin: Any, mask: Any) -> tuple[Any, Any]:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states = residual + self.self_attn(hidden_states, cos, sin, mask)
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, l_aux = self.mlp(hidden_states)
            return residual + hidden_states, l_aux

    class Qwen2MoeModel(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.LayerList([Qwen2MoeDecoderLayer() for _ in range(config.num_hidden_layers)])
            self.norm = Qwen2MoeRMSNorm()

        def forward(self, input_ids: Any) -> tuple[Any, Any]:
            seq_length = input_ids.shape[1]
            hidden_states = self.embed_tokens(input_ids)
            cos, sin = rotary_tables(seq_length)
            mask = paddle.triu(paddle.full([seq_length, seq_length], float("-inf"), "float32"), diagonal=1)
            aux_loss = None
            for decoder_layer in self.layers:
                hidden_states, l_aux = decoder_layer(hidden_states, cos, sin, mask)
                aux_loss = l_aux if aux_loss is None else aux_loss + l_aux
            return self.norm(hidden_states), aux_loss

    class Qwen2MoeForCausalLM(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qwen2_moe = Qwen2MoeModel()
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

        def forward(self, input_ids: Any) -> tuple[Any, Any]:
            hidden_states, aux_loss = self.qwen2_moe(input_ids)
            return self.lm_head(hidden_states), aux_loss

    return Qwen2MoeForCausalLM()


def _token_placements(mesh: autopar.ProcessMesh) -> tuple[list[Any], list[Any], list[Any], int]:
    """Placements on ``mesh`` of a per-rank gate's tokens (``Shard(0)`` over the token dims),
    its dispatched buffer's slots (``Shard(1)``), its summed aux loss (``Partial``), and the
    number of groups (ranks of the token dims)."""
    names = [n for n in TOKEN_DIMS if n in mesh.dim_names]
    pick = lambda split: [split if n in names else autopar.Replicate() for n in mesh.dim_names]  # noqa: E731
    return pick(autopar.Shard(0)), pick(autopar.Shard(1)), pick(autopar.Partial()), math.prod(mesh.dim_size(n) for n in names)


def compute_loss(config: Config, logits: Any, aux_loss: Any, labels: Any) -> Any:
    """Next-token cross-entropy averaged over the tokens, plus ``router_aux_loss_coef`` x the aux losses."""
    import paddle

    ce = paddle.nn.functional.cross_entropy(logits.reshape([-1, config.vocab_size]), labels.reshape([-1, 1])).mean()
    return ce + config.router_aux_loss_coef * aux_loss


def _annotate(model: Any, tokens: Any, labels: Any, mesh: autopar.ProcessMesh) -> None:
    from autopar.local_map import split_mesh

    splits = {name: 0 for name in TOKEN_DIMS if name in mesh.dim_names}
    annotate(tokens, mesh, **splits)
    annotate(labels, mesh, **splits)
    whole(model.qwen2_moe.embed_tokens, mesh)
    for layer in model.qwen2_moe.layers:
        if "mp" in mesh.dim_names:  # tensor-parallel attention (Megatron's): q, k, v by columns, o_proj by rows
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                column(linear, mesh)
            row(layer.self_attn.o_proj, mesh)
        else:
            whole(layer.self_attn, mesh)
        moe = layer.mlp
        for part in (layer.input_layernorm, layer.post_attention_layernorm, moe.gate, moe.shared_expert, moe.shared_expert_gate):
            whole(part, mesh)
        if "ep" not in mesh.dim_names:
            whole(moe.experts, mesh)
            continue
        subs = split_mesh(mesh, "ep")
        for e, expert in enumerate(moe.experts):  # expert e whole on the sub-mesh of the ep rank holding it
            whole(expert, subs[e // moe.moe_num_experts_per_device])
    whole(model.qwen2_moe.norm, mesh)
    whole(model.lm_head, mesh)


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
