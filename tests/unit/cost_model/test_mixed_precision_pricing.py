"""The cost model in mixed precision: each op computes at its dtype's rate and moves its
operands' own bytes, batched matmuls (attention) at the device's batched rate, a parameter's
master copy held beside its optimizer states (and sharded with them), a float32 program priced
as the bfloat16 program it stands for (cost_model/precision.py)."""

import pytest

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import collective_time, shipped_profile
from autopar.cost_model.compute import compute_dtype, op_cost
from autopar.cost_model.memory import TensorInfo, memory_per_rank
from autopar.cost_model.precision import AS_BUILT, Precision, program_precision, rescaled_time
from autopar.errors import CostModelError

H100 = shipped_profile("h100-node")
GEMM = [(8192, 8192), (8192, 8192)], [(8192, 8192)]  # compute-bound on every dtype


def test_a_bf16_matmul_is_priced_faster_than_fp32_by_the_profiles_measured_ratio():
    """h100-node measured cuBLAS GEMMs at 710 TFLOP/s in bfloat16 and 50.6 in float32
    (shared/measured/H100.md): a compute-bound matmul is priced 14x faster in bfloat16."""
    ins, outs = GEMM
    fp32 = op_cost("pd_op.matmul", ins, outs, dtype="float32").time(H100, "float32")
    bf16 = op_cost("pd_op.matmul", ins, outs, dtype="bfloat16").time(H100, "bfloat16")
    assert fp32 / bf16 == pytest.approx(7.1e14 / 5.057e13)
    assert bf16 == pytest.approx(2 * 8192**3 / 7.1e14)


def test_attentions_batched_matmuls_run_at_the_measured_batched_rate():
    """``q @ k^T`` (both operands batched) at the measured score-bmm rate (bfloat16 300 TFLOP/s,
    float32 43); an activation by a 2-D weight at the GEMM rate."""
    shapes = [(1, 64, 2048, 128), (1, 64, 2048, 128)], [(1, 64, 2048, 2048)]
    scores = op_cost("matmul", *shapes, {"transpose_y": True}, dtype="bfloat16")
    assert scores.batched
    assert scores.time(H100, "bfloat16") == pytest.approx(scores.flops / 3.0e14)
    assert op_cost("matmul", *shapes, {"transpose_y": True}).time(H100, "float32") == pytest.approx(scores.flops / 4.3e13)
    linear = op_cost("matmul", [(8, 2048, 4096), (4096, 4096)], [(8, 2048, 4096)])
    assert not linear.batched and linear.time(H100, "bfloat16") == pytest.approx(linear.flops / 7.1e14)


def test_each_operand_moves_the_bytes_of_its_own_dtype():
    """A cast from float32 to bfloat16 reads 4 bytes an element and writes 2; an add of bfloat16
    values moves 2 a byte each; the op computes in its first floating input's dtype."""
    n = 1 << 20
    cast = op_cost("pd_op.cast", [(n,)], [(n,)], dtype="float32", dtypes=["float32", "bfloat16"])
    assert cast.bytes == 6 * n
    add = op_cost("pd_op.add", [(n,), (n,)], [(n,)], dtype="bfloat16", dtypes=["bfloat16"] * 3)
    assert add.bytes == 6 * n and add.time(H100, "bfloat16") == pytest.approx(6 * n / 2.95e12)
    assert compute_dtype(["int64", "bfloat16"], ["float32"]) == "bfloat16"
    assert compute_dtype(["int64"], ["bool"]) == "float32"
    with pytest.raises(CostModelError, match="2 operand dtypes given for 3 operands"):
        op_cost("pd_op.add", [(n,), (n,)], [(n,)], dtypes=["bfloat16"] * 2)


def test_a_master_weight_is_held_beside_the_states_and_sharded_with_them():
    """An O2 parameter: bfloat16 (2 bytes) and its gradient (2), Adam's two float32 states (8)
    and its float32 master (4); ZeRO-1 shards the master with the states."""
    mesh = ProcessMesh([0, 1], ["dp"])
    w = TensorInfo("w", (1024, 1024), "bfloat16", master="float32")
    act = TensorInfo("h", (8, 1024), "bfloat16")
    whole = memory_per_rank(mesh.ranks, [w], [act], optimizer="adam")[0]
    n = 1024 * 1024
    assert (whole.parameters, whole.gradients, whole.optimizer_states, whole.activations) == (2 * n, 2 * n, 12 * n, 2 * 8 * 1024)
    zero1 = memory_per_rank(mesh.ranks, [w], optimizer="adam", state_dists={"w": DistAttr(mesh, [0, -1])})[1]
    assert zero1.optimizer_states == 12 * n // 2
    plain = memory_per_rank([0], [TensorInfo("w", (1024, 1024))], optimizer="adam")[0]  # float32, no master
    assert (plain.parameters, plain.optimizer_states) == (4 * n, 8 * n)


def test_a_float32_program_priced_as_bf16_retypes_what_it_holds_not_the_optimizer_states():
    bf16 = Precision.parse("bf16")
    assert bf16.compute == "bfloat16" and Precision.parse(None) is AS_BUILT and Precision.parse("fp32") == AS_BUILT
    assert bf16.dtype("float32", "activation") == "bfloat16" and bf16.dtype("paddle.float32", "parameter") == "bfloat16"
    assert bf16.dtype("float32", "state") == "float32" and bf16.dtype("int64", "feed") == "int64"
    assert bf16.master_of("float32") == "float32" and AS_BUILT.master_of("float32") is None
    assert bf16.ratio("float32") == 0.5 and AS_BUILT.ratio("float32") == 1.0
    with pytest.raises(CostModelError, match="unknown 'int8'"):
        Precision.parse("int8")


def test_a_bf16_gradient_all_reduce_moves_half_the_bytes():
    """Rescaled by the alpha-beta formula: a large all_reduce takes about half the time, a tiny
    one (latency-bound) about the same."""
    group = tuple(range(8))
    halved = {}
    for nbytes in (1 << 30, 64):
        planned = collective_time("all_reduce", group, nbytes, H100)
        halved[nbytes] = rescaled_time("all_reduce", group, nbytes, planned, 0.5, H100) / planned
        assert halved[nbytes] * planned == pytest.approx(collective_time("all_reduce", group, nbytes / 2, H100))
    assert halved[1 << 30] == pytest.approx(0.5, abs=0.02) and halved[64] == pytest.approx(1.0, abs=0.01)


def test_the_programs_precision_in_words():
    assert program_precision(["float32"], ["float32"]) == "float32"
    assert program_precision(["bfloat16"], ["float32"]) == "bfloat16 (O1: parameters float32)"
    assert program_precision(["bfloat16"], ["bfloat16"], 4) == "bfloat16 (O2: parameters bfloat16, 4 fp32 master weights)"
