"""Vocabulary-parallel embedding and LM head (Megatron) in the simulator: equal to serial, and
the head moves O(B·S) values.

A GPT written the way a user writes it (autopar.testing.models.gpt_block_program): Megatron
blocks, the embedding table annotated ``["mp", None]`` (vocabulary split) and the LM head's
weight ``[None, "mp"]`` (class-split logits), on mp=2 and dp=2 x mp=2. Losses every step,
the gradients of the table and of the head (fetched), and every parameter after the steps
equal serial, rtol 1e-5 (fp32). The collectives of rank 0 show the head's cost: one
all_gather of three values per row (each rank's max, sum of exponentials, target logit) where
gathering the logits moved B·S·V. Also: ZeRO 1/2/3 beside it, a class-split head inside a pipeline
stage, GPT-2's tied embedding and head; smaller programs cover softmax / log_softmax over a
split axis, a padding row, an uneven vocabulary split, ignored labels and a class axis that is
not the last.
"""

import numpy as np
import pytest

import autopar
from autopar.graph import OPTIMIZER_OPS
from autopar.testing.models import SeedProgram, annotate_megatron, gpt_block_program, make_optimizer
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import random_feeds, run_serial

B, S, H, HEADS, V = 4, 4, 16, 2, 64
MESHES = {
    "mp2": autopar.ProcessMesh([0, 1], ["mp"]),
    "dp2xmp2": autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}


def gradient_of(program, parameter):
    """The serial Value of ``parameter``'s gradient (what its optimizer op reads)."""
    for op in program.global_block().ops:
        if op.name() in OPTIMIZER_OPS:
            param = op.operand_source(0).get_defining_op()
            if param.name() == "builtin.parameter" and param.attrs()["parameter_name"] == parameter:
                return op.operand_source(1)
    raise AssertionError(f"no optimizer op updates {parameter}")


def assert_equal_serial(seed, dist, feeds, grads=(), rtol=1e-5, atol=1e-6):
    """Losses and the gradients of ``grads`` every step, parameters after the last, vs serial."""
    fetch = [seed.loss] + [gradient_of(seed.main, name) for name in grads]
    serial = run_serial(seed.main, seed.startup, feeds, fetch)
    result = autopar.simulate(dist, feeds, fetch)
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        for name, w, g in zip(["loss", *grads], want, got):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * 0.1, err_msg=f"{name} at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)


def gpt(mesh, vocab_parallel=True, optimizer="momentum", batch=B, vocab=V):
    seed = gpt_block_program(batch=batch, seq=S, hidden=H, heads=HEADS, vocab=vocab, layers=2, optimizer=optimizer)
    annotate_megatron(seed, mesh)
    if vocab_parallel:
        autopar.shard_tensor(seed.layers["embedding"].weight, mesh, ["mp", None])
        autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, "mp"])
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return seed


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
@pytest.mark.parametrize("batch, vocab", [(2, 24), (B, V)], ids=["test_simulator-sizes", "V64"])
def test_gpt_vocab_parallel_equals_serial(mesh, optimizer, batch, vocab):
    """rtol 1e-5 (atol 1e-6 on parameters, 1e-7 on the loss and gradients: entries near zero
    differ by float reassociation, as under plain Megatron); test_simulator's GPT sizes too."""
    seed = gpt(mesh, optimizer=optimizer, batch=batch, vocab=vocab)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert not dist.report.unsupported_ops
    assert str(dist.dist_attr(seed.layers["embedding"].weight.name)) in ("[S(0)]", "[R,S(0)]")
    grads = [seed.layers[n].weight.name for n in ("embedding", "head")] + [seed.layers["head"].bias.name]
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=vocab), grads)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_vocab_parallel_with_zero(stage):
    """ZeRO over dp beside the vocabulary split over mp (stage 3 gathers the table over dp only)."""
    mesh = MESHES["dp2xmp2"]
    seed = gpt(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=stage))
    assert len(head_collectives(dist)) == 1
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=V), [seed.layers["embedding"].weight.name])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_class_split_head_inside_a_pipeline_stage(micro_batches):
    """pp=2 x mp=2, the last stage's head column-split: its cross-entropy is rewritten on the
    stage's ranks, once per micro-batch, in the forward phase (its grad in the backward)."""
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10))
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh[0], [None, "mp"])
    autopar.shard_tensor(seed.layers["linear2"].weight, mesh[0], ["mp", None])
    autopar.shard_tensor(seed.layers["linear4"].weight, mesh[1], [None, "mp"])
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    rows = 12 // micro_batches
    assert [(c.kind, c.bytes) for c in head_collectives(dist, 2)] == [("all_gather", 2 * 3 * rows * 4)]
    assert not head_collectives(dist, 0)  # stage 0 has no head
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=10))


def head_collectives(dist, rank=0):
    return [c for c in dist.comm_ops(rank) if c.key.source == "vocab" and "cross_entropy" in c.reason]


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_gpt_head_moves_one_value_per_row(mesh):
    """The head's cross-entropy: one all_gather of 3 x B·S/dp values per rank (max, sum-exp,
    target logit), no other all_gather anywhere (neither logits nor table); gathering the logits
    moves V/(3·mp) x more."""
    seed = gpt(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    rows = B // mesh.dim_size("dp") * S if "dp" in mesh.dim_names else B * S
    head = head_collectives(dist)
    assert [(c.kind, c.bytes) for c in head] == [("all_gather", mesh.dim_size("mp") * 3 * rows * 4)]
    assert all(c.group in ((0, 1), (0, 2)) and len(c.group) == mesh.dim_size("mp") for c in head)
    ops = dist.comm_ops(0)
    assert not [c for c in ops if c.kind == "all_gather" and c not in head], [str(c) for c in ops]
    activations = [c for c in ops if c.key.source != "bucket"]  # gradient buckets aside
    assert max(c.bytes for c in activations) == rows * H * 4  # nothing of the logits' size (rows x V)
    table = dist.dist_attr(seed.layers["embedding"].weight.name)
    assert table.mapping[0] == (mesh.mesh_dim("mp"),)

    gathered = gpt(mesh)  # the same head, logits annotated whole on the class axis: today's gather
    autopar.shard_tensor(_logits(gathered), mesh, ["dp" if "dp" in mesh.dim_names else None, None, None])
    old = autopar.compile(gathered.main, mesh, startup_program=gathered.startup)
    logits_gather = [c for c in old.comm_ops(0) if c.kind == "all_gather" and c.shape == (B, S, V)]
    assert [c.bytes for c in logits_gather] == [rows * V * 4] and not head_collectives(old)
    assert sum(c.bytes for c in head) * V // (3 * mesh.dim_size("mp")) == sum(c.bytes for c in logits_gather)


def _logits(seed):
    """The head's output (the cross-entropy's logits) in a gpt_block_program."""
    for op in seed.main.global_block().ops:
        if op.name() == "pd_op.cross_entropy_with_softmax":
            return op.operand_source(0)
    raise AssertionError("no cross_entropy_with_softmax")


# ---- smaller programs -----------------------------------------------------------------------


def _program(build, optimizer="sgd", seed=7):
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        feeds, loss, layers = build(paddle)
        make_optimizer(optimizer, lr=0.1).minimize(loss)
    return SeedProgram(main, startup, feeds, loss, layers)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_over_a_split_axis(name, tmp_path):
    """Column-parallel linear -> softmax over its split output -> row-parallel linear: the
    softmax keeps the split (2 all_reduces of one value per row forward, 1 backward)."""

    def build(paddle):
        x = paddle.static.data("x", [6, 8], "float32")
        up, down = paddle.nn.Linear(8, 12), paddle.nn.Linear(12, 5)
        h = getattr(paddle.nn.functional, name)(up(x), axis=-1)
        return {"x": x}, paddle.mean(paddle.square(down(h))), {"up": up, "down": down}

    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    seed = _program(build)
    autopar.shard_tensor(seed.layers["up"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(seed.layers["up"].bias, mesh, ["mp"])
    autopar.shard_tensor(seed.layers["down"].weight, mesh, ["mp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    rows = [c for c in dist.comm_ops(0) if c.key.source == "vocab"]
    assert [(c.kind, c.reduce, c.bytes) for c in rows] == [
        ("all_reduce", "max", 24),
        ("all_reduce", "sum", 24),
        ("all_reduce", "sum", 24),
    ]
    assert not [c for c in dist.comm_ops(0) if c.kind == "all_gather"]
    grads = [seed.layers["up"].weight.name, seed.layers["down"].weight.name]
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3), grads)
    text = dist.dump_diff(tmp_path, ranks=[0], svg=False).diffs[0].read_text()  # the rewrite reads in the diff
    assert text.count("all_reduce(max)") == 1 and text.count("with its normalized axis split over mp") == 3


@pytest.mark.parametrize(
    "mesh, table, ids",
    [
        (autopar.ProcessMesh([0, 1, 2], ["mp"]), ["mp", None], None),  # 7 rows over 3: 3 / 2 / 2
        (autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), ["mp", None], ["dp", None]),
        (autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), [("dp", "mp"), None], None),  # rows over all 4
    ],
    ids=["uneven-mp3", "dp2xmp2", "rows-over-dp-and-mp"],
)
@pytest.mark.parametrize("padding_idx", [None, 2, 6])
def test_embedding_rows_split(mesh, table, ids, padding_idx):
    """A table of 7 rows split over ranks, a padding row on one rank: lookups, the table's
    gradient and its updates equal serial."""

    def build(paddle):
        x = paddle.static.data("ids", [4, 3], "int64")
        emb, proj = paddle.nn.Embedding(7, 5, padding_idx=padding_idx), paddle.nn.Linear(5, 3)
        return {"ids": x}, paddle.mean(paddle.square(proj(emb(x)))), {"embedding": emb}

    seed = _program(build, "momentum")
    autopar.shard_tensor(seed.layers["embedding"].weight, mesh, table)
    if ids:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ids)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert not [c for c in dist.comm_ops(0) if c.shape == (7, 5) and c.kind == "all_gather"]  # the table stays split
    feeds = random_feeds(seed.feeds, 3, classes=7)
    assert_equal_serial(seed, dist, feeds, [seed.layers["embedding"].weight.name])


def test_cross_entropy_over_classes_not_last_with_ignored_labels():
    """Logits ``[B, V, S]`` (class axis 1) split over mp, some labels ignored (-100): loss
    and logits' gradient equal serial; the ignored rows give no loss and no gradient."""

    def build(paddle):
        x = paddle.static.data("x", [3, 4, 8], "float32")
        label = paddle.static.data("label", [3, 1, 4], "int64")
        head = paddle.nn.Linear(8, 10)
        logits = paddle.transpose(head(x), [0, 2, 1])
        loss = paddle.nn.functional.cross_entropy(logits, label, axis=1, reduction="none")
        return {"x": x, "label": label}, paddle.mean(loss), {"head": head}

    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    seed = _program(build)
    autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, "mp"])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert [c.kind for c in dist.comm_ops(0) if c.key.source == "vocab"] == ["all_gather"]
    assert not [c for c in dist.comm_ops(0) if c.kind == "all_gather" and c.key.source != "vocab"]
    feeds = random_feeds(seed.feeds, 3, classes=10)
    for feed in feeds:
        feed["label"][0, 0, :2] = -100
    assert_equal_serial(seed, dist, feeds, [seed.layers["head"].weight.name, seed.layers["head"].bias.name])


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_tied_embedding_and_head(mesh):
    """GPT-2's weight tying: the head reads the vocabulary-split table itself (``h @ table^T``):
    class-split logits, the table's gradient summed from the lookup and the head, both split."""

    def build(paddle):
        ids = paddle.static.data("ids", [4, 6], "int64")
        label = paddle.static.data("label", [4, 6, 1], "int64")
        emb, mid = paddle.nn.Embedding(20, 8), paddle.nn.Linear(8, 8)
        logits = paddle.matmul(paddle.tanh(mid(emb(ids))), emb.weight, transpose_y=True)
        return (
            {"ids": ids, "label": label},
            paddle.mean(paddle.nn.functional.cross_entropy(logits, label)),
            {"embedding": emb},
        )

    seed = _program(build, "momentum")
    autopar.shard_tensor(seed.layers["embedding"].weight, mesh, ["mp", None])
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
        autopar.shard_tensor(seed.feeds["label"], mesh, ["dp", None, None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert len(head_collectives(dist)) == 1
    assert not [c for c in dist.comm_ops(0) if c.kind == "all_gather" and c.key.source != "vocab"]
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=20), [seed.layers["embedding"].weight.name])


def test_classes_split_over_two_mesh_dims():
    """The head's classes over dp and mp (4 pieces): each rank's per-row values are gathered
    over both, equal to serial."""

    def build(paddle):
        x = paddle.static.data("x", [3, 4, 8], "float32")
        label = paddle.static.data("label", [3, 4, 1], "int64")
        head = paddle.nn.Linear(8, 10)
        return {"x": x, "label": label}, paddle.mean(paddle.nn.functional.cross_entropy(head(x), label)), {"head": head}

    mesh = MESHES["dp2xmp2"]
    seed = _program(build)
    autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, ("dp", "mp")])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    (head,) = head_collectives(dist)
    assert head.kind == "all_gather" and head.group == (0, 1, 2, 3)
    assert head.value.rsplit(".", 1)[-1] == "row_max_sum_of_exponentials_and_target_logit"
    assert head.bytes == 4 * 3 * 12 * 4  # the 12 rows' 3 values of each of the 4 ranks
    assert_equal_serial(seed, dist, random_feeds(seed.feeds, 3, classes=10), [seed.layers["head"].weight.name])
