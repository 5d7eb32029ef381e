"""The ops of real LLM / ViT models that had no SPMD rule (issue 24) in one small program,
written the way users write them, compiled with data parallelism and simulated equal to
serial: ``paddle.einsum`` for a projection and for the Llama rotary table
(``einsum("i,j->ij", t, freqs)``), ``swiglu``, ``F.pad``, ``repeat_interleave`` (grouped-query
heads), ``gather_nd`` and a ``take_along_axis`` criterion. Before, each of them ran whole on
every rank: a ParallelismWarning per op, the batch gathered in front of each and the gradient
reduced after. Now no op warns, the batch stays split through all of them (the only
collective is the gradient bucket) and losses and parameters equal serial."""

import warnings

import numpy as np
import pytest

import autopar
from autopar.errors import ParallelismWarning
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.serial import assert_simulation_equals_serial

DP = autopar.ProcessMesh([0, 1], ["dp"])
PP = autopar.ProcessMesh([0, 1], ["pp"])
BATCH, SEQ, DIM, HEADS, VOCAB = 4, 6, 8, 2, 5


def _llm_ops_model(mesh=DP):
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 5
    F = paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [BATCH, SEQ, DIM], "float32")
        labels = paddle.static.data("labels", [BATCH, SEQ], "int64")
        if mesh is not None:
            autopar.shard_tensor(x, mesh, ["dp", None, None])
            autopar.shard_tensor(labels, mesh, ["dp", None])
        w_gate, w_up = (paddle.create_parameter([DIM, 2 * DIM], "float32") for _ in range(2))
        w_out = paddle.create_parameter([DIM, VOCAB], "float32")
        positions = paddle.arange(SEQ, dtype="float32")
        freqs = 1.0 / (10000.0 ** (paddle.arange(0, DIM, 2, dtype="float32") / DIM))
        angles = paddle.einsum("i,j->ij", positions, freqs)  # the rotary table [SEQ, DIM / 2]
        table = paddle.concat([paddle.cos(angles), paddle.sin(angles)], axis=-1)  # [SEQ, DIM]
        h = x * table
        h = F.swiglu(paddle.einsum("bsh,hd->bsd", h, w_gate), paddle.einsum("bsh,hd->bsd", h, w_up))  # [B, S, 2 DIM]
        heads = h.reshape([BATCH, SEQ, HEADS, 2 * DIM // HEADS])
        heads = paddle.repeat_interleave(heads, 2, axis=2)  # grouped-query heads: [B, S, 2 HEADS, 2 DIM / HEADS]
        h = F.pad(heads.reshape([BATCH, SEQ, 4 * DIM]), [0, 0, 1, 0, 0, 0])[:, :SEQ]  # shift right by one step
        steps = paddle.to_tensor(np.array([[0], [2], [5]], "int64"))  # three steps of every sample
        picked = paddle.gather_nd(h.transpose([1, 0, 2]), steps)  # [3, B, 4 DIM]
        logits = paddle.einsum("bsh,hv->bsv", h[:, :, :DIM], w_out) + picked.mean(axis=0).unsqueeze(1)[:, :, :VOCAB]
        logp = F.log_softmax(logits, axis=-1)
        loss = -paddle.take_along_axis(logp, labels.unsqueeze(-1), axis=-1).mean()
        make_optimizer("sgd").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "labels": labels}, loss, values={"rotary": angles, "heads": heads})


def test_llm_ops_keep_data_parallelism_and_equal_serial():
    seed = _llm_ops_model()
    names = {op.name() for op in seed.main.global_block().ops}
    for op in ("einsum", "einsum_grad", "swiglu_grad", "pad_grad", "repeat_interleave_grad", "gather_nd_grad", "take_along_axis_grad"):
        assert f"pd_op.{op}" in names, op  # the program really holds them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = autopar.compile(seed.main, DP, startup_program=seed.startup)
    assert [str(w.message) for w in caught if issubclass(w.category, ParallelismWarning)] == []
    assert {c.kind.value for c in dist.comm_ops(0)} == {"all_reduce"}  # the gradient bucket only: nothing gathered
    assert str(dist.dist_attr(seed.values["heads"])) == "[S(0)]"
    assert dist.dist_attr(seed.values["rotary"]).is_replicated
    assert_simulation_equals_serial(seed, dist, classes=VOCAB)


def _layered_model(data_parallel=False):
    """Two blocks (einsum projections, swiglu, grouped-query repeat, a shifted residual) and an
    einsum head with a take_along_axis criterion, as ``nn.Layer`` calls: what pipeline stages
    and recomputation are cut along. The residual is written ``update + h``: Paddle 3.3.1's
    in-place pass turns ``h + update`` into ``add_`` on h, whose buffer einsum's grad cache
    still aliases, and the serial run itself then gets wrong gradients for the block's
    weights (``FLAGS_pir_apply_inplace_pass=0`` avoids it)."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 5
    F = paddle.nn.functional

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.gate, self.up = self.create_parameter([DIM, DIM]), self.create_parameter([DIM, DIM])

        def forward(self, h):
            a = F.swiglu(paddle.einsum("bsh,hd->bsd", h, self.gate), paddle.einsum("bsh,hd->bsd", h, self.up))
            a = paddle.repeat_interleave(a.reshape([BATCH, SEQ, 2, DIM // 2]), 2, axis=2).reshape([BATCH, SEQ, 2 * DIM])
            return F.pad(a[:, :, :DIM], [0, 0, 1, 0, 0, 0])[:, :SEQ] + h

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = paddle.nn.LayerList([Block() for _ in range(2)])
            self.head = self.create_parameter([DIM, VOCAB])

        def forward(self, h):
            for block in self.blocks:
                h = block(h)
            return paddle.einsum("bsh,hv->bsv", h, self.head)

    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [BATCH, SEQ, DIM], "float32")
        labels = paddle.static.data("labels", [BATCH, SEQ], "int64")
        if data_parallel:
            autopar.shard_tensor(x, DP, ["dp", None, None])
            autopar.shard_tensor(labels, DP, ["dp", None])
        logp = F.log_softmax(Net()(x), axis=-1)
        loss = paddle.mean(-paddle.take_along_axis(logp, labels.unsqueeze(-1), axis=-1))
        make_optimizer("sgd").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "labels": labels}, loss)


@pytest.mark.parametrize(
    "mesh, strategy",
    [
        (PP, autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))),
        (DP, autopar.Strategy(recompute=True)),
    ],
    ids=["pipeline of two micro-batches", "recompute"],
)
def test_llm_ops_run_per_micro_batch_and_recomputed(mesh, strategy):
    """Micro-batching cuts every op of the batch (einsum's caches are made per micro-batch by
    its forward and read by its grad in the same micro-batch); recomputation clones einsum with
    its caches. Both equal serial."""
    seed = _layered_model(data_parallel=mesh is DP)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    if mesh is DP:
        assert str(dist.dist_attr(seed.feeds["x"])) == "[S(0)]"
        assert {c.kind.value for c in dist.comm_ops(0)} == {"all_reduce"}
    assert_simulation_equals_serial(seed, dist, classes=VOCAB)


def test_expand_as_linspace_and_label_smooth_keep_data_parallelism():
    """A class token broadcast with ``expand_as`` to the split batch, a ``linspace`` table and a
    ``label_smooth``ed target: no op warns, the only collective is the gradient bucket, and the
    run equals serial."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [BATCH, SEQ, DIM], "float32")
        label = paddle.static.data("label", [BATCH, SEQ, DIM], "float32")
        linear = paddle.nn.Linear(DIM, DIM)
        cls = paddle.create_parameter([1, 1, DIM], "float32")
        h = linear(x) + paddle.expand_as(cls, x) * paddle.linspace(0.0, 1.0, DIM)
        target = paddle.nn.functional.label_smooth(paddle.nn.functional.softmax(label), epsilon=0.1)
        loss = paddle.mean((h - target) ** 2)
        make_optimizer("sgd").minimize(loss)
    seed = SeedProgram(main, startup, {"x": x, "label": label}, loss, {"linear": linear})
    autopar.shard_tensor(x, DP, ["dp", None, None])
    autopar.shard_tensor(label, DP, ["dp", None, None])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParallelismWarning)
        dist = autopar.compile(main, DP, startup)
    assert [c.kind.value for c, _ in dist.rank_plan(0).collectives] == ["all_reduce"]
    assert_simulation_equals_serial(seed, dist)
