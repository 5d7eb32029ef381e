"""Compiled programs to inspect: each function builds, annotates and compiles one example.

The ``autopar`` command line takes any of them (``module:function`` or ``file.py:function``)::

    .venv/bin/autopar explain examples/inspect_models.py:simple_net_dp_mp
    .venv/bin/autopar diff examples/inspect_models.py:alexnet_conv_dp_fc_mp --out /tmp/alexnet

The golden diffs under tests/golden/ are made from these functions, with
``autopar.Strategy(cluster="h100-node")``: the predicted times they print do not depend on the
machine (without a cluster the cost profile follows the hardware, cpu-gloo here).
"""

import contextlib
import warnings

warnings.filterwarnings("ignore")

import paddle  # noqa: E402

import autopar  # noqa: E402
from autopar.testing.models import alexnet_program, simple_net  # noqa: E402

SIZES = (8, 16, 8, 4)  # small: diffs stay short


@contextlib.contextmanager
def _fresh_names():
    """Parameter names start at linear_0 and layer paths at Linear whatever ran before: the
    dumps stay comparable. (Paddle numbers repeated layer calls in a process-wide tree, the
    ``struct_name`` of their ops, which the collectives' reasons name.)"""
    from paddle.base import framework

    saved = framework._name_struct
    framework._name_struct = framework.NameStruct()
    try:
        with paddle.utils.unique_name.guard():
            yield
    finally:
        framework._name_struct = saved


def simple_net_dp(strategy: autopar.Strategy | None = None) -> autopar.DistributedProgram:
    """SimpleNet, pure data parallel on 2 ranks: the batch is split, gradients all-reduced."""
    with _fresh_names():
        net = simple_net(batch=4, sizes=SIZES)
    mesh = autopar.ProcessMesh([0, 1], dim_names=["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(net.feeds["label"], mesh, ["dp", None])
    return autopar.compile(net.main, mesh, startup_program=net.startup, strategy=strategy)


def simple_net_mp(strategy: autopar.Strategy | None = None) -> autopar.DistributedProgram:
    """SimpleNet, Megatron tensor parallel on 2 ranks: column- then row-parallel linear."""
    with _fresh_names():
        net = simple_net(batch=4, sizes=SIZES)
    mesh = autopar.ProcessMesh([0, 1], dim_names=["mp"])
    l1, l2 = net.layers["linear1"], net.layers["linear2"]
    autopar.shard_tensor(l1.weight, mesh, [None, "mp"])
    autopar.shard_tensor(l1.bias, mesh, ["mp"])
    autopar.shard_tensor(l2.weight, mesh, ["mp", None])
    return autopar.compile(net.main, mesh, startup_program=net.startup, strategy=strategy)


def simple_net_dp_mp(strategy: autopar.Strategy | None = None) -> autopar.DistributedProgram:
    """SimpleNet on a 2 x 2 mesh: data parallel x tensor parallel."""
    with _fresh_names():
        net = simple_net(batch=4, sizes=SIZES)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    l1, l2 = net.layers["linear1"], net.layers["linear2"]
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(l1.weight, mesh, [None, "mp"])
    autopar.shard_tensor(l1.bias, mesh, ["mp"])
    autopar.shard_tensor(l2.weight, mesh, ["mp", None])
    return autopar.compile(net.main, mesh, startup_program=net.startup, strategy=strategy)


def alexnet_conv_dp_fc_mp(strategy: autopar.Strategy | None = None) -> autopar.DistributedProgram:
    """AlexNet on a 2 x 2 mesh: the convolutions data parallel over dp, the classifier
    tensor parallel over mp (column- then row-parallel)."""
    with _fresh_names():
        net = alexnet_program(batch=4, image=8)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None, None, None])
    fc1, fc2 = net.layers["fc1"], net.layers["fc2"]
    autopar.shard_tensor(fc1.weight, mesh, [None, "mp"])
    autopar.shard_tensor(fc1.bias, mesh, ["mp"])
    autopar.shard_tensor(fc2.weight, mesh, ["mp", None])
    return autopar.compile(net.main, mesh, startup_program=net.startup, strategy=strategy)


EXAMPLES = {f.__name__: f for f in (simple_net_dp, simple_net_mp, simple_net_dp_mp, alexnet_conv_dp_fc_mp)}
