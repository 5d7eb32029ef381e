"""A shape read is a constant (issue: real models, 17): a ViT's class token
``cls.expand((paddle.shape(x)[0], -1, -1))`` concatenated with the patch tokens keeps data
parallelism whole: one gradient bucket per step, the tokens split over dp after the concat.
Before: the images were all_gathered every step just to read their size ("no SPMD rule for
shape64"), the expand's batch dim was unknown (-1) so nothing after the concat could be split,
the concat gathered the patch tokens and every later op ran on the whole batch on every rank —
equal to serial, silently."""

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.serial import assert_simulation_equals_serial

DP = autopar.ProcessMesh([0, 1], ["dp"])


def _class_token_model():
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 3, 8], "float32")
        label = paddle.static.data("label", [4, 1], "int64")
        autopar.shard_tensor(x, DP, ["dp", None, None])
        autopar.shard_tensor(label, DP, ["dp", None])
        cls = paddle.create_parameter([1, 1, 8], "float32")
        proj, head = paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 3)
        batch = paddle.shape(x)[0]
        h = paddle.concat([cls.expand((batch, -1, -1)), proj(x)], axis=1)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(head(paddle.nn.functional.gelu(h)[:, 0]), label))
        make_optimizer("sgd").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, values={"tokens": h})


def test_a_shape_read_gathers_nothing():
    seed = _class_token_model()
    dist = autopar.compile(seed.main, DP, startup_program=seed.startup)
    assert [c.kind.value for c in dist.comm_ops(0)] == ["all_reduce"]  # the gradient bucket, nothing else
    assert str(dist.dist_attr(seed.values["tokens"])) == "[S(0)]"
    assert "static_shapes" in str(dist.passes) and "shape read(s) made constants" in dict(dist.decisions.rewrites())["static_shapes"]
    assert_simulation_equals_serial(seed, dist, classes=3)
