"""Seed programs used by tests, examples and benchmarks (built with Paddle's static API).

Each builder returns a :class:`SeedProgram`: the main and startup programs, the feeds, the
loss, and the layers whose parameters a test annotates. Nothing here is annotated: callers
annotate, so the same program serves serial and every parallel strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeedProgram:
    main: Any
    startup: Any
    feeds: dict[str, Any]
    loss: Any
    layers: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # named intermediates


def _static():
    import paddle

    paddle.enable_static()
    return paddle, paddle.static.Program(), paddle.static.Program()


def make_optimizer(name: str, lr: float = 0.1) -> Any:
    import paddle

    if name == "sgd":
        return paddle.optimizer.SGD(lr)
    if name == "momentum":
        return paddle.optimizer.Momentum(lr, momentum=0.9, weight_decay=paddle.regularizer.L2Decay(1e-4))
    if name == "adam":
        return paddle.optimizer.Adam(lr)
    if name == "adamw":
        return paddle.optimizer.AdamW(lr, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def simple_net(batch: int = 8, sizes: tuple[int, ...] = (256, 512, 256, 10), optimizer: str = "momentum", seed: int = 7) -> SeedProgram:
    """The primer's SimpleNet: Linear 256->H->256->10 with ReLU, cross-entropy, Momentum + L2."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, sizes[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        layers, values, h = {}, {}, x
        for i in range(len(sizes) - 1):
            layer = paddle.nn.Linear(sizes[i], sizes[i + 1])
            layers[f"linear{i + 1}"] = layer
            h = layer(h)
            values[f"linear{i + 1}"] = h
            if i < len(sizes) - 2:
                h = paddle.nn.functional.relu(h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(h, label))
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers, values)


def gpt_block_program(
    batch: int = 2, seq: int = 8, hidden: int = 64, heads: int = 4, vocab: int = 128, layers: int = 1,
    optimizer: str = "adamw", seed: int | None = 7, dropout: float = 0.0, layer_calls: bool = False,
) -> SeedProgram:  # fmt: skip
    """GPT-style: embedding, ``layers`` x (attention with softmax + MLP, layer_norm), LM head.

    ``dropout`` > 0: training dropout on the attention probabilities and on the MLP's output.
    ``layer_calls``: each transformer layer is one ``TransformerLayer`` call (an ``nn.Layer``),
    so its ops carry ``/TransformerLayer*/...`` struct names (the same parameters and ops
    otherwise). ``seed=None``: no program.random_seed."""
    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    nn = paddle.nn
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("ids", [batch, seq], "int64")
        label = paddle.static.data("label", [batch, seq, 1], "int64")
        mods: dict[str, Any] = {"embedding": nn.Embedding(vocab, hidden)}
        h = mods["embedding"](ids)
        shape = (batch, seq, hidden, heads, dropout)
        for i in range(layers):
            block = _transformer_layer(shape)
            mods.update({f"{name}{i}" if name in ("qkv", "proj") else f"{name}_{i}": sub for name, sub in block.parts.items()})
            h = block(h) if layer_calls else block.forward(h)
        mods["head"] = nn.Linear(hidden, vocab)
        logits = mods["head"](h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))
        make_optimizer(optimizer, lr=0.01).minimize(loss)
    return SeedProgram(main, startup, {"ids": ids, "label": label}, loss, mods)


def _transformer_layer(shape: tuple[int, int, int, int, float]) -> Any:
    """One GPT layer as an ``nn.Layer`` named ``TransformerLayer`` (calling it records the struct
    name; ``.forward`` builds the same ops without)."""
    import paddle

    nn, F = paddle.nn, paddle.nn.functional
    batch, seq, hidden, heads, dropout = shape
    head_dim = hidden // heads

    class TransformerLayer(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.parts = {"qkv": self.qkv, "proj": self.proj, "fc1": self.fc1, "fc2": self.fc2, "ln1": self.ln1, "ln2": self.ln2}

        def forward(self, h: Any) -> Any:
            # per-head [q | k | v] layout (Megatron's): splitting heads keeps q, k, v together
            x = paddle.reshape(self.qkv(h), [batch, seq, heads, 3 * head_dim])
            x = paddle.transpose(x, [0, 2, 1, 3])
            q, k, v = paddle.split(x, 3, axis=-1)
            scores = paddle.matmul(q, k, transpose_y=True) * (head_dim**-0.5)
            probs = F.softmax(scores, axis=-1)
            if dropout:
                probs = F.dropout(probs, dropout, training=True)
            ctx = paddle.matmul(probs, v)
            ctx = paddle.reshape(paddle.transpose(ctx, [0, 2, 1, 3]), [batch, seq, hidden])
            h = self.ln1(h + self.proj(ctx))
            mlp = self.fc2(F.gelu(self.fc1(h)))
            if dropout:
                mlp = F.dropout(mlp, dropout, training=True)
            return self.ln2(h + mlp)

    return TransformerLayer()


def annotate_megatron(seed: SeedProgram, mesh: Any, mp: str = "mp") -> None:
    """Megatron on a :func:`gpt_block_program` from weight annotations only: qkv and fc1
    column-parallel (weight ``[None, mp]``, bias ``[mp]``), proj and fc2 row-parallel
    (weight ``[mp, None]``). Everything else is left to propagation."""
    import autopar

    for name, layer in seed.layers.items():
        if name.startswith(("qkv", "fc1_")):
            autopar.shard_tensor(layer.weight, mesh, [None, mp])
            autopar.shard_tensor(layer.bias, mesh, [mp])
        elif name.startswith(("proj", "fc2_")):
            autopar.shard_tensor(layer.weight, mesh, [mp, None])


def alexnet_program(batch: int = 4, image: int = 16, classes: int = 10, optimizer: str = "momentum", seed: int = 7) -> SeedProgram:
    """AlexNet-style: two conv-relu-pool stages, then a 2-layer classifier."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    nn, F = paddle.nn, paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 3, image, image], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        mods = {"conv1": nn.Conv2D(3, 8, 3, padding=1), "conv2": nn.Conv2D(8, 16, 3, padding=1)}
        h = F.max_pool2d(F.relu(mods["conv1"](x)), 2)
        h = F.max_pool2d(F.relu(mods["conv2"](h)), 2)
        h = paddle.flatten(h, 1)
        mods["fc1"] = nn.Linear(16 * (image // 4) ** 2, 64)
        mods["fc2"] = nn.Linear(64, classes)
        logits = mods["fc2"](F.relu(mods["fc1"](h)))
        loss = paddle.mean(F.cross_entropy(logits, label))
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)


def linear_net(batch: int = 8, features: int = 13, optimizer: str = "adam", seed: int = 7) -> SeedProgram:
    """The seed's LinearNet: linear regression (Linear features->1), squared error, Adam."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, features], "float32")
        y = paddle.static.data("y", [batch, 1], "float32")
        layer = paddle.nn.Linear(features, 1)
        loss = paddle.mean(paddle.nn.functional.square_error_cost(layer(x), y))
        make_optimizer(optimizer, lr=0.01).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "y": y}, loss, {"linear": layer})


def mlp(batch: int, widths: tuple[int, ...], optimizer: str = "sgd", classes: int | None = None, seed: int = 7) -> SeedProgram:
    """A small MLP with ReLU between layers; cross-entropy over the last width."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, widths[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        layers, h = {}, x
        for i in range(len(widths) - 1):
            layers[f"linear{i + 1}"] = layer = paddle.nn.Linear(widths[i], widths[i + 1])
            h = layer(h)
            if i < len(widths) - 2:
                h = paddle.nn.functional.relu(h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(h, label))
        make_optimizer(optimizer, lr=0.05).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers)


def reshard_chain(world: int = 2, seed: int = 3) -> tuple[SeedProgram, Any]:
    """A small net annotated so that every collective kind appears, and its compiled program.

    x ``[None, d]`` times w1 ``[d, None]`` makes a pending sum; ``h`` annotated ``[d, None]``
    turns it into a reduce_scatter, ``relu(h)`` annotated ``[None, d]`` an all_to_all; the
    next layer's bias add needs an all_reduce and the backward pass all_gathers.
    """
    import autopar

    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4 * world, 8 * world], "float32")
        label = paddle.static.data("label", [4 * world, 1], "int64")
        l1, l2 = paddle.nn.Linear(8 * world, 4 * world, bias_attr=False), paddle.nn.Linear(4 * world, 10)
        h = l1(x)
        h2 = paddle.nn.functional.relu(h)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(l2(h2), label))
        paddle.optimizer.SGD(0.1).minimize(loss)
    net = SeedProgram(main, startup, {"x": x, "label": label}, loss, {"linear1": l1, "linear2": l2}, {"h": h, "h2": h2})
    mesh = autopar.ProcessMesh(list(range(world)), ["d"])
    autopar.shard_tensor(x, mesh, [None, "d"])
    autopar.shard_tensor(l1.weight, mesh, ["d", None])
    autopar.shard_tensor(h, mesh, ["d", None])
    autopar.shard_tensor(h2, mesh, [None, "d"])
    return net, autopar.compile(main, mesh, startup_program=startup)


def three_columns(width: int = 6, seed: int = 5, **strategy: Any) -> tuple[SeedProgram, Any]:
    """Three column-parallel linears over ``mp`` = 2 concatenated along their split dim (``concat``
    reads the three outputs whole: three all_gathers along dim 1 at one site), then a linear; compiled
    with ``Strategy(**strategy)``. ``width`` 5: each output splits 3 + 2 (uneven pieces)."""
    import autopar

    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = seed
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        layers = {f"c{i}": paddle.nn.Linear(8, width) for i in range(3)}
        for layer in layers.values():
            autopar.shard_tensor(layer.weight, mesh, [None, "mp"])
            autopar.shard_tensor(layer.bias, mesh, ["mp"])
        h = paddle.concat([layer(x) for layer in layers.values()], axis=1)
        layers["out"] = out = paddle.nn.Linear(3 * width, 2)
        loss = paddle.mean(paddle.square(out(paddle.tanh(h))))
        make_optimizer("sgd").minimize(loss)
    seed_program = SeedProgram(main, startup, {"x": x}, loss, layers)
    return seed_program, autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(**strategy))
