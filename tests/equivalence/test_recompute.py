"""Selective recompute equals serial in the simulator (losses every step and parameters after 3
steps, rtol 1e-5): the 2-layer GPT block with dropout in attention and after the MLP, with
attention's softmax + dropout recomputed and with whole layers recomputed, under tensor
parallelism (mp=2), dp=2 x mp=2, ZeRO-1 / 3 and a 1F1B pipeline of two stages with two
micro-batches; and a
program written the way a user writes it (odd sizes, uneven data-parallel split, no
random_seed). The collectives say what recompute costs: attention's recomputation moves nothing,
a recomputed Megatron layer runs its two row-parallel all_reduces again in the backward."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.testing.models import annotate_megatron, gpt_block_program
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import random_feeds, run_serial

MESHES = {
    "mp2": lambda: autopar.ProcessMesh([0, 1], ["mp"]),
    "dp2xmp2": lambda: autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}
SELECTIONS = {"softmax+dropout": ("softmax", "dropout"), "layers": ("TransformerLayer*",), "True": True}


def assert_equal_to_serial(main, startup, loss, dist, feeds):
    start = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [loss])
    paddle.set_rng_state(start)  # the same start for an unseeded program
    serial = run_serial(main, startup, feeds, [loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"loss at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def megatron_gpt(mesh):
    seed = gpt_block_program(batch=4, seq=4, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum",
                             dropout=0.1, layer_calls=True)  # fmt: skip
    annotate_megatron(seed, mesh)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return seed


@pytest.mark.parametrize("selection", list(SELECTIONS), ids=list(SELECTIONS))
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_gpt_with_recompute_equals_serial(mesh, selection):
    mesh = MESHES[mesh]()
    seed = megatron_gpt(mesh)
    plain = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    strategy = autopar.Strategy(recompute=SELECTIONS[selection])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    before, after = plain.comm_ops(0), dist.comm_ops(0)
    if selection == "softmax+dropout":
        assert [(c.kind, c.bytes) for c in after] == [(c.kind, c.bytes) for c in before]
    else:  # each recomputed layer all_reduces its two row-parallel outputs again, read by the clones
        readers = {p.index: p.need.op for p in dist.state.reshards}
        extra = [c for c in after if c.kind == "all_reduce" and readers[c.key.index] in dist.state.recompute.clones]
        assert len(after) == len(before) + 4 and len(extra) == 4
        assert all(c.reason.startswith("recomputed row-parallel output in ") for c in extra), [c.reason for c in extra]
    activations = [r.memory.activations for r in dist.cost.ranks]
    assert all(a < b for a, b in zip(activations, (r.memory.activations for r in plain.cost.ranks)))
    assert_equal_to_serial(seed.main, seed.startup, seed.loss, dist, random_feeds(seed.feeds, 3, classes=32))


@pytest.mark.parametrize("selection", [("relu",), ("Linear*", "relu")], ids=["relu", "chain"])
def test_pipeline_with_recompute_equals_serial(selection):
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = staged_mlp(mesh, widths=(16, 32, 32, 16, 10))
    strategy = autopar.Strategy(recompute=selection, pipeline=autopar.PipelineConfig(micro_batches=2, schedule="1F1B"))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert dist.state.recompute.dropped
    assert [c.kind.value for c in dist.comm_ops(0)] == ["send", "recv"]  # the boundary activation and its gradient
    assert_equal_to_serial(seed.main, seed.startup, seed.loss, dist, random_feeds(seed.feeds, 3, classes=10))


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_gpt_with_zero_and_whole_layers_recomputed_equals_serial(zero_stage):
    """ZeRO-3 gathers a parameter again for each clone that reads it (in the backward)."""
    seed = gpt_block_program(
        batch=4, seq=4, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum", layer_calls=True
    )
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                           strategy=autopar.Strategy(recompute=True, zero_stage=zero_stage))  # fmt: skip
    assert dist.state.recompute.dropped
    assert_equal_to_serial(seed.main, seed.startup, seed.loss, dist, random_feeds(seed.feeds, 3, classes=32))


def test_a_users_program_with_odd_sizes_and_no_seed():
    """Batch 5 over dp=2 (3 + 2 rows), widths 7 / 9 / 3, attention-like softmax, layer norm, gelu;
    no program.random_seed."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [5, 7], "float32")
        label = paddle.static.data("label", [5, 1], "int64")
        up, norm, down = paddle.nn.Linear(7, 9), paddle.nn.LayerNorm(9), paddle.nn.Linear(9, 3)
        h = norm(paddle.nn.functional.gelu(up(x)))
        weights = paddle.nn.functional.softmax(h, axis=-1)
        logits = down(h * weights)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))
        paddle.optimizer.Adam(0.01).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    strategy = autopar.Strategy(recompute=("gelu", "LayerNorm", "softmax"))
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
    assert {v.op.split("#")[0] for v in dist.state.recompute.dropped} == {
        "pd_op.gelu",
        "pd_op.layer_norm",
        "pd_op.softmax",
    }
    assert_equal_to_serial(main, startup, loss, dist, random_feeds({"x": x, "label": label}, 3, classes=3))
