"""Sequence parallelism (Megatron-SP) in the simulator: equal to serial, and the collectives TP
had, traded for all_gathers and reduce_scatters of the same volume.

A GPT of two blocks (autopar.testing.models.gpt_block_program) with Megatron weights
(annotate_megatron) on mp=2 and dp=2 x mp=2, with and without ``Strategy(sequence_parallel=
True)``: losses every step and parameters after the last equal serial (rtol 1e-5, fp32). From
rank 0's comm_ops: every all_reduce of an activation becomes one reduce_scatter (row-parallel
output) and one all_gather (column-parallel input) forward and the mirror pair backward; the
ring volume per layer is TP's exactly; the only other collectives are the region's two edges
(gathering the last norm's output for the LM head, the embedding's gradient out of the
region) and one fused all_reduce of the parameters applied inside the region (norms, row-
parallel biases), as in Megatron. A program written as a user would (pre-norm blocks, dropout
on the residual, odd sizes, unseeded start-up) runs too; so do SP with selective recompute and
SP inside pipeline stages (pp=2 x mp=2).
"""

import numpy as np
import pytest

import autopar
from autopar.cost_model.comm import coefficients
from autopar.errors import AutoparError
from autopar.testing.models import annotate_megatron, gpt_block_program, make_optimizer
from autopar.testing.pipeline_models import residual_blocks
from autopar.testing.serial import random_feeds, run_serial

B, S, H, HEADS, V = 4, 4, 16, 2, 64
MESHES = {
    "mp2": autopar.ProcessMesh([0, 1], ["mp"]),
    "dp2xmp2": autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}


def megatron_gpt(mesh, optimizer="momentum", layers=2, seq=S):
    seed = gpt_block_program(batch=B, seq=seq, hidden=H, heads=HEADS, vocab=V, layers=layers, optimizer=optimizer)
    annotate_megatron(seed, mesh)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return seed


def assert_equal_serial(seed, dist, feeds, rtol=1e-5, atol=1e-6):
    """From the same generator state (an unseeded start-up draws from it)."""
    import paddle

    state = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [seed.loss])
    paddle.set_rng_state(state)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol * 0.1, err_msg=f"loss at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)


def ring_volume(collectives, group):
    return sum(coefficients(str(c.kind), group, c.bytes)[1] for c in collectives)


def activation_collectives(dist, rank=0):
    """Collectives of activations (not the gradient buckets / optimizer reads of parameters)."""
    return [c for c in dist.comm_ops(rank) if "gradient all_reduces fused" not in c.reason and "grad(" not in c.reason]


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_gpt_sequence_parallel_equals_serial(mesh, optimizer):
    """(Not Adam here: the keys' bias has an exactly-zero gradient — softmax ignores a constant
    added to every key — so any reassociation gives it a +-1e-9 gradient that Adam turns into a
    +-lr step, under plain tensor parallelism as much as with SP.)"""
    seed = megatron_gpt(mesh, optimizer)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel=True))
    regions = dist.state.sequence
    assert regions is not None and regions.axis == "mp"
    # residual stream, norms and row-parallel bias adds: 5 per block (2 adds, 1 norm, twice... see the test below)
    assert sum(v.seq_dim is not None for v in regions.values) >= 8
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=V))


def test_sequence_parallel_trades_each_all_reduce_for_a_gather_and_a_scatter():
    """Per block, TP's 4 all_reduces (2 forward, 2 backward) become 4 reduce_scatters and 4
    all_gathers of the same tensors: the same ring volume. On a GPU profile (a reduce_scatter is
    priced as one; gloo lowers it to an all_reduce)."""
    mesh = MESHES["mp2"]
    strategy = {sp: autopar.Strategy(sequence_parallel=sp, cluster="h100-node") for sp in (False, True)}
    seed = megatron_gpt(mesh)
    tp = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy[False])
    sp = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy[True])
    tp_acts, sp_acts = activation_collectives(tp), activation_collectives(sp)
    assert {c.kind for c in tp_acts} == {"all_reduce"} and len(tp_acts) == 8  # 2 blocks x (2 forward + 2 backward)
    assert not [c for c in tp.comm_ops(0) if c not in tp_acts]  # TP alone: every gradient is complete on mp
    kinds = [c.kind for c in sp_acts]
    assert kinds.count("reduce_scatter") == 8
    # 7 of the blocks' 8 all_gathers (the first block's column-parallel input is the embedding's
    # output, whole already) + the last norm's output for the head + the embedding's gradient
    assert kinds.count("all_gather") == 9 and set(kinds) == {"reduce_scatter", "all_gather"}
    assert {c.bytes for c in sp_acts} == {B * S * H * 4}
    blocks = [c for c in sp_acts if "layer_norm" not in c.reason and "annotated" not in c.reason]
    assert ring_volume(blocks, 2) + B * S * H * 4 / 2 == ring_volume(tp_acts, 2)  # + the one the embedding saved
    # the region's own parameters (2 norms x (scale, bias) + 2 row-parallel biases per block):
    # their gradients are sums over the sequence pieces, all-reduced once, fused
    params = [c for c in sp.comm_ops(0) if c not in sp_acts]
    assert len(params) == 1 and "12 gradient all_reduces fused" in params[0].reason
    assert params[0].bytes == 2 * (4 * H + 2 * H) * 4


def test_sequence_parallel_splits_the_norm_activations():
    """The norms' inputs and outputs are split along the sequence on mp: each rank keeps 1/2."""
    mesh = MESHES["mp2"]
    seed = megatron_gpt(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel=True))
    norms = [op for op in dist.graph.ops if op.name == "pd_op.layer_norm"]
    assert len(norms) == 4
    for op in norms[:-1]:  # the last norm's output leaves the region (the head reads it whole)
        assert str(dist.propagation.dist(op.outputs[0])) == "[S(1)]"
        assert str(dist.propagation.dist(op.inputs[0])) == "[S(1)]"


def test_explain_names_the_split_values_and_the_edges():
    from autopar.cli import explain_text

    mesh = MESHES["mp2"]
    seed = megatron_gpt(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel="mp"))
    text = explain_text(dist)
    assert "sequence parallel over 'mp'" in text
    assert "the sequence-parallel region ends" in text and "gathered where backward leaves the region" in text


def test_sequence_parallel_needs_a_tensor_parallel_axis():
    mesh = MESHES["dp2xmp2"]
    seed = gpt_block_program(batch=B, seq=S, hidden=H, heads=HEADS, vocab=V, layers=1)
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    with pytest.raises(AutoparError, match="needs tensor parallelism"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel=True))
    with pytest.raises(AutoparError, match="no dim of that name.*'dp', 'mp'"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel="tp"))
    with pytest.raises(AutoparError, match="sequence_parallel must be"):
        autopar.Strategy(sequence_parallel=1)


def pre_norm_gpt(mesh, batch=3, seq=6, hidden=12, heads=3, vocab=29, dropout=0.1):
    """A user's own block: pre-norm, dropout on the residual branches, odd sizes, unseeded start-up."""
    import paddle

    paddle.enable_static()
    nn, F = paddle.nn, paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = 11  # dropout's masks (autopar refuses unseeded dropout); the start-up is unseeded
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        h = nn.Embedding(vocab, hidden)(ids)
        for _ in range(2):
            qkv, proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            up, down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
            for w, dims in ((qkv.weight, [None, "mp"]), (qkv.bias, ["mp"]), (proj.weight, ["mp", None]),
                            (up.weight, [None, "mp"]), (up.bias, ["mp"]), (down.weight, ["mp", None])):  # fmt: skip
                autopar.shard_tensor(w, mesh, dims)
            x = paddle.reshape(qkv(nn.LayerNorm(hidden)(h)), [batch, seq, heads, 3 * (hidden // heads)])
            q, k, v = paddle.split(paddle.transpose(x, [0, 2, 1, 3]), 3, axis=-1)
            ctx = paddle.matmul(F.softmax(paddle.matmul(q, k, transpose_y=True), axis=-1), v)
            h = h + F.dropout(proj(paddle.reshape(paddle.transpose(ctx, [0, 2, 1, 3]), [batch, seq, hidden])), dropout)
            h = h + F.dropout(down(F.relu(up(nn.LayerNorm(hidden)(h)))), dropout)
        logits = nn.Linear(hidden, vocab)(nn.LayerNorm(hidden)(h))
        loss = paddle.mean(F.cross_entropy(logits, label))
        make_optimizer("sgd", lr=0.1).minimize(loss)
    return main, startup, {"ids": ids, "label": label}, loss


def test_a_users_pre_norm_block_with_dropout_and_odd_sizes():
    """seq 6 over mp=2, hidden 12, 3 heads, vocab 29; dropout on the split residual draws its
    slice of the serial mask (no collective); unseeded start-up."""
    from autopar.testing.models import SeedProgram

    mesh = MESHES["mp2"]
    main, startup, feeds, loss = pre_norm_gpt(mesh)
    seed = SeedProgram(main, startup, feeds, loss)
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(sequence_parallel=True))
    dropouts = [op for op in dist.graph.ops if op.name == "pd_op.dropout"]
    assert dropouts and all(str(dist.propagation.dist(op.outputs[0])) == "[S(1)]" for op in dropouts)
    assert not [c for c in dist.comm_ops(0) if "dropout" in c.reason]
    assert_equal_serial(seed, dist, random_feeds(feeds, 3, classes=29))


def test_sequence_parallel_inside_pipeline_stages():
    """pp=2 x mp=2, two micro-batches: each stage's residual stream split along the sequence on
    its own mp pair; the activation sent between the stages is the split one (half the bytes)."""
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    pipeline = autopar.PipelineConfig(micro_batches=2)
    sent = {}
    for sp in (False, True):
        seed = residual_blocks(mesh, tensor_parallel="mp")
        strategy = autopar.Strategy(pipeline=pipeline, sequence_parallel=sp)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        sent[sp] = [c.bytes for c in dist.comm_ops(0) if c.kind == "send"]
    kinds = {c.kind for c in dist.comm_ops(0)}
    assert {"reduce_scatter", "all_gather"} <= kinds
    assert sent[True] == [b // 2 for b in sent[False]]
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=5))


def test_sequence_parallel_in_a_gpt_cut_into_stages():
    """The GPT with its weights annotated on the whole pp x mp mesh, PipelineConfig(stages=2)."""
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    seed = megatron_gpt(mesh)
    pipeline = autopar.PipelineConfig(micro_batches=2, stages=2)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                           strategy=autopar.Strategy(pipeline=pipeline, sequence_parallel=True))  # fmt: skip
    assert dist.state.sequence.axis == "mp" and "reduce_scatter" in {c.kind for c in dist.comm_ops(2)}
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=V))


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("recompute", [("softmax", "dropout"), True], ids=["softmax+dropout", "layers"])
def test_sequence_parallel_with_recompute_equals_serial(mesh, recompute):
    """TP + SP + selective recompute, with dropout in attention and after the MLP: the
    recomputed dropout reuses the forward's mask slice."""
    seed = gpt_block_program(batch=B, seq=S, hidden=H, heads=HEADS, vocab=V, layers=2, optimizer="momentum", dropout=0.1)
    annotate_megatron(seed, mesh)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    strategy = autopar.Strategy(sequence_parallel=True, recompute=recompute)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert {"reduce_scatter", "all_gather"} <= {c.kind for c in dist.comm_ops(0)}
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=V))
