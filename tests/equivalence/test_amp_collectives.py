"""Collectives in low precision (issue 38 item 3): values autopar's collectives move in
bfloat16 are carried in the rank programs and moved by the runtime as bfloat16 — reduced by the
one rule of :mod:`autopar.low_precision`, written back as bfloat16 tensors.

A forward-only bfloat16 program runs on this CPU build as it is (bf16 matmul's forward kernel
exists): a row-parallel matmul's partial outputs are all-reduced in bfloat16. Its result is
checked bit for bit against the rule applied to each rank's partial product, computed by Paddle
on the rank's half of the operands."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import autopar
from autopar.low_precision import reduce, widen
from autopar.testing.amp import (
    Amp,
    amp_mlp,
    as_float32,
    assert_twin_equals_serial,
    measured_floor,
    run_serial_twin,
    twinned,
)
from autopar.testing.serial import random_feeds

O2 = Amp("O2", optimizer="sgd")

ROWS, INNER, COLS = 4, 8, 6


def _row_parallel_bf16():
    """``gelu(bf16(x) @ bf16(w))`` cast to float32, ``x`` split by columns and ``w`` by rows over
    mp: the matmul makes a Partial(sum) bfloat16 product that the gelu (not linear) must read
    whole, so the all_reduce moves bfloat16."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [ROWS, INNER], "float32")
        w = paddle.static.data("w", [INNER, COLS], "float32")
        product = paddle.matmul(x.astype("bfloat16"), w.astype("bfloat16"))
        out = paddle.nn.functional.gelu(product).astype("float32")
    return main, startup, x, w, product, out


def _partial_products(feed, halves):
    """Each rank's partial product, in bfloat16 bits: Paddle's bf16 matmul on its halves."""
    import paddle

    main = paddle.static.Program()
    with paddle.static.program_guard(main):
        x = paddle.static.data("x", [ROWS, INNER // halves], "float32")
        w = paddle.static.data("w", [INNER // halves, COLS], "float32")
        product = paddle.matmul(x.astype("bfloat16"), w.astype("bfloat16"))
    exe = paddle.static.Executor(paddle.CPUPlace())
    size = INNER // halves
    out = []
    for i in range(halves):
        part = {"x": feed["x"][:, i * size : (i + 1) * size], "w": feed["w"][i * size : (i + 1) * size]}
        (bits,) = exe.run(main, feed=part, fetch_list=[product])
        out.append(np.asarray(bits))
    return out


def test_a_bfloat16_all_reduce_in_the_simulator_is_the_rule_on_each_ranks_partial():
    import paddle

    main, startup, x, w, product, out = _row_parallel_bf16()
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    autopar.shard_tensor(x, mesh, [None, "mp"])
    autopar.shard_tensor(w, mesh, ["mp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    (collective,) = dist.comm_ops(0)
    assert (collective.kind, collective.dtype, collective.bytes) == ("all_reduce", "bfloat16", ROWS * COLS * 2)
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((ROWS, INNER)).astype("float32"), "w": rng.standard_normal((INNER, COLS)).astype("float32")}
    result = autopar.simulate(dist, [feed], [product, out])
    whole, activated = result.fetches[0]
    summed = reduce(_partial_products(feed, 2), "sum", "bfloat16")
    assert whole.dtype == np.uint16  # a bfloat16 fetch, as Paddle hands it over
    np.testing.assert_array_equal(whole, summed)
    # the all_reduce's result was written back as a bfloat16 tensor: the gelu read it as one
    serial = paddle.static.Program()
    with paddle.static.program_guard(serial):
        bits = paddle.static.data("p", [ROWS, COLS], "float32")
        gelu = paddle.nn.functional.gelu(bits.astype("bfloat16")).astype("float32")
    (want,) = paddle.static.Executor(paddle.CPUPlace()).run(serial, feed={"p": widen(summed, "bfloat16")}, fetch_list=[gelu])
    np.testing.assert_array_equal(activated, want)



def test_check_compares_bfloat16_values_as_numbers():
    """``autopar.check`` reads a bfloat16 value as Paddle hands it over (its uint16 bits): it
    compares and sums the pieces as numbers (a partial product's pieces summed as bits were
    reported 4.98e+04 from serial), so the program checks clean."""
    main, startup, x, w, product, out = _row_parallel_bf16()
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    autopar.shard_tensor(x, mesh, [None, "mp"])
    autopar.shard_tensor(w, mesh, ["mp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    rng = np.random.default_rng(1)
    feed = {"x": rng.standard_normal((ROWS, INNER)).astype("float32"), "w": rng.standard_normal((INNER, COLS)).astype("float32")}
    report = autopar.check(dist, [feed])
    assert report.clean, str(report)
    assert "7 values compared" in str(report)

# ---- an AMP O2 program trained through the numerics twin ---------------------------------


def _compiled(axes: str, amp: Amp = O2, **strategy):
    """The ``amp`` MLP (O2 bfloat16, SGD, fp32 masters) on ``axes``: "dp" (2 ranks), "mp" (2 ranks:
    linear1 column-parallel, linear2 row-parallel), "dp_mp" (2 x 2)."""
    names = axes.split("_")
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]] if len(names) == 2 else [0, 1], dim_names=names)
    build = functools.partial(amp_mlp, widths=(8, 16, 16, 4), batch=12)
    seed = build(amp)
    if "dp" in names:
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    if "mp" in names:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))
    return build, seed, dist


def _moved(dist) -> dict[tuple[str, str], int]:
    """(kind, dtype) -> count of every rank's collectives, each checked against its carrier op
    in the rank program's text: the op reads and makes that dtype, and its bytes are the
    dtype's (2 an element for bfloat16)."""
    import paddle

    found: dict[tuple[str, str], int] = {}
    for rank in dist.mesh.ranks:
        plan = dist.rank_plan(rank)
        ops = list(plan.program.global_block().ops)
        for collective, position in plan.collectives:
            op = ops[position]
            dtype = getattr(paddle, collective.dtype)
            assert op.operand_source(0).dtype == op.result(0).dtype == dtype, (str(collective), str(op))
            found[(collective.kind.value, collective.dtype)] = found.get((collective.kind.value, collective.dtype), 0) + 1
    return found


CASES = [  # axes, Strategy fields, the collectives every rank's program moves by (kind, dtype) (None: not counted)
    ("dp", {}, {("all_reduce", "bfloat16"): 2}),
    ("dp", {"reduce_dtype": "float32"}, {("all_reduce", "float32"): 2}),
    ("dp", {"fuse_allreduce": False}, {("all_reduce", "bfloat16"): 2 * 6}),
    ("mp", {}, {("all_reduce", "bfloat16"): 2}),
    ("dp_mp", {}, {("all_reduce", "bfloat16"): 4 + 4}),
    ("dp_mp", {"reduce_dtype": "float32"}, {("all_reduce", "bfloat16"): 4, ("all_reduce", "float32"): 4}),
    ("dp", {"zero_stage": 1}, {("reduce_scatter", "bfloat16"): 2, ("all_gather", "bfloat16"): 2}),
    ("dp", {"zero_stage": 2}, {("reduce_scatter", "bfloat16"): 2, ("all_gather", "bfloat16"): 2}),
    ("dp", {"zero_stage": 2, "reduce_dtype": "float32"}, {("reduce_scatter", "float32"): 2, ("all_gather", "bfloat16"): 2}),
    ("dp", {"zero_stage": 3}, {("all_gather", "bfloat16"): 2 * 12, ("reduce_scatter", "bfloat16"): 2}),
    ("dp", {"zero_stage": 3, "reduce_dtype": "float32"}, {("all_gather", "bfloat16"): 2 * 12, ("reduce_scatter", "float32"): 2}),
    ("dp_mp", {"zero_stage": 1}, {("all_reduce", "bfloat16"): 4, ("reduce_scatter", "bfloat16"): 4, ("all_gather", "bfloat16"): 4}),
]


@pytest.mark.parametrize(
    "axes, strategy, moved", [pytest.param(*case, id="-".join([case[0], *(f"{k}={v}" for k, v in case[1].items())])) for case in CASES]
)
def test_an_o2_program_moves_bfloat16_and_its_twin_equals_the_serial_twin(axes, strategy, moved):
    build, seed, dist = _compiled(axes, **strategy)
    assert _moved(dist) == moved
    if "dp" in axes and not strategy.get("zero_stage"):  # replicated fp32 masters: the simulator compares their bits
        assert sum(name.endswith("_fp32_master_0") for name in dist.rank_plan(0).copies()) >= 2
    assert_twin_equals_serial(build, O2, seed, dist, random_feeds(seed.feeds, 3, classes=4))


def _serial_twin_with_rounded_gradients(build, amp, feeds):
    """The serial twin whose every gradient is rounded to ``amp.dtype`` before its update (a
    cast down and back up in front of each ``sgd_``): what reducing the whole gradient in that
    dtype once would change."""
    import paddle

    seed = build(amp)
    with paddle.static.program_guard(seed.main):
        for op in [op for op in seed.main.global_block().ops if op.name() == "pd_op.sgd_"]:
            paddle.pir.set_insertion_point(op)
            grad = op.operand_source(2)
            op.operand(2).set_source(paddle._C_ops.cast(paddle._C_ops.cast(grad, getattr(paddle, amp.dtype)), paddle.float32))
        paddle.pir.reset_insertion_point_to_end()
    return run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_o1_program_reduces_its_float32_gradients_in_low_precision_when_asked(dtype):
    """O1's gradients are float32 (its parameters are); ``reduce_dtype`` of the low precision
    halves the bytes of their sync: cast down, reduced in that dtype (float16: the real op, which
    this build registers; bfloat16: carried), cast back for the float32 update. (float16 programs
    are built as bf16 and retyped: autopar.testing.amp.)

    The run is held to a floor measured for what it adds, the gradients' rounding: the serial
    twin against the serial twin with every gradient rounded once. The distributed sum rounds
    twice (each rank's piece, then the sum), so it may lie up to twice that away, plus twice the
    program's own floor (:func:`assert_twin_equals_serial`'s)."""
    import paddle

    o1 = Amp("O1", dtype=dtype, optimizer="sgd")
    build, seed, dist = _compiled("dp", amp=o1, reduce_dtype=dtype)
    assert _moved(dist) == {("all_reduce", dtype): 2}
    _, _, plain = _compiled("dp", amp=o1)
    assert _moved(plain) == {("all_reduce", "float32"): 2}
    (bucket,), (plain_bucket,) = dist.comm_ops(0), plain.comm_ops(0)
    assert bucket.bytes * 2 == plain_bucket.bytes
    feeds = random_feeds(seed.feeds, 3, classes=4)
    start = paddle.get_rng_state()
    floor = measured_floor(build, o1, feeds)
    paddle.set_rng_state(start)
    serial = run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])
    paddle.set_rng_state(start)
    rounded = _serial_twin_with_rounded_gradients(build, o1, feeds)
    paddle.set_rng_state(start)
    result = autopar.simulate(twinned(dist), feeds, [seed.loss])
    for name, own in floor.parameters.items():
        gradient_floor = float(np.max(np.abs(rounded.parameters[name] - serial.parameters[name])))
        assert gradient_floor > 0  # (the rounding is there to measure)
        error = float(np.max(np.abs(as_float32(result.parameters[name]) - serial.parameters[name])))
        assert error <= 2 * gradient_floor + 2 * own, (name, error, gradient_floor, own)
    loss_floor = max(abs(float(a[0]) - float(b[0])) for a, b in zip(rounded.fetches, serial.fetches))
    for want, got in zip(serial.fetches, result.fetches):
        assert abs(float(got[0]) - float(want[0])) <= 2 * loss_floor + 2 * max(floor.losses)

