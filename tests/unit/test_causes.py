"""Each collective's reason starts with its cause in the user's terms: the feature that needs it
and the layer (``struct_name`` path) it belongs to, e.g. ``row-parallel output in
TransformerLayer/Linear_3: pd_op.add#96 reads ...`` (see autopar/causes.py).

Layer paths carry Paddle's per-process call counters (``Linear_3``), so the expectations match
them as patterns.
"""

from __future__ import annotations

import re
from collections import Counter

import paddle

import autopar
from autopar.causes import gradients, layer_of, parameter_layer
from autopar.cli import explain_text
from autopar.graph import ProgramGraph, Role
from autopar.testing.models import annotate_megatron, gpt_block_program

LAYER = r"(?:[A-Za-z0-9]+(?:_\d+)?/)*"  # any enclosing layers


def cause(reason: str) -> str:
    return reason.split(": ", 1)[0]


def test_struct_names_as_paddle_records_them():
    """Measured on Paddle 3.3.1: a static nn.Layer call tags the forward ops it makes with the
    classes of the calls (``/Net/Block/Linear_1/``: the second Linear called inside Block);
    grad ops carry none (they take their forward op's layer), nor do optimizer ops."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(paddle.nn.functional.relu(self.fc1(x)))

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        net = Net()
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(net(x)))
    graph = ProgramGraph(main)
    forward = {op.short_name: op.attrs.get("struct_name") for op in graph.ops if op.role is Role.FORWARD}
    assert re.fullmatch(r"/Net(_\d+)?/Block/Linear_1/", forward["matmul"])  # the last matmul: fc2
    grads = [op for op in graph.ops if op.short_name == "matmul_grad"]
    assert all("struct_name" not in op.attrs for op in grads)
    assert [layer_of(graph, op.index).split("/", 1)[1] for op in grads] == ["Block/Linear_1", "Block/Linear"]
    fc2_weight = graph.by_name[net.block.fc2.weight.name]
    assert parameter_layer(graph, fc2_weight).endswith("Block/Linear_1")
    updates = [op for op in graph.ops if op.short_name == "sgd_"]
    assert all(layer_of(graph, op.index).endswith(("Block/Linear", "Block/Linear_1")) for op in updates)


def megatron_gpt():
    """GPT (one TransformerLayer call, so its ops carry layer paths) on dp=2 x mp=2: Megatron
    weights, vocabulary-parallel embedding and head, global-norm clipping."""
    seed = gpt_block_program(batch=4, seq=8, hidden=32, heads=4, vocab=64, layer_calls=True, optimizer="adamw")
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    annotate_megatron(seed, mesh)
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    autopar.shard_tensor(seed.layers["embedding"].weight, mesh, ["mp", None])
    autopar.shard_tensor(seed.layers["head"].weight, mesh, [None, "mp"])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


def test_megatron_gpt_collectives_name_feature_and_layer():
    seed, dist = megatron_gpt()
    causes = [cause(c.reason) for c in dist.comm_ops(0)]
    features = Counter(re.sub(r" in .*", "", c) for c in causes)
    assert features == {
        "row-parallel output": 2,  # proj and fc2
        "vocabulary-parallel embedding": 1,
        "vocabulary-parallel cross-entropy": 1,  # row max, sum of exponentials, target logit: one all_gather
        "tensor-parallel input gradient": 3,  # the head's, fc1's and qkv's input gradients
        "gradient sync over dp": 1,  # one bucket
    }, causes
    row_parallel = [c for c in causes if c.startswith("row-parallel output")]
    assert all(re.fullmatch(rf"row-parallel output in {LAYER}TransformerLayer(_\d+)?/Linear_[13]", c) for c in row_parallel)
    assert any(re.fullmatch(r"vocabulary-parallel embedding in Embedding(_\d+)?", c) for c in causes)
    head = [c for c in causes if c.startswith("vocabulary-parallel cross-entropy")]
    assert len(set(head)) == 1 and re.fullmatch(r"vocabulary-parallel cross-entropy in Linear(_\d+)?", head[0])
    (bucket,) = [c for c in dist.comm_ops(0) if c.key.source == "bucket"]
    assert re.match(r"gradient sync over dp in Linear(_\d+)?, TransformerLayer(_\d+)?/LayerNorm", bucket.reason)


def test_clipping_names_the_raw_and_the_clipped_gradients():
    """ClipGradByGlobalNorm rescales each gradient before its update: the update reads
    ``clipped grad(W)``, the bucket syncs ``grad(W)`` (named through the rescale), and under
    mp the norm's partial sum is ``global-norm clipping``."""
    dp = autopar.ProcessMesh([0, 1], ["dp"])
    layers, dist = clipped_mlp(dp)
    params = [p.name for layer in layers for p in (layer.weight, layer.bias)]
    (bucket,) = dist.comm_ops(0)
    assert bucket.reason.startswith("gradient sync over dp in Linear")
    assert all(f"grad({name}) %" in bucket.reason for name in params)
    names = {dist.state.label(k) for k, g in gradients(dist.graph).items() if g.clipped}
    assert len(names) == len(params) and all(n.startswith("clipped grad(") for n in names)
    _, tensor_parallel = clipped_mlp(autopar.ProcessMesh([0, 1], ["mp"]))
    row_parallel, norm = (cause(c.reason) for c in tensor_parallel.comm_ops(0))
    assert re.fullmatch(r"row-parallel output in Linear_\d+", row_parallel) and norm == "global-norm clipping"


def clipped_mlp(mesh):
    """Linear 16->32->16->4 with ReLU, Momentum with ClipGradByGlobalNorm; the batch split over
    dp, or the first two layers column- and row-parallel over mp."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        layers = [paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 16), paddle.nn.Linear(16, 4)]
        h = layers[2](paddle.nn.functional.relu(layers[1](paddle.nn.functional.relu(layers[0](x)))))
        loss = paddle.mean(paddle.nn.functional.cross_entropy(h, label))
        paddle.optimizer.Momentum(0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)).minimize(loss)
    if "mp" in mesh.dim_names:
        autopar.shard_tensor(layers[0].weight, mesh, [None, "mp"])
        autopar.shard_tensor(layers[0].bias, mesh, ["mp"])
        autopar.shard_tensor(layers[1].weight, mesh, ["mp", None])
    else:
        autopar.shard_tensor(x, mesh, ["dp", None])
    return layers, autopar.compile(main, mesh, startup_program=startup)


def test_an_op_without_a_rule_is_named_where_data_parallelism_ends():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        hidden = paddle.logcumsumexp(paddle.nn.Linear(16, 16)(x), axis=1)
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(paddle.nn.Linear(16, 1)(hidden)))
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    (gather,) = [c for c in dist.comm_ops(0) if c.kind == "all_gather"]
    assert gather.reason.startswith("no SPMD rule for logcumsumexp: pd_op.logcumsumexp#")
    assert "why: no SPMD rule for logcumsumexp" in explain_text(dist)
