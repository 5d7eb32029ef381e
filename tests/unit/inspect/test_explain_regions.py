"""autopar explain says where a parallel region ends and why: a split value made whole for an op
without an SPMD rule (here logcumsumexp under data parallelism)."""

import paddle

import autopar
from autopar.cli import explain_text


def test_explain_names_where_data_parallelism_ends():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        hidden = paddle.logcumsumexp(paddle.nn.Linear(16, 16)(x), axis=1)
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(paddle.nn.Linear(16, 1)(hidden)))
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    text = explain_text(autopar.compile(main, mesh, startup_program=startup))
    assert "parallel regions end (ops without an SPMD rule):" in text
    assert "is made whole (all_gather) for pd_op.logcumsumexp#" in text and "it has no SPMD rule" in text
