"""Communication autopar inserts must be the optimal one, checked from ``dist.comm_ops``."""

import paddle

import autopar
from autopar.testing.models import simple_net


def megatron_mlp(blocks: int, batch: int = 4, hidden: int = 16):
    """input layer (replicated), ``blocks`` x (fc1 column-parallel, gelu, fc2 row-parallel), mean loss."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, hidden], "float32")
        h = paddle.nn.Linear(hidden, hidden)(x)
        for _ in range(blocks):
            fc1, fc2 = paddle.nn.Linear(hidden, 4 * hidden), paddle.nn.Linear(4 * hidden, hidden)
            autopar.shard_tensor(fc1.weight, mesh, [None, "mp"])
            autopar.shard_tensor(fc1.bias, mesh, ["mp"])
            autopar.shard_tensor(fc2.weight, mesh, ["mp", None])
            h = fc2(paddle.nn.functional.gelu(fc1(h)))
        loss = paddle.mean(h)
        paddle.optimizer.SGD(0.1).minimize(loss)
    return autopar.compile(main, mesh, startup_program=startup)


def test_megatron_mlp_one_all_reduce_forward_one_backward_per_block():
    for blocks in (1, 3):
        dist = megatron_mlp(blocks)
        for rank in (0, 1):
            comms = dist.comm_ops(rank)
            assert [c.kind for c in comms] == ["all_reduce"] * (2 * blocks), "\n".join(map(str, comms))
            assert all(c.group == (0, 1) for c in comms)
        causes, details = zip(*(c.reason.split(": ", 1) for c in dist.comm_ops(0)))
        readers = [d.split(" reads ")[0].split("#")[0] for d in details]
        assert readers.count("pd_op.add") == blocks  # forward: before the bias add of fc2
        assert readers.count("pd_op.add_grad") == blocks  # backward: the gradient of the block input
        # each named after the feature and the layer: fc2 (Linear_2, _4, ...), then fc1 in backward order
        features = [c.split(" in ")[0] for c in causes]
        assert features == ["row-parallel output"] * blocks + ["tensor-parallel input gradient"] * blocks
        layers = [c.split(" in ")[1] for c in causes]
        assert len(set(layers)) == 2 * blocks and all(layer.startswith("Linear") for layer in layers)


def compile_dp(**strategy):
    net = simple_net(sizes=(16, 32, 16, 10))
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(net.main, mesh, startup_program=net.startup, strategy=autopar.Strategy(**strategy))
    params = {p.name: p for layer in net.layers.values() for p in (layer.weight, layer.bias)}
    return dist, mesh, params


def test_data_parallel_one_gradient_all_reduce_per_parameter():
    dist, mesh, params = compile_dp(fuse_allreduce=False)
    for rank in mesh.ranks:
        comms = dist.comm_ops(rank)
        assert [c.kind for c in comms] == ["all_reduce"] * len(params), "\n".join(map(str, comms))
        assert all(c.group == (0, 1, 2, 3) and c.reduce == "sum" for c in comms)
        grads_of = {c.reason.split(": ", 1)[1].split(" reads ")[0] for c in comms}
        assert len(grads_of) == len(params)  # one per optimizer op, i.e. per parameter
        assert all(c.reason.startswith("gradient sync over dp in Linear") for c in comms)
