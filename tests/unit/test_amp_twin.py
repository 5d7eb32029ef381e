"""The numerics twin (autopar.testing.amp): what it computes, what it rewrites, and that a
twinned rank plan still points at the ops it held."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.testing.amp import Amp, amp_mlp, as_float32, twin_program, twinned

paddle.enable_static()


def _round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_a_twinned_matmul_is_a_bf16_gemm_accumulating_in_fp32():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [3, 5], "float32")
        y = paddle.static.data("y", [4, 5], "float32")
        out = paddle.matmul(x.astype("bfloat16"), y.astype("bfloat16"), transpose_y=True).astype("float32")
    done = twin_program(main)
    assert len(done.replaced) == 1 and len(done.made_for) == 3  # two inputs cast up, one result cast down
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((3, 5)).astype("float32"), "y": rng.standard_normal((4, 5)).astype("float32")}
    (got,) = paddle.static.Executor().run(main, feed=feed, fetch_list=[out])
    want = _round_to_bfloat16(_round_to_bfloat16(feed["x"]) @ _round_to_bfloat16(feed["y"]).T)
    np.testing.assert_array_equal(got, want)


def test_only_low_precision_matmuls_are_rewritten():
    fp32 = amp_mlp(Amp(level="O0"))
    done = twin_program(fp32.main)
    assert not done.replaced and not done.made_for
    o1 = amp_mlp(Amp(level="O1"))
    twin_program(o1.main)
    matmuls = [op for op in o1.main.global_block().ops if op.name() in ("pd_op.matmul", "pd_op.matmul_grad")]
    assert len(matmuls) == 4 and all(str(v.dtype) == "paddle.float32" for op in matmuls for v in op.operands_source() if v.initialized())


@pytest.mark.parametrize("axis", ["dp", "pp"])
def test_a_twinned_plan_points_at_the_ops_it_held(axis):
    mesh = autopar.ProcessMesh([0, 1], dim_names=[axis])
    seed = amp_mlp(Amp(level="O1"), widths=(8, 16, 16, 4), stages=mesh if axis == "pp" else None)
    strategy = autopar.Strategy()
    if axis == "dp":
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    else:
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    plan, twin = dist.rank_plan(0), twinned(dist).rank_plan(0)
    ops, twin_ops = list(plan.program.global_block().ops), list(twin.program.global_block().ops)
    assert len(twin_ops) > len(ops)
    assert [ops[p].name() for _, p in plan.collectives] == [twin_ops[p].name() for _, p in twin.collectives]
    assert [ops[p].name() for p in plan.op_positions] == [twin_ops[p].name() for p in twin.op_positions]
    if axis == "pp":
        assert sorted(op for piece in twin.pipeline.pieces for op in piece.ops) == list(range(len(twin_ops)))
        assert [str(step) for step in twin.pipeline.steps] == [str(step) for step in plan.pipeline.steps]


def test_a_bf16_tensor_read_as_its_bits_is_widened_exactly():
    bits = np.array([0x3F80, 0xBE40, 0x7F80], dtype=np.uint16)  # 1.0, -0.1875, inf
    np.testing.assert_array_equal(as_float32(bits), np.array([1.0, -0.1875, np.inf], dtype=np.float32))


def test_a_float16_program_is_the_bf16_build_retyped_and_its_twin_overflows_as_fp16():
    from autopar.testing.amp import run_serial_twin
    from autopar.testing.serial import random_feeds

    fp16 = amp_mlp(Amp(level="O1", dtype="float16", loss_scaling=True))
    dtypes = {str(v.dtype) for op in fp16.main.global_block().ops for v in op.results() if v.initialized() and v.is_dense_tensor_type()}
    assert "paddle.float16" in dtypes and "paddle.bfloat16" not in dtypes
    feeds = random_feeds(fp16.feeds, 3, classes=4)
    feeds[1]["x"][0, 0] = 1e5  # beyond float16's 65504, within bf16's range
    run = run_serial_twin(fp16.main, fp16.startup, feeds, [fp16.loss])
    assert not np.isfinite(run.fetches[1][0]) and np.isfinite(run.fetches[2][0])
    np.testing.assert_array_equal(run.parameters["loss_scaling_0"], [512.0])  # 1024 halved once, not yet doubled again
    bf16 = amp_mlp(Amp(level="O1", dtype="bfloat16", loss_scaling=True))
    assert np.isfinite(run_serial_twin(bf16.main, bf16.startup, feeds, [bf16.loss]).fetches[1][0])


def test_o2_adamw_is_the_real_update_and_the_twin_runs_it_on_the_master():
    o2 = amp_mlp(Amp(level="O2", optimizer="adamw"))
    updates = [op for op in o2.main.global_block().ops if op.name() == "pd_op.adamw_"]
    assert updates and all(
        str(op.operand_source(0).dtype) == "paddle.bfloat16" and str(op.operand_source(8).dtype) == "paddle.float32"
        and op.attrs()["multi_precision"] for op in updates
    )  # fmt: skip
    twin_program(o2.main)
    names = [op.name() for op in o2.main.global_block().ops]
    assert names.count("pd_op.assign_out_") == len(updates) == names.count("pd_op.adamw_")
    assert all(str(op.operand_source(0).dtype) == "paddle.float32" for op in o2.main.global_block().ops if op.name() == "pd_op.adamw_")


def test_a_bf16_bias_gradient_is_the_column_sum_as_in_fp32():
    """This CPU build's bf16 add_grad of a square input returns the row sums as the bias
    gradient (measured); the twin runs it in fp32 on the rounded values."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x, b = paddle.static.data("x", [4, 4], "float32"), paddle.static.data("b", [4], "float32")
        g = paddle.static.data("g", [4, 4], "float32")
        _, db = paddle._C_ops.add_grad(x.astype("bfloat16"), b.astype("bfloat16"), g.astype("bfloat16"), -1)
        db = db.astype("float32")
    twin_program(main)
    feed = {"x": np.zeros((4, 4), "float32"), "b": np.zeros(4, "float32"), "g": np.arange(16, dtype="float32").reshape(4, 4)}
    (got,) = paddle.static.Executor().run(main, feed=feed, fetch_list=[db])
    np.testing.assert_array_equal(got, feed["g"].sum(axis=0))
