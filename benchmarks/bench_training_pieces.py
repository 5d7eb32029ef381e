"""Bytes moved per training step with and without each training piece (issue 10).

    .venv/bin/python benchmarks/bench_training_pieces.py

For each row, the same program is compiled without and with one piece a training loop adds
(global-norm gradient clipping; the vocabulary-parallel embedding and LM head, against the
logits gathered for the cross-entropy; batch norm and dropout are further rows of
:data:`ROWS`; ``Strategy(local_batch_norm=True)`` against exact batch norm), and the collectives rank 0 runs per step are summed from
``dist.comm_ops(0)``: bytes and count. Compile-time figures (no run): the plan is the truth
the runtime executes. The ``moved by the piece`` column lists the collectives the piece adds
(kind and bytes), or ``-``.

Models: a GPT block (embedding, attention, MLP, layer norms, LM head; AdamW) and SimpleNet
(Linear 256->1024->256->10; Momentum), on dp=2 (batch split), mp=2 (Megatron weights /
column + row parallel linears) and dp=2 x mp=2.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import SeedProgram, annotate_megatron  # noqa: E402
from autopar.units import format_bytes  # noqa: E402

MESHES = {
    "dp=2": autopar.ProcessMesh([0, 1], ["dp"]),
    "mp=2": autopar.ProcessMesh([0, 1], ["mp"]),
    "dp=2 x mp=2": autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}


# ---- programs: ``build(piece_on)`` -> SeedProgram ------------------------------------------------


def _optimizer(name: str, clip: bool):
    import paddle

    grad_clip = paddle.nn.ClipGradByGlobalNorm(1.0) if clip else None
    if name == "adamw":
        return paddle.optimizer.AdamW(0.01, weight_decay=0.01, grad_clip=grad_clip)
    return paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=grad_clip)


def gpt(clip: bool, batch: int = 4, seq: int = 16, hidden: int = 64, heads: int = 4, vocab: int = 256) -> SeedProgram:
    """One GPT block: embedding, attention + MLP with layer norms, LM head; AdamW."""
    import paddle

    paddle.enable_static()
    nn, F = paddle.nn, paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    head_dim = hidden // heads
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        mods = {
            "embedding": nn.Embedding(vocab, hidden), "qkv0": nn.Linear(hidden, 3 * hidden), "proj0": nn.Linear(hidden, hidden),
            "fc1_0": nn.Linear(hidden, 4 * hidden), "fc2_0": nn.Linear(4 * hidden, hidden), "ln1_0": nn.LayerNorm(hidden),
            "ln2_0": nn.LayerNorm(hidden), "head": nn.Linear(hidden, vocab),
        }  # fmt: skip
        h = mods["embedding"](ids)
        x = paddle.transpose(paddle.reshape(mods["qkv0"](h), [batch, seq, heads, 3 * head_dim]), [0, 2, 1, 3])
        q, k, v = paddle.split(x, 3, axis=-1)
        att = F.softmax(paddle.matmul(q, k, transpose_y=True) * head_dim**-0.5, axis=-1)
        ctx = paddle.reshape(paddle.transpose(paddle.matmul(att, v), [0, 2, 1, 3]), [batch, seq, hidden])
        h = mods["ln1_0"](h + mods["proj0"](ctx))
        h = mods["ln2_0"](h + mods["fc2_0"](F.gelu(mods["fc1_0"](h))))
        loss = paddle.mean(F.cross_entropy(mods["head"](h), label))
        _optimizer("adamw", clip).minimize(loss)
    return SeedProgram(main, startup, {"ids": ids, "label": label}, loss, mods)


def simple_net(clip: bool, batch: int = 64, sizes: tuple[int, ...] = (256, 1024, 256, 10)) -> SeedProgram:
    """SimpleNet: Linear 256->1024->256->10 with ReLU, cross-entropy; Momentum."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, sizes[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        layers, h = {}, x
        for i in range(len(sizes) - 1):
            layers[f"linear{i + 1}"] = layer = paddle.nn.Linear(sizes[i], sizes[i + 1])
            h = layer(h)
            if i < len(sizes) - 2:
                h = paddle.nn.functional.relu(h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(h, label))
        _optimizer("momentum", clip).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers)


# ---- annotations: the parallelism of a row --------------------------------------------------------


def annotate(seed: SeedProgram, mesh: autopar.ProcessMesh) -> None:
    """Batch split over ``dp``; Megatron weights (GPT) or column + row parallel linear1 /
    linear2 (SimpleNet) over ``mp``."""
    if "dp" in mesh.dim_names:
        feed = seed.feeds["ids"] if "ids" in seed.feeds else seed.feeds["x"]
        autopar.shard_tensor(feed, mesh, ["dp"] + [None] * (len(feed.shape) - 1))
    if "mp" not in mesh.dim_names:
        return
    if "qkv0" in seed.layers:
        annotate_megatron(seed, mesh)
    else:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])


# ---- rows -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One measurement: ``build(piece_on)`` makes the program, ``mesh`` the parallelism."""

    piece: str
    model: str
    mesh: str
    build: Callable[[bool], SeedProgram]
    strategy: autopar.Strategy | None = None  # the piece is a Strategy field: compiled with it when on

    def compile(self, piece_on: bool) -> autopar.DistributedProgram:
        seed = self.build(piece_on)
        mesh = MESHES[self.mesh]
        annotate(seed, mesh)
        strategy = self.strategy if piece_on else None
        return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def vocab_parallel_gpt(mesh_name: str) -> Callable[[bool], SeedProgram]:
    """The GPT block's embedding and LM head on ``mesh_name``: with the piece, the table split
    on the vocabulary (``["mp", None]``) and the head's weight on the classes (``[None, "mp"]``),
    so the cross-entropy finishes its split rows with three all_reduces of B·S values; without
    it, the same column-split head with its logits gathered for the cross-entropy (annotated
    whole on the class axis) and the table whole: what autopar did before vocabulary parallelism."""

    def build(vocab_parallel: bool) -> SeedProgram:
        seed = gpt(clip=False)
        mesh = MESHES[mesh_name]
        autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, "mp"])
        if vocab_parallel:
            autopar.shard_tensor(seed.layers["embedding"].weight, mesh, ["mp", None])
        else:
            logits = next(op.operand_source(0) for op in seed.main.global_block().ops if op.name() == "pd_op.cross_entropy_with_softmax")
            autopar.shard_tensor(logits, mesh, ["dp" if "dp" in mesh.dim_names else None, None, None])
        return seed

    return build


def conv_bn_net(global_statistics: bool, batch: int = 32, image: int = 16) -> SeedProgram:
    """conv + BatchNorm2D + relu + pool twice, Linear head; Momentum. With the piece, batch norm
    keeps the batch split (global statistics from 2·C-value all_reduces); without it, BatchNorm's
    input annotated whole, what autopar did before batch norm had a rule (all_gather of the conv
    output, data parallelism ends there)."""
    import paddle

    paddle.enable_static()
    nn, F = paddle.nn, paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 3, image, image], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        mods = {"conv1": nn.Conv2D(3, 16, 3, padding=1), "bn1": nn.BatchNorm2D(16), "conv2": nn.Conv2D(16, 32, 3, padding=1),
                "bn2": nn.BatchNorm2D(32), "fc": nn.Linear(32 * (image // 4) ** 2, 10)}  # fmt: skip
        first = mods["conv1"](x)
        h = F.max_pool2d(F.relu(mods["bn1"](first)), 2)
        h = F.max_pool2d(F.relu(mods["bn2"](mods["conv2"](h))), 2)
        loss = paddle.mean(F.cross_entropy(mods["fc"](paddle.flatten(h, 1)), label))
        _optimizer("momentum", False).minimize(loss)
    if not global_statistics:
        autopar.shard_tensor(first, MESHES["dp=2"], [None, None, None, None])
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)


def dropout_mlp(mesh_name: str) -> Callable[[bool], SeedProgram]:
    """SimpleNet-like MLP with a training dropout after linear1's ReLU. With the piece, the
    dropout keeps its input's split (each rank applies its slice of the serial mask); without
    it, the dropout input annotated whole: what autopar did before (gather, drop, slice)."""

    def build(sliced: bool) -> SeedProgram:
        import paddle

        paddle.enable_static()
        main, startup = paddle.static.Program(), paddle.static.Program()
        main.random_seed = startup.random_seed = 7
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [64, 256], "float32")
            label = paddle.static.data("label", [64, 1], "int64")
            layers = {"linear1": paddle.nn.Linear(256, 1024), "linear2": paddle.nn.Linear(1024, 10)}
            hidden = paddle.nn.functional.relu(layers["linear1"](x))
            dropped = paddle.nn.functional.dropout(hidden, 0.1, training=True)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(layers["linear2"](dropped), label))
            _optimizer("momentum", False).minimize(loss)
        if not sliced:
            autopar.shard_tensor(hidden, MESHES[mesh_name], [None, None])
        return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers)

    return build


ROWS: list[Row] = [
    Row("global-norm clip", "GPT block", "dp=2", gpt),
    Row("global-norm clip", "GPT block", "mp=2", gpt),
    Row("global-norm clip", "GPT block", "dp=2 x mp=2", gpt),
    Row("global-norm clip", "SimpleNet", "dp=2", simple_net),
    Row("global-norm clip", "SimpleNet", "mp=2", simple_net),
    Row("vocab-parallel", "GPT block", "mp=2", vocab_parallel_gpt("mp=2")),
    Row("vocab-parallel", "GPT block", "dp=2 x mp=2", vocab_parallel_gpt("dp=2 x mp=2")),
    Row("batch norm", "ConvBN", "dp=2", conv_bn_net),
    # exact batch norm (without) against per-rank statistics (with; not serial): no statistics
    # all_reduce, one 2·C all_reduce per batch norm averages the running statistics
    Row("local batch norm", "ConvBN", "dp=2", lambda _: conv_bn_net(True), autopar.Strategy(local_batch_norm=True)),
    Row("dropout", "MLP", "dp=2", dropout_mlp("dp=2")),
    Row("dropout", "MLP", "mp=2", dropout_mlp("mp=2")),
]


def traffic(dist: autopar.DistributedProgram, rank: int = 0) -> tuple[int, int, Counter]:
    """Bytes and number of collectives ``rank`` runs per step, and a count per (kind, bytes)."""
    ops = dist.comm_ops(rank)
    return sum(c.bytes for c in ops), len(ops), Counter((str(c.kind), c.bytes) for c in ops)


def added(without: Counter, with_: Counter) -> str:
    extra = with_ - without
    if not extra:
        return "-"
    return ", ".join(
        f"{n}x {kind} {format_bytes(size)}" for (kind, size), n in sorted(extra.items(), key=lambda i: -i[0][1])
    )


def main() -> None:
    header = f"{'piece':<17} {'model':<10} {'mesh':<12} {'without':>20} {'with':>20} {'ratio':>6}  moved by the piece"
    print("bytes moved per step by rank 0 (sum of dist.comm_ops(0)), collectives in parentheses")
    print(header)
    print("-" * len(header))
    for row in ROWS:
        (b0, n0, k0), (b1, n1, k1) = traffic(row.compile(False)), traffic(row.compile(True))
        without, with_ = f"{format_bytes(b0)} ({n0})", f"{format_bytes(b1)} ({n1})"
        ratio = f"{b1 / b0:.2f}" if b0 else "-"
        print(f"{row.piece:<17} {row.model:<10} {row.mesh:<12} {without:>20} {with_:>20} {ratio:>6}  {added(k0, k1)}")


if __name__ == "__main__":
    main()
