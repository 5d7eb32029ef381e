"""A pipeline sums its micro-batches' low-precision gradients in float32 and rounds the step's
sum once (autopar.runtime.pipeline_runner.Float32Sums), as Megatron's and Paddle's fp32
``main_grad``: a running sum in bf16 / fp16 rounds every partial sum and loses what the
micro-batches' cancelling parts leave; this CPU build has no float16 ``add`` at all."""

import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.low_precision import STORAGE, narrow, reduce, widen
from autopar.pipeline_lowering import ACCUMULATE
from autopar.runtime.pipeline_runner import Float32Sums, PipelineRunner, sum_over_micro_batches
from autopar.testing.amp import Amp, amp_mlp

# micro-batch gradients whose sum (1) a running low-precision sum loses: 2^k + 1 rounds to 2^k
# (ties to even) when 2^k is past the dtype's integer range, then 2^k - 2^k = 0
CANCELLING = {"bfloat16": [256.0, 1.0, -256.0], "float16": [2048.0, 1.0, -2048.0]}


@pytest.mark.parametrize("dtype", sorted(CANCELLING))
def test_cancelling_micro_batches_keep_their_float32_sum(dtype):
    parts = [narrow(np.full((2, 3), v, np.float32), dtype) for v in CANCELLING[dtype]]
    assert np.all(widen(reduce(parts, "sum", dtype), dtype) == 0.0)  # a low-precision running sum loses it
    sums, total = Float32Sums(), parts[0]
    for part in parts[1:]:
        total = sums.add("w@GRAD", total, part, dtype)
    assert total.dtype == STORAGE[dtype]
    assert np.all(widen(total, dtype) == 1.0)


@pytest.mark.parametrize("dtype", sorted(CANCELLING))
def test_a_fetched_low_precision_value_sums_its_micro_batch_pieces_in_float32(dtype):
    parts = [narrow(np.full((3,), v, np.float32), dtype) for v in CANCELLING[dtype]]
    total = sum_over_micro_batches(parts, dtype)
    assert total.dtype == STORAGE[dtype]
    assert np.all(widen(total, dtype) == 1.0)
    assert sum_over_micro_batches([np.ones(2, np.float32)] * 3, "float32").tolist() == [3.0, 3.0]


def test_the_step_sum_is_rounded_once_not_per_micro_batch():
    # bf16 spacing at 256 is 2: 256 + 0.75 + 0.75 is 257.5 -> 258 rounded once; rounded per
    # partial sum, 256.75 -> 256 and again 256
    parts = [narrow(np.array([v], np.float32), "bfloat16") for v in (256.0, 0.75, 0.75)]
    sums, total = Float32Sums(), parts[0]
    for part in parts[1:]:
        total = sums.add("g", total, part, "bfloat16")
    assert widen(total, "bfloat16")[0] == 258.0
    assert widen(reduce(parts, "sum", "bfloat16"), "bfloat16")[0] == 256.0


def test_a_copy_written_meanwhile_starts_a_new_sum():
    sums = Float32Sums()
    one = narrow(np.array([1.0], np.float32), "bfloat16")
    sums.add("g", one, one, "bfloat16")  # 2
    rewritten = narrow(np.array([10.0], np.float32), "bfloat16")  # not what was handed out
    assert widen(sums.add("g", rewritten, one, "bfloat16"), "bfloat16")[0] == 11.0


def test_a_value_not_held_as_its_dtype_is_refused_by_name():
    with pytest.raises(AutoparError, match="w@GRAD.*bfloat16.*float32"):
        Float32Sums().add("w@GRAD", np.zeros(2, np.float32), np.zeros(2, np.float32), "bfloat16")


@pytest.mark.parametrize("dtype", sorted(CANCELLING))
def test_the_runner_accumulates_an_o1_programs_low_precision_gradients_in_float32(dtype):
    """Stage 0 of an O1 pipeline accumulates its weight gradients in the low precision (their
    cast to fp32 reads the sum, in the update) and its bias gradients in fp32: each micro-batch's
    copy set to the cancelling parts, the runner's ACCUMULATE actions leave micro-batch 0's copy
    at their exact sum, 1, in both (a bf16 / fp16 running sum gives 0; fp16 has no add here)."""
    mesh = autopar.ProcessMesh([0, 1], dim_names=["pp"])
    seed = amp_mlp(Amp("O1", dtype=dtype), widths=(8, 16, 16, 4), batch=12, stages=mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=3))
    plan = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy).rank_plan(0)
    runner = PipelineRunner(plan, [])
    made = _stage_accumulated(plan, runner.hosts[0], stage=0)
    assert sorted(set(made.values())) == sorted({dtype, "float32"}), made
    for j, (shape, held) in ((j, _shape_and_dtype(plan, runner.hosts[0], j)) for j in made):
        for k, value in enumerate(CANCELLING[dtype]):
            runner.write(runner.hosts[k].accumulated[j], _held(np.full(shape, value, np.float32), held))
    for action in plan.pipeline.steps:
        if action.kind is ACCUMULATE and action.stage == 0:
            runner._accumulate(action)
    for j, held in made.items():
        total = runner.read(runner.hosts[0].accumulated[j])
        assert total.dtype == STORAGE.get(held, np.dtype(np.float32))
        got = widen(total, held) if held in STORAGE else total
        assert np.all(got == 1.0), (runner.hosts[0].accumulated[j], held, got)


def _stage_accumulated(plan, host, stage):
    """Index into ``host.accumulated`` -> the value's dtype, for ``stage``'s gradients."""
    return {
        j: _shape_and_dtype(plan, host, j)[1]
        for j, phase in enumerate(host.accumulated_phases) if phase.stage == stage
    }  # fmt: skip


def _shape_and_dtype(plan, host, j):
    position, result = next(key for key, name in host.names.items() if name == host.accumulated[j])
    value = list(plan.program.global_block().ops)[position].result(result)
    return list(value.shape), str(value.dtype).removeprefix("paddle.")


def _held(array, dtype):
    return narrow(array, dtype) if dtype in STORAGE else array
