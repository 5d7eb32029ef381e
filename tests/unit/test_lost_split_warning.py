"""No silent loss of parallelism (issue: real models, 6): an op without an SPMD rule that makes
a split value whole every step is named in a ParallelismWarning, with its layer path and the
bytes it costs; a program whose splits all hold warns nothing."""

import warnings

import autopar
from autopar.errors import ParallelismWarning
from autopar.testing.models import _static, make_optimizer, simple_net

DP = autopar.ProcessMesh([0, 1], ["dp"])


def _compile_warnings(main, startup):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.compile(main, DP, startup_program=startup)
    return [str(w.message) for w in caught if issubclass(w.category, ParallelismWarning)]


def test_an_op_without_a_rule_that_gathers_a_split_is_named():
    paddle, main, startup = _static()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        autopar.shard_tensor(x, DP, ["dp", None])
        layer = paddle.nn.Linear(6, 6)
        loss = paddle.mean(paddle.logcumsumexp(layer(x), axis=1))
        make_optimizer("sgd").minimize(loss)
    (message,) = _compile_warnings(main, startup)
    assert message.startswith("pd_op.logcumsumexp#") and "has no SPMD rule" in message
    assert "[S(0)] -> whole (96 B)" in message and "register_rule" in message


def test_a_program_whose_splits_hold_warns_nothing():
    seed = simple_net(batch=8, sizes=(16, 32, 10))
    autopar.shard_tensor(seed.feeds["x"], DP, ["dp", None])
    autopar.shard_tensor(seed.feeds["label"], DP, ["dp", None])
    assert _compile_warnings(seed.main, seed.startup) == []
