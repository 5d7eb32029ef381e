"""Collectives in low precision (issue 38 item 3): values autopar's collectives move in
bfloat16 are carried in the rank programs and moved by the runtime as bfloat16 — reduced by the
one rule of :mod:`autopar.low_precision`, written back as bfloat16 tensors.

A forward-only bfloat16 program runs on this CPU build as it is (bf16 matmul's forward kernel
exists): a row-parallel matmul's partial outputs are all-reduced in bfloat16. Its result is
checked bit for bit against the rule applied to each rank's partial product, computed by Paddle
on the rank's half of the operands."""

from __future__ import annotations

import numpy as np

import autopar
from autopar.low_precision import reduce, widen

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
