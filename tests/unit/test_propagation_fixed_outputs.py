"""Two propagation choices sequence parallelism rests on, seen on a user's own annotations.

1. A mesh dim two dims of an op both want goes to the higher-priority placement: a weight the
   user split by columns keeps its split where a strategy split the activation's sequence over
   the same dim (the activation is gathered, not the weight).
2. An annotated output its op does not make by itself: the inputs are resharded toward it where
   that is cheaper — a row-parallel output's pending sum read by a bias add whose result the user
   wants split is reduce-scattered, not all-reduced and then sliced.
"""

import paddle

import autopar
from autopar.propagation import Priority


def row_parallel(annotate_output):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 1
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 8, 16], "float32")
        up, down = paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 16)
        autopar.shard_tensor(up.weight, mesh, [None, "mp"])
        autopar.shard_tensor(down.weight, mesh, ["mp", None])
        out = down(paddle.nn.functional.relu(up(x)))
        if annotate_output:
            autopar.shard_tensor(out, mesh, [None, "mp", None])
        loss = paddle.mean(out)
        paddle.optimizer.SGD(0.1).minimize(loss)
    return autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(cluster="h100-node"))


def test_an_output_annotated_split_makes_the_pending_sum_a_reduce_scatter():
    plain, split = row_parallel(False), row_parallel(True)
    assert [c.kind for c in plain.comm_ops(0) if "pd_op.add" in c.reason] == ["all_reduce"]
    forward = [c for c in split.comm_ops(0) if "pd_op.add#" in c.reason]
    assert [c.kind for c in forward] == ["reduce_scatter"], [str(c) for c in split.comm_ops(0)]


def test_the_higher_priority_split_keeps_a_contested_mesh_dim():
    from autopar.spmd import TensorSpec, get_rule
    from autopar.spmd.base import RuleContext

    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    x = TensorSpec((2, 8, 16), autopar.DistAttr(mesh, [-1, 0, -1]), "float32", int(Priority.STRATEGY))
    w = TensorSpec((16, 32), autopar.DistAttr(mesh, [-1, 0]), "float32", int(Priority.USER))
    result = get_rule("pd_op.matmul").infer_forward([x, w], {"transpose_x": False, "transpose_y": False}, RuleContext(mesh))
    assert str(result.inputs[1]) == "[S(1)]" and str(result.inputs[0]) == "[R]"
    # equal priorities: the earlier operand's dim, as before
    x_user = TensorSpec(x.shape, x.dist, x.dtype, int(Priority.USER))
    result = get_rule("pd_op.matmul").infer_forward([x_user, w], {"transpose_x": False, "transpose_y": False}, RuleContext(mesh))
    assert str(result.inputs[0]) == "[S(1)]" and str(result.inputs[1]) == "[R]"
