"""Ring attention (``ContextParallel(method="ring")``, passes/ring_attention.py) on the zoo's
Llama (``/ sqrt(d) + triu(-inf)`` mask, GQA) and GPT-2 (``* 1/sqrt(d)``, ``where`` mask, dropout
0.1 on the probabilities), the token feeds split by sequence over ``sep``: equal to serial
(losses every step, parameters after 3 SGD steps) on sep2, sep4 and dp2 x sep2; each rank
passes K / V on with cp - 1 permutes per layer forward (cp backward) and gathers them never."""

import re

import paddle
import pytest

import autopar
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import gpt2, llama
from autopar.testing.zoo.placements import annotate, column, row

M = autopar.ProcessMesh
RING = autopar.Strategy(context_parallel=autopar.ContextParallel(dim="sep", method="ring"))
MESHES = {"sep2": M([0, 1], ["sep"]), "sep4": M([0, 1, 2, 3], ["sep"]), "dp2 x sep2": M([[0, 1], [2, 3]], ["dp", "sep"])}
LAYERS = 2


def _build(model: str, mesh: M):
    """The zoo model, its feeds split by batch over dp and by sequence over sep (until the
    context-parallel rewrite does it), and the feeds of 3 steps."""
    if model == "llama":
        config = llama.Config(n_layers=LAYERS)
        seed, feeds = llama.build(config, batch=4, seq=8, mesh=None), None
    else:
        config = gpt2.Config(n_layer=LAYERS, dropout=0.1)
        seed, feeds = gpt2.build(config, batch=4, seq=8, mesh=None), gpt2.feeds(config, 4, 8, 3)
    with paddle.static.program_guard(seed.main, seed.startup):
        for value in seed.feeds.values():
            annotate(value, mesh, dp=0, sep=1)
    return seed, feeds


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_ring_attention_equals_serial(model, mesh):
    seed, feeds = _build(model, MESHES[mesh])
    dist = autopar.compile(seed.main, MESHES[mesh], startup_program=seed.startup, strategy=RING)
    cp = MESHES[mesh].dim_size("sep")
    comms = dist.comm_ops(0)
    forward = [c for c in comms if c.kind == "permute" and c.value.endswith(".kv")]
    backward = [c for c in comms if c.kind == "permute" and not c.value.endswith(".kv")]
    assert (len(forward), len(backward)) == ((cp - 1) * LAYERS, cp * LAYERS)
    if model == "llama":  # grouped-query attention: K, V move before repeat_kv ([B, S, 2 kv heads, 2 x 8]), half the bytes
        assert {c.shape for c in forward} == {(4, 8, 2, 16)}
    assert not [c for c in comms if c.kind == "all_gather" and ("for matmul" in c.reason or "reshape_grad" in c.reason)]
    assert not [c for c in comms if c.kind == "reduce_scatter"]  # dK / dV: the ring's blocks, not reduced sums
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


def test_gradients_left_pending_by_propagation_are_handed_on_as_pending_sums(monkeypatch):
    """Without the ring's gradient placements (autopar/rewrites/ring_gradients.py) dK and dV stay
    pending sums reduced after the backward's layout ops: the ring hands each rank's block on
    among zeros, and the planner's reduce_scatter makes it whole again — equal all the same."""
    from autopar.rewrites.ring_gradients import RingGradients

    monkeypatch.setattr(RingGradients, "apply", lambda self, work: work.reported(self, "off"))
    seed, feeds = _build("gpt2", MESHES["sep2"])
    dist = autopar.compile(seed.main, MESHES["sep2"], startup_program=seed.startup, strategy=RING)
    assert len([c for c in dist.comm_ops(0) if c.kind == "reduce_scatter"]) == 2 * LAYERS
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


def test_without_the_ring_k_and_v_are_gathered_whole():
    """What the ring replaces: the same feeds without the strategy gather K and V every layer."""
    seed, _ = _build("llama", MESHES["sep2"])
    dist = autopar.compile(seed.main, MESHES["sep2"], startup_program=seed.startup)
    gathers = [c for c in dist.comm_ops(0) if c.kind == "all_gather" and "for matmul" in c.reason]
    assert len(gathers) == 2 * LAYERS
    assert not [c for c in dist.comm_ops(0) if c.kind == "permute"]


def test_the_ring_is_a_declared_pass_and_its_permutes_are_explained():
    seed, _ = _build("gpt2", MESHES["sep2"])
    dist = autopar.compile(seed.main, MESHES["sep2"], startup_program=seed.startup, strategy=RING)
    assert "ring_attention(mesh_dim='sep')" in str(dist.passes)
    permute = next(c for c in dist.comm_ops(1) if c.kind == "permute")
    assert permute.group == (0, 1) and permute.shift == 1
    assert re.match(r"ring attention in GPT(_\d+)?/Block/CausalSelfAttention: attention\(matmul#\d+ ", permute.reason)
    assert "passes its key / value blocks one rank on over sep" in permute.reason


def test_a_sequence_not_divisible_by_the_ring_is_refused_by_name():
    mesh = M([0, 1, 2], ["sep"])
    seed = llama.build(llama.Config(n_layers=1), batch=2, seq=8, mesh=None)
    with paddle.static.program_guard(seed.main, seed.startup):
        for value in seed.feeds.values():
            annotate(value, mesh, sep=1)
    with pytest.raises(autopar.AutoparError, match=r"ring attention over sep: attention\(matmul#\d+ .*\) has a sequence of 8 keys"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=RING)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_ring_attention_with_tensor_parallel_heads_equals_serial(model):
    """mp2 x sep2, Megatron's column / row split of the projections: the forward reads whole or
    split heads as the model's q/k/v layout allows (GPT-2's fused c_attn: whole), the backward may
    split them further; each ring moves blocks as its matmuls read them."""
    mesh = M([[0, 1], [2, 3]], ["mp", "sep"])
    seed, feeds = _build(model, mesh)
    model_layers = seed.layers["model"]
    with paddle.static.program_guard(seed.main, seed.startup):
        if model == "llama":
            for layer in model_layers.layers:
                for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1, layer.feed_forward.w3):
                    column(linear, mesh)
                row(layer.attention.wo, mesh)
                row(layer.feed_forward.w2, mesh)
        else:
            for block in model_layers.h:
                column(block.attn.c_attn, mesh)
                row(block.attn.c_proj, mesh)
                column(block.mlp.c_fc, mesh)
                row(block.mlp.c_proj, mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=RING)
    assert [c.kind for c in dist.comm_ops(0)].count("permute") == 3 * LAYERS
    assert not [c for c in dist.comm_ops(0) if c.kind == "all_gather" and "for matmul" in c.reason]
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_recomputed_ring_rings_again(model):
    """Recompute re-runs the core in the backward: so does the ring (its K / V blocks shifted
    again), and the backward ring reads the recomputed output and log-sum-exp."""
    seed, feeds = _build(model, MESHES["sep2"])
    strategy = autopar.Strategy(context_parallel=RING.context_parallel, recompute=True)
    dist = autopar.compile(seed.main, MESHES["sep2"], startup_program=seed.startup, strategy=strategy)
    forward = [c for c in dist.comm_ops(0) if c.kind == "permute" and c.value.endswith(".kv")]
    assert len(forward) == 2 * LAYERS  # each layer's forward, then its recomputation
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_ring_attention_in_a_pipeline_of_micro_batches_equals_serial(model):
    """pp2 x sep2, the automatic cut, 1F1B over 2 micro-batches: each stage rings its layers'
    cores per micro-batch (GPT-2's dropout: the micro-batch's block of the serial mask)."""
    mesh = M([[0, 1], [2, 3]], ["pp", "sep"])
    seed, feeds = _build(model, mesh)
    pipeline = autopar.PipelineConfig(micro_batches=2, stages=2)
    strategy = autopar.Strategy(context_parallel=RING.context_parallel, pipeline=pipeline)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    for rank in (0, 2):  # one layer per stage: 1 forward, 2 backward permutes
        assert [c.kind for c in dist.comm_ops(rank)].count("permute") == 3
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


def test_a_middle_not_affine_in_the_scores_is_refused_by_name():
    """Soft-capping (Gemma 2: ``tanh(scores / c) * c``) cannot be recomputed block by block with one
    coefficient: refused naming the op."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = MESHES["sep2"]
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 4, 8], "float32")
        q, k, v = (paddle.static.nn.fc(x, 8, num_flatten_dims=2).reshape([2, 4, 2, 4]).transpose([0, 2, 1, 3]) for _ in range(3))
        att = paddle.tanh(paddle.matmul(q, k, transpose_y=True) / 50.0) * 50.0
        out = paddle.matmul(paddle.nn.functional.softmax(att, axis=-1), v)
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(out))
        autopar.shard_tensor(x, mesh, [autopar.Shard(1)])
    with pytest.raises(autopar.AutoparError, match=r"ring attention: pd_op.tanh#\d+ in attention\(matmul#\d+ .*\) is a tanh of the scores"):
        autopar.compile(main, mesh, startup_program=startup, strategy=RING)


@pytest.mark.parametrize(
    "model, mesh, extra",
    [
        ("gpt2", M([[0, 1], [2, 3]], ["dp", "sep"]), {"zero_stage": 3}),
        ("llama", M([[0, 1], [2, 3]], ["pp", "sep"]), {"recompute": True, "pipeline": autopar.PipelineConfig(micro_batches=2, stages=2)}),
    ],
    ids=["zero-3 on dp2 x sep2", "recompute in pp2 x sep2"],
)
def test_ring_attention_composes(model, mesh, extra):
    seed, feeds = _build(model, mesh)
    strategy = autopar.Strategy(context_parallel=RING.context_parallel, **extra)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert "permute" in [c.kind for c in dist.comm_ops(0)]
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)
