"""The ported MoE (``autopar.testing.zoo.qwen2_moe``: PaddleNLP's Qwen2-MoE block with
``PretrainedMoEGate.top2gating`` and ``MoELayer``'s einsum dispatch and combine, a sigmoid-gated
shared expert) equal to serial in the simulator, annotated as a Paddle user writes expert
parallelism: the gate and the dispatch einsum per rank in ``autopar.local_map``, each expert
whole on a sub-mesh of ``ep``. Losses every step and every parameter after 3 SGD steps, on dp,
ep2, ep4, dp x ep, ep x mp and ZeRO-1; on the GPU profile, each MoE layer moves exactly two
all_to_alls forward and two backward."""

import numpy as np
import pytest

import autopar
from autopar.local_map import split_mesh
from autopar.testing.serial import assert_simulation_equals_serial, run_serial
from autopar.testing.zoo import qwen2_moe

M = autopar.ProcessMesh
MESHES = {
    "dp": M([0, 1], ["dp"]),
    "ep2": M([0, 1], ["ep"]),
    "ep4": M([0, 1, 2, 3], ["ep"]),
    "dp x ep": M([[0, 1], [2, 3]], ["dp", "ep"]),
    "ep x mp": M([[0, 1], [2, 3]], ["ep", "mp"]),  # Megatron's tensor-parallel attention beside the experts
}
CONFIG = qwen2_moe.Config(num_hidden_layers=1)


@pytest.mark.parametrize("name", list(MESHES))
def test_the_ported_moe_equals_serial(name):
    """The serial program routes each rank's group of tokens on its own, as each rank does."""
    mesh = MESHES[name]
    seed = qwen2_moe.build(CONFIG, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert dist.strategy.pipeline is None
    assert_simulation_equals_serial(seed, dist, feeds=qwen2_moe.feeds(CONFIG, 4, 8, 3))


def test_zero_1_shards_an_experts_states_over_its_holders_and_equals_serial():
    """ZeRO-1 with momentum on dp x ep: expert e's gradient is reduce-scattered over the two
    ranks of its ep sub-mesh and its updated shards gathered back there; equal to serial."""
    mesh = MESHES["dp x ep"]
    seed = qwen2_moe.build(CONFIG, batch=4, seq=8, mesh=mesh, optimizer="momentum")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=1))
    assert_simulation_equals_serial(seed, dist, feeds=qwen2_moe.feeds(CONFIG, 4, 8, 3))
    holders = split_mesh(mesh, "ep")[0].ranks  # rank 0's experts (0 and 1) live on ranks 0 and 2
    experts = seed.layers["model"].qwen2_moe.layers[0].mlp.experts
    routed = {p.name for p in experts.parameters()}
    assert {z.label for z in dist.state.zero if z.sharded is not None} >= routed
    paths = ("Qwen2MoeSparseMoEBlock/Qwen2MoeMLP/", "Qwen2MoeSparseMoEBlock/Qwen2MoeMLP_1/")  # experts 0 and 1
    theirs = {(c.kind.value, c.group) for c in dist.comm_ops(0) if any(p in c.reason for p in paths) or any(f"grad({n})" in c.reason for n in routed)}
    assert theirs == {("reduce_scatter", holders), ("all_gather", holders)}, theirs


def _reader(reason: str) -> str:
    """The op a reshard's reason names as reading the moved value (``pd_op.split_with_num#353 reads ...``)."""
    return reason.split(": ", 1)[1].split("#", 1)[0]


@pytest.mark.parametrize("name", ["ep2", "dp x ep", "ep x mp"])
def test_each_moe_layer_moves_two_all_to_alls_forward_and_two_backward_on_the_gpu_profile(name):
    """On h100-node, rank 0 moves per MoE layer one all_to_all to the experts' ranks and one
    back, forward (read by the split onto the sub-meshes and by the combine) and backward (the
    split's and the concat's gradients), over its ep group; everything else it moves is a
    gradient sync or Megatron's attention all_reduces."""
    config, mesh = qwen2_moe.Config(num_hidden_layers=2), MESHES[name]
    seed = qwen2_moe.build(config, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(cluster="h100-node"))
    moved = dist.comm_ops(0)
    all_to_alls = [c for c in moved if c.kind.value == "all_to_all"]
    backward = [c for c in all_to_alls if _reader(c.reason).endswith("_grad")]
    assert (len(all_to_alls) - len(backward), len(backward)) == (2 * config.num_hidden_layers, 2 * config.num_hidden_layers)
    ep_group = tuple(r for r in mesh.ranks if all(mesh.coordinate(r)[d] == 0 for d, n in enumerate(mesh.dim_names) if n != "ep"))  # rank 0's ep ranks
    assert {c.group for c in all_to_alls} == {ep_group}
    others = [c.reason[:60] for c in moved if c.kind.value != "all_to_all" and not ("gradient sync" in c.reason or "Qwen2MoeAttention" in c.reason)]
    assert not others, others


def test_the_gate_is_paddlenlps_top2gating():
    """The serial program's gate against a numpy transcription of ``top2gating`` on the same
    tokens (argmax, the second choice with the first masked out, slots by cumsum after every first
    choice, capacity int((S // E) * factor), drops past it, renormalised pair, aux loss sum(me * ce) * E),
    with capacities that drop tokens and that keep them all."""
    import paddle

    for factor in (0.5, 4.0):  # capacity 2 (drops) and 16 = every token (keeps all)
        config = qwen2_moe.Config(num_hidden_layers=1, capacity_factor=factor)
        paddle.enable_static()
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
            x = paddle.static.data("x", [16, config.hidden_size], "float32")
            gate = qwen2_moe.network(config).qwen2_moe.layers[0].mlp.gate
            capacity, combine, dispatch, _, l_aux, _ = gate(x)
        rng = np.random.default_rng(3)
        tokens = rng.standard_normal((16, config.hidden_size)).astype("float32")
        got = run_serial(main, startup, [{"x": tokens}], [combine, l_aux, gate.weight]).fetches[0]
        want_combine, want_aux = _top2gating(tokens @ got[2], capacity)
        np.testing.assert_allclose(got[0], want_combine, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[1], want_aux, rtol=1e-5)
        kept = (want_combine > 0).sum()
        assert (kept < 2 * 16) == (factor < 4), (factor, kept)


def _top2gating(logits: np.ndarray, capacity: int) -> tuple[np.ndarray, float]:
    S, E = logits.shape
    gates = np.exp(logits - logits.max(1, keepdims=True))
    gates /= gates.sum(1, keepdims=True)
    first = gates.argmax(1)
    mask1 = np.eye(E, dtype=np.int64)[first]
    second = np.where(mask1 > 0, -np.inf, logits).argmax(1)
    mask2 = np.eye(E, dtype=np.int64)[second]
    loc1 = np.cumsum(mask1, 0) - 1
    loc2 = np.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdims=True)
    aux = float((gates.mean(0) * mask1.mean(0)).sum() * E)
    mask1, mask2 = mask1 * (loc1 < capacity), mask2 * (loc2 < capacity)
    g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
    denom = np.maximum(g1 + g2, np.finfo(np.float32).eps)
    combine = np.zeros((S, E, capacity), np.float32)
    for s in range(S):
        for mask, g, loc in ((mask1, g1, loc1), (mask2, g2, loc2)):
            e = mask[s].argmax()
            if mask[s, e]:
                combine[s, e, loc[s, e]] += g[s] / denom[s]
    return combine, aux


@pytest.mark.parametrize("name", ["ep2", "dp x ep"])
def test_the_references_whole_batch_gate_on_the_mesh_equals_serial_and_keeps_its_argmax_split(name):
    """``routing="whole_batch"``: the reference's one-device spelling left on the mesh (one gate
    over every token, experts still on their sub-meshes). Equal to serial; the router's argmax and
    its -inf masked_fill keep the tokens' split (they were gathered: "no SPMD rule for argmax").
    (Routing every token at once, its cumsum over token slots needs them all: docs/moe.md.)"""
    mesh = MESHES[name]
    seed = qwen2_moe.build(CONFIG, batch=4, seq=8, mesh=mesh, routing="whole_batch")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist, feeds=qwen2_moe.feeds(CONFIG, 4, 8, 3))
    gpu = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(cluster="h100-node"))
    readers = {_reader(c.reason) for c in gpu.comm_ops(0) if ": pd_op." in c.reason}
    assert not readers & {"pd_op.argmax", "pd_op.masked_fill"}, readers


def test_under_a_pipeline_one_micro_batch_equals_serial_and_more_are_refused_by_name():
    """pp x ep, a decoder layer a stage: the port's per-rank gate is a ``local_map`` without
    ``groups``, so one micro-batch (its serial meaning) equals serial and two are refused,
    naming the opt-in."""
    config, mesh = qwen2_moe.Config(num_hidden_layers=2), M([[0, 1], [2, 3]], ["pp", "ep"])
    seed = qwen2_moe.build(config, batch=4, seq=8, mesh=mesh)
    for micro_batches in (1, 2):
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2))
        if micro_batches == 1:
            dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
            assert_simulation_equals_serial(seed, dist, feeds=qwen2_moe.feeds(config, 4, 8, 2))
        else:
            with pytest.raises(autopar.AutoparError, match=r"autopar.local_map region.*groups="):
                autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
