"""The host plan (simulate, host backend) runs what the native backend runs: RNN ops,
``to_tensor`` constants read after a collective, collectives that read a feed directly;
control flow is refused at compile by name, never an abort."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.serial import run_serial
from autopar.testing.user_programs import build, feeds_for


@pytest.mark.parametrize("case", ["gru", "lstm", "constant", "feed_collective"])
def test_simulate_equals_serial(case):
    main, startup, feeds, loss, annotations = build(case)
    mesh = autopar.ProcessMesh([0, 1], ["d"])
    for value, mapping in annotations:
        autopar.shard_tensor(value, mesh, mapping)
    dist = autopar.compile(main, mesh, startup_program=startup)
    assert dist.comm_ops(0), "the case must exercise a collective"
    steps = feeds_for(feeds)
    result = autopar.simulate(dist, steps, [loss])
    serial = run_serial(main, startup, steps, [loss])
    for want, got in zip(serial.fetches, result.fetches):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_zero_d_values_keep_their_shape_across_segments():
    """A 0-d value written to the scope between segments stays 0-d (np.ascontiguousarray made it 1-d)."""
    main, startup, feeds, loss, annotations = build("gru", train=False)
    mesh = autopar.ProcessMesh([0, 1], ["d"])
    for value, mapping in annotations:
        autopar.shard_tensor(value, mesh, mapping)
    result = autopar.simulate(autopar.compile(main, mesh, startup_program=startup), feeds_for(feeds, 1), [loss])
    assert result.fetches[0][0].shape == ()


@pytest.mark.parametrize("flow", ["cond", "while_loop"])
def test_control_flow_is_refused_by_name(flow):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        h = paddle.nn.Linear(6, 6)(x)
        if flow == "cond":
            out = paddle.static.nn.cond(paddle.sum(h) > 0, lambda: paddle.sum(h * 2), lambda: paddle.sum(h))
        else:
            (out,) = paddle.static.nn.while_loop(lambda v: paddle.sum(v) < 10, lambda v: [v * 2], [h])
    mesh = autopar.ProcessMesh([0, 1], ["d"])
    autopar.shard_tensor(x, mesh, ["d", None])
    name = "pd_op.if" if flow == "cond" else "pd_op.while"
    with pytest.raises(AutoparError, match=f"{name}#\\d+ has \\d region"):
        autopar.compile(main, mesh, startup_program=startup)
