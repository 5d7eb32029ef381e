"""Gradient accumulation (``PipelineConfig(stages=1)``: one stage on the whole mesh; forward
and backward once per micro-batch, the update once per step on the summed gradients) equals
serial in the simulator — beside data parallelism with every ZeRO stage, tensor and sequence
parallelism, recompute, under 1F1B / FThenB / ZB-H1, on an unseeded program — and holds one
micro-batch's activations. SGD and momentum (linear in the gradient: Adam would turn the
different order of the micro-batch sums into visible noise on the attention's key bias, whose
gradient is zero up to rounding)."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.pricing import price
from autopar.testing.models import SeedProgram, annotate_megatron, gpt_block_program
from autopar.testing.serial import assert_simulation_equals_serial


def _gpt(names, shape, optimizer="sgd", seed=None):
    program = gpt_block_program(batch=8, seq=4, hidden=16, heads=2, vocab=24, layers=2, optimizer=optimizer, seed=seed)
    mesh = autopar.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), names)
    if "mp" in names:
        annotate_megatron(program, mesh)
    if "dp" in names:
        autopar.shard_tensor(program.feeds["ids"], mesh, ["dp", None])
    return program, mesh


def _accumulating(micro_batches, schedule="1F1B", **fields):
    return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule, stages=1), **fields)


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB", "ZBH1"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_accumulation_beside_data_parallelism_equals_serial(zero, schedule):
    seed, mesh = _gpt(["dp"], [2], optimizer="momentum")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=_accumulating(4, schedule, zero_stage=zero))
    assert len(dist.schedule(0)) == (13 if schedule == "ZBH1" else 9)  # 4 x (F, B) or (F, I, W), then the update
    assert_simulation_equals_serial(seed, dist, classes=24)


@pytest.mark.parametrize("fields", [{}, {"sequence_parallel": True, "recompute": True}], ids=["tp", "sp+recompute"])
def test_accumulation_beside_tensor_parallelism_equals_serial(fields):
    seed, mesh = _gpt(["dp", "mp"], [2, 2])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=_accumulating(2, **fields))
    assert_simulation_equals_serial(seed, dist, classes=24)


def test_unseeded_user_program_with_odd_sizes():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [6, 7], "float32")
        label = paddle.static.data("label", [6, 1], "int64")
        hidden = paddle.nn.LayerNorm(5)(paddle.tanh(paddle.nn.Linear(7, 5)(x)))
        loss = paddle.nn.functional.cross_entropy(paddle.nn.Linear(5, 3)(hidden), label).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    mesh = autopar.ProcessMesh([0], ["dp"])
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=_accumulating(3))
    seed = SeedProgram(main, startup, {"x": x, "label": label}, loss)
    assert_simulation_equals_serial(seed, dist, classes=3)


def test_accumulation_holds_one_micro_batch_of_activations():
    seed, mesh = _gpt(["dp"], [2], seed=1)
    whole = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    accumulated = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=_accumulating(4))
    a, b = price(whole.state), price(accumulated.state)
    activations = a.memory - a.parameter_memory
    assert b.parameter_memory == a.parameter_memory
    assert b.memory - b.parameter_memory == pytest.approx(activations / 4, rel=0.05)
    assert b.bubble == 0.0


def test_wrong_uses_are_refused_by_name():
    with pytest.raises(autopar.AutoparError, match="Interleaved1F1B needs stages >= 2"):
        autopar.PipelineConfig(micro_batches=2, schedule="Interleaved1F1B", stages=1)
    with pytest.raises(autopar.AutoparError, match="stages must be >= 1"):
        autopar.PipelineConfig(micro_batches=2, stages=0)
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh([[0], [1]], ["pp", "dp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        loss = autopar.shard_op(paddle.nn.Linear(6, 2), mesh[0])(x).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    with pytest.raises(autopar.AutoparError, match=r"PipelineConfig\(stages=1\) places the layers itself"):
        autopar.compile(main, mesh, startup_program=startup, strategy=_accumulating(2))
