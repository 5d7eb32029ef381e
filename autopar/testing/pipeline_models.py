"""Pipelined seed programs: layers placed on stages with ``autopar.shard_op`` (used by tests,
the pipeline example and benchmarks). Nothing else is annotated, unless asked
(``residual_blocks(tensor_parallel=...)``)."""

from __future__ import annotations

from typing import Any

from autopar.testing.models import SeedProgram, _static, make_optimizer


def staged_mlp(
    mesh: Any, widths: tuple[int, ...] = (16, 32, 16, 10), stages: int = 2, batch: int = 12,
    optimizer: str = "momentum", seed: int | None = 7, placement: tuple[int, ...] | None = None,
    clip: float | None = None,
) -> SeedProgram:  # fmt: skip
    """The primer's SimpleNet as a pipeline: Linear layers with ReLU, cross-entropy; layer ``i``
    on ``mesh[i * stages // layers]``, or on ``mesh[placement[i]]`` (e.g. ``(0, 1, 0, 1)``:
    two virtual stages per pipeline rank). ``seed=None``: no program.random_seed. ``clip``:
    global-norm gradient clipping (``ClipGradByGlobalNorm(clip)`` given to the optimizer)."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    layers = len(widths) - 1
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, widths[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        mods, h = {}, x
        for i in range(layers):
            linear = mods[f"linear{i + 1}"] = paddle.nn.Linear(widths[i], widths[i + 1])
            last = i == layers - 1

            def block(t: Any, linear: Any = linear, last: bool = last) -> Any:
                out = linear(t)
                return out if last else paddle.nn.functional.relu(out)

            where = placement[i] if placement is not None else i * stages // layers
            h = autopar.shard_op(block, mesh[where])(h)
        last = placement[-1] if placement is not None else stages - 1
        loss = autopar.shard_op(lambda o: paddle.mean(paddle.nn.functional.cross_entropy(o, label)), mesh[last])(h)
        optim = make_optimizer(optimizer)
        if clip is not None:
            optim._grad_clip = paddle.nn.ClipGradByGlobalNorm(clip)
        optim.minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)


def residual_blocks(
    mesh: Any, blocks: int = 4, batch: int = 4, seq: int = 6, hidden: int = 8, classes: int = 5,
    tensor_parallel: str | None = None, seed: int | None = 3,
) -> SeedProgram:  # fmt: skip
    """Pre-norm residual MLP blocks ``h + down(gelu(up(layer_norm(h))))`` over ``[batch, seq,
    hidden]`` activations, half the blocks on ``mesh[0]``, half on ``mesh[1]``, then a
    classifier on the last stage: the residual stream crosses the stage boundary, so its
    gradient is summed (add_n) on the later stage. ``tensor_parallel``: the mesh dim splitting
    ``up`` by columns and ``down`` by rows (Megatron) inside each stage."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, seq, hidden], "float32")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        mods, h = {}, x
        for i in range(blocks):
            stage = mesh[i * 2 // blocks]
            up, down, norm = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden), nn.LayerNorm(hidden)
            mods.update({f"up{i}": up, f"down{i}": down, f"norm{i}": norm})
            if tensor_parallel is not None:
                autopar.shard_tensor(up.weight, stage, [None, tensor_parallel])
                autopar.shard_tensor(up.bias, stage, [tensor_parallel])
                autopar.shard_tensor(down.weight, stage, [tensor_parallel, None])

            def block(t: Any, up: Any = up, down: Any = down, norm: Any = norm) -> Any:
                return t + down(F.gelu(up(norm(t))))

            h = autopar.shard_op(block, stage)(h)
        mods["head"] = nn.Linear(hidden, classes)
        loss = autopar.shard_op(lambda t: paddle.mean(F.cross_entropy(mods["head"](t), label)), mesh[1])(h)
        make_optimizer("momentum").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)


def residual_cut_inside(mesh: Any, batch: int = 4, seq: int = 3, hidden: int = 8, seed: int | None = 3) -> SeedProgram:
    """Two pre-norm residual blocks, a final LayerNorm and a head on ``mesh[0]`` / ``mesh[1]``,
    cut inside the second block (its LayerNorm on stage 0, the rest on stage 1): the gradient of
    that block's input is summed on stage 1, so one micro-batch's backward crosses 1 -> 0 -> 1 -> 0
    (the message order the host runtime once mismatched). SGD."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, seq, hidden], "float32")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        norms = [nn.LayerNorm(hidden), nn.LayerNorm(hidden)]
        ups, downs = [nn.Linear(hidden, 2 * hidden) for _ in norms], [nn.Linear(2 * hidden, hidden) for _ in norms]
        h = autopar.shard_op(lambda t: t + downs[0](F.gelu(ups[0](norms[0](t)))), mesh[0])(x)
        normed = autopar.shard_op(norms[1], mesh[0])(h)
        h = autopar.shard_op(lambda n, t: t + downs[1](F.gelu(ups[1](n))), mesh[1])(normed, h)
        head, norm = nn.Linear(hidden, 5), nn.LayerNorm(hidden)
        loss = autopar.shard_op(lambda t: paddle.mean(F.cross_entropy(head(norm(t)), label)), mesh[1])(h)
        paddle.optimizer.SGD(0.1).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss)


def tied_lm(
    mesh: Any, placement: tuple[int, ...] = (0, 1), vocab: int = 16, hidden: int = 8, batch: int = 8, seq: int = 4,
    optimizer: str = "sgd", seed: int | None = None, shared: tuple[int, int] | None = None, data_parallel: str | None = None,
    clip: float | None = None,
) -> SeedProgram:  # fmt: skip
    """A language model whose word embedding is tied to its head (GPT-2's), over stages:
    the embedding lookup on ``mesh[placement[0]]``, a ``tanh(Linear)`` block on
    ``mesh[placement[i]]`` for each middle entry, and the head — logits = h @ embedding.weight^T,
    cross-entropy over the vocabulary — on ``mesh[placement[-1]]``: one parameter read on the
    first and the last stage. ``shared=(i, j)``: blocks ``i`` and ``j`` are one Linear, called
    twice (a layer on two stages). ``data_parallel``: the mesh dim splitting the batch inside the
    stages. ``clip``: global-norm gradient clipping. ``seed=None``: no program.random_seed."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        if data_parallel is not None:
            autopar.shard_tensor(ids, mesh[placement[0]], [data_parallel, None])
        embedding = nn.Embedding(vocab, hidden)
        blocks = [nn.Linear(hidden, hidden) for _ in placement[1:-1]]
        if shared is not None:
            blocks[shared[1]] = blocks[shared[0]]
        h = autopar.shard_op(embedding, mesh[placement[0]])(ids)
        for block, where in zip(blocks, placement[1:-1]):
            h = autopar.shard_op(lambda t, block=block: paddle.tanh(block(t)), mesh[where])(h)

        def head(t: Any) -> Any:
            logits = paddle.matmul(t, embedding.weight, transpose_y=True)
            return paddle.mean(F.cross_entropy(logits, label))

        loss = autopar.shard_op(head, mesh[placement[-1]])(h)
        optim = make_optimizer(optimizer)
        if clip is not None:
            optim._grad_clip = nn.ClipGradByGlobalNorm(clip)
        optim.minimize(loss)
    mods = {"embedding": embedding, **{f"block{i}": b for i, b in enumerate(blocks)}}
    return SeedProgram(main, startup, {"ids": ids, "label": label}, loss, mods)


def in_graph_tables(
    mesh: Any, placement: tuple[int, ...] | None = (0, 0, 1), batch: int = 4, seq: int = 8, hidden: int = 16,
    vocab: int = 32, optimizer: str = "sgd", seed: int | None = 5,
) -> SeedProgram:  # fmt: skip
    """A decoder as language models write one, its tables and masks built in the graph from
    constants, outside any layer: position ids ``arange(seq)`` expanded to the batch, a causal
    mask ``tril(ones([seq, seq]))`` read by every attention block, a padding mask
    ``ones([batch, seq])``, and a rotate-half rotary step (``concat([-x2, x1])``). Embeddings,
    two attention blocks and the LM head + loss are placed on ``mesh[placement[i]]``
    (``placement=None``: nothing placed, for ``PipelineConfig(stages=n)`` or no pipeline)."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional

    def placed(fn: Any, part: int) -> Any:
        return fn if placement is None else autopar.shard_op(fn, mesh[placement[part]])

    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq], "int64")
        mods = {"tokens": nn.Embedding(vocab, hidden), "positions": nn.Embedding(seq, hidden), "head": nn.Linear(hidden, vocab)}
        positions = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
        causal = paddle.tril(paddle.ones([seq, seq], "float32"))
        padding = paddle.ones([batch, seq], "float32")
        h = placed(lambda t: mods["tokens"](t) + mods["positions"](positions), 0)(ids)
        for i in range(2):
            q, k, v, o = (nn.Linear(hidden, hidden) for _ in range(4))
            mods.update({f"q{i}": q, f"k{i}": k, f"v{i}": v, f"o{i}": o})

            def block(t: Any, q: Any = q, k: Any = k, v: Any = v, o: Any = o) -> Any:
                def rotate_half(x: Any) -> Any:
                    return paddle.concat([-x[..., hidden // 2 :], x[..., : hidden // 2]], axis=-1)

                scores = paddle.matmul(rotate_half(q(t)), rotate_half(k(t)), transpose_y=True) / float(hidden) ** 0.5
                scores = scores + (1.0 - causal) * -1e4 + (1.0 - padding.unsqueeze(1)) * -1e4
                return t + o(paddle.matmul(F.softmax(scores, -1), v(t)))

            h = placed(block, i + 1)(h)
        loss = placed(lambda t: paddle.mean(F.cross_entropy(mods["head"](t), labels.unsqueeze(-1))), 2)(h)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"ids": ids, "labels": labels}, loss, mods)


def nested_decoder(
    layers: int = 4, batch: int = 4, seq: int = 6, hidden: int = 8, vocab: int = 16, optimizer: str = "sgd", seed: int | None = 3
) -> SeedProgram:  # fmt: skip
    """A model as libraries nest one: ``Model`` holding an embedding, a ``Decoder`` of
    ``DecoderLayer`` blocks (pre-norm residual MLPs) and a norm + LM head, called once (layer
    paths ``Model/Decoder/DecoderLayer_k/...``). Nothing placed."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional

    class DecoderLayer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

        def forward(self, h: Any) -> Any:
            return h + self.down(F.gelu(self.up(self.norm(h))))

    class Decoder(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.LayerList([DecoderLayer() for _ in range(layers)])

        def forward(self, h: Any) -> Any:
            for layer in self.layers:
                h = layer(h)
            return h

    class Model(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.decoder = nn.Embedding(vocab, hidden), Decoder()
            self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

        def forward(self, ids: Any) -> Any:
            return self.head(self.norm(self.decoder(self.embed(ids))))

    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        labels = paddle.static.data("labels", [batch, seq, 1], "int64")
        model = Model()
        loss = paddle.mean(F.cross_entropy(model(ids), labels))
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"ids": ids, "labels": labels}, loss, {"model": model})
