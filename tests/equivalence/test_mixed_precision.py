"""Mixed-precision programs written with Paddle's AMP (``paddle.amp.decorate`` + ``auto_cast``)
compiled and run through the numerics twin equal the serial twin, within twice the program's
measured precision floor (autopar.testing.amp.assert_twin_equals_serial): O1 (bf16 and fp16)
and O2 (SGD and AdamW; bf16, and float16 with dynamic loss scaling on its float16 gradients,
run by the twin on float32 carriers) on dp, mp, dp x mp, a 2-stage pipeline and ZeRO-1/2/3. (O2's bf16 collectives on
dp x mp and ZeRO 1-3: tests/equivalence/test_amp_collectives.py.) Under a pipeline the
low-precision gradients are summed over the micro-batches in float32 and rounded once
(tests/unit/test_pipeline_accumulation_dtype.py): float16 ones could not be summed at all
before (this CPU build has no float16 add)."""

import functools

import pytest

import autopar
from autopar.testing.amp import Amp, amp_mlp, assert_twin_equals_serial, run_serial_twin, twinned
from autopar.testing.serial import random_feeds

# float16 O2 (the bf16 build retyped, run on float32 carriers by the twin) with GradScaler's
# dynamic loss scaling on its float16 gradients
FLOAT16_O2_SGD = Amp("O2", dtype="float16", optimizer="sgd", loss_scaling=True)
FLOAT16_O2_ADAMW = Amp("O2", dtype="float16", optimizer="adamw", loss_scaling=True)


def _compiled(amp: Amp, layout: str, micro_batches: int = 2):
    """``layout``: dp, mp, pp (2 ranks, ``micro_batches``), dpxmp (2 x 2), zero1 / zero2 / zero3 (dp = 2)."""
    zero = int(layout[-1]) if layout.startswith("zero") else 0
    if layout == "dpxmp":
        mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    else:
        mesh = autopar.ProcessMesh([0, 1], dim_names=["dp" if zero else layout])
    build = functools.partial(amp_mlp, widths=(8, 16, 16, 4), batch=12, stages=mesh if layout == "pp" else None)
    seed = build(amp)
    strategy = autopar.Strategy(zero_stage=zero)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    if "mp" in mesh.dim_names:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    if layout == "pp":
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches))
    return build, seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize(
    "amp, layout",
    [
        (Amp("O1", optimizer="sgd"), "dp"),
        (Amp("O1", optimizer="sgd"), "mp"),
        (Amp("O1", optimizer="sgd"), "pp"),
        (Amp("O1", optimizer="sgd"), "dpxmp"),
        (Amp("O1", optimizer="adamw"), "zero1"),
        (Amp("O1", optimizer="adamw"), "zero3"),
        (Amp("O1", optimizer="adamw"), "dp"),
        (Amp("O1", optimizer="adamw"), "mp"),
        (Amp("O1", dtype="float16", optimizer="sgd"), "mp"),
        (Amp("O1", dtype="float16", optimizer="adamw"), "dp"),
        (Amp("O2", optimizer="sgd"), "pp"),
        (Amp("O2", optimizer="adamw"), "dp"),
        (Amp("O2", optimizer="adamw"), "mp"),
        (Amp("O2", optimizer="adamw"), "pp"),
        (Amp("O2", optimizer="adamw"), "zero2"),
        (Amp("O2", optimizer="adamw"), "zero3"),
        (Amp("O2", optimizer="adamw"), "dpxmp"),
        *[(FLOAT16_O2_SGD, layout) for layout in ("dp", "mp", "pp", "zero2")],
        *[(FLOAT16_O2_ADAMW, layout) for layout in ("dp", "mp", "pp", "dpxmp", "zero1", "zero2", "zero3")],
    ],
    ids=str,
)
def test_the_twin_equals_the_serial_twin(amp, layout):
    build, seed, dist = _compiled(amp, layout)
    assert_twin_equals_serial(build, amp, seed, dist, random_feeds(seed.feeds, 3, classes=4))


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize(
    "amp",
    [
        Amp("O1", dtype="float16", optimizer="sgd"),
        Amp("O1", dtype="float16", optimizer="adamw"),
        Amp("O1", optimizer="adamw"),
        Amp("O2", optimizer="sgd"),
        Amp("O2", optimizer="adamw"),
    ],
    ids=str,
)
def test_a_pipeline_accumulates_low_precision_gradients_in_float32(amp, micro_batches):
    """O1's weight gradients (bf16 / fp16 until the update's cast) and O2's bf16 gradients are
    summed over the micro-batches in float32, rounded once: equal to the serial twin, whose
    whole-batch gradient is rounded once. (float16 had no add to sum them with.)"""
    build, seed, dist = _compiled(amp, "pp", micro_batches)
    assert_twin_equals_serial(build, amp, seed, dist, random_feeds(seed.feeds, 3, classes=4))


@pytest.mark.parametrize(
    "amp, micro_batches",
    [(Amp("O1", dtype="float16", optimizer="sgd"), 4), (Amp("O1", dtype="float16", optimizer="adamw"), 4), (Amp("O2", optimizer="sgd"), 2)],
    ids=str,
)
def test_gradient_accumulation_beside_data_parallelism_sums_low_precision_gradients_in_float32(amp, micro_batches):
    """Gradient accumulation (a one-stage pipeline) beside dp=2: the O1 float16 weight gradients
    are summed by the same runner in float32 (this build has no float16 add). O2 with 2
    micro-batches: 4 rows a rank and micro-batch and 4 classes make the last bias gradient's
    add_grad square, which this build's bf16 kernel gets wrong (the twin runs it in fp32)."""
    mesh = autopar.ProcessMesh([0, 1], dim_names=["dp"])
    build = functools.partial(amp_mlp, widths=(8, 16, 16, 4), batch=16)
    seed = build(amp)
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=1))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert_twin_equals_serial(build, amp, seed, dist, random_feeds(seed.feeds, 3, classes=4))


def test_a_fetched_bf16_gradient_of_a_pipeline_is_its_micro_batches_summed_as_numbers():
    """Fetching an O2 pipeline's bf16 gradient (partial over the micro-batches) sums its pieces
    in float32, rounded once (they were uint16 bit patterns summed as integers): equal to the
    serial twin's within a few bf16 roundings of its largest element (each micro-batch's piece
    rounded, then the sum); the gradient is made by a twinned op (add_grad): the value fetched
    is the one the twin makes for it."""
    import numpy as np
    import paddle

    from autopar.runtime.simulator import simulate
    from autopar.testing.amp import as_float32, run_serial_twin, twinned

    amp = Amp("O2", optimizer="sgd")
    build, seed, dist = _compiled(amp, "pp", micro_batches=2)
    gradient = next(op for op in seed.main.global_block().ops if op.name() == "pd_op.add_grad").result(1)  # the last bias's
    assert str(gradient.dtype) == "paddle.bfloat16"
    feeds = random_feeds(seed.feeds, 1, classes=4)
    start = paddle.get_rng_state()
    got = simulate(twinned(dist), feeds, [seed.loss, gradient]).fetches[0][1]
    paddle.set_rng_state(start)
    want = run_serial_twin(seed.main, seed.startup, feeds, [seed.loss, gradient]).fetches[0][1]
    assert got.dtype == np.uint16  # bf16 bits, as the runtime holds them
    np.testing.assert_allclose(as_float32(got), as_float32(want), rtol=0, atol=4 * 2.0**-8 * np.max(np.abs(as_float32(want))))


@pytest.mark.parametrize("amp", [Amp("O1", dtype="float16", optimizer="adamw", loss_scaling=True), FLOAT16_O2_ADAMW], ids=str)
def test_a_float16_overflow_in_one_micro_batch_of_a_pipeline_is_skipped_on_every_stage(amp):
    """Paddle's float16 O1 and O2 programs with dynamic loss scaling on 2 stages, 2 micro-batches
    (their fp16 gradients could not be summed before): an input of 1e5 in micro-batch 0's rows
    (beyond float16's 65504) overflows that micro-batch's gradients; the float32 sum keeps the
    inf, every stage skips the step, and the losses after it follow the serial twin's (whose
    scale was halved)."""
    import numpy as np

    _, seed, dist = _compiled(amp, "pp")
    feeds = random_feeds(seed.feeds, 4, classes=4)
    feeds[1]["x"][0, 0] = 1e5  # row 0: micro-batch 0's
    twin = twinned(dist)
    result, serial = autopar.simulate(twin, feeds, [seed.loss]), run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])
    assert np.isnan(serial.fetches[1][0]).all()  # the overflow is real
    for step, (got, want) in enumerate(zip(result.fetches, serial.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=2.0**-10, equal_nan=True, err_msg=f"loss at step {step}")
    before, after = autopar.simulate(twin, feeds[:1], []), autopar.simulate(twin, feeds[:2], [])
    for name, value in before.parameters.items():  # the overflowing step is skipped on both stages
        np.testing.assert_array_equal(after.parameters[name], value, err_msg=name)


def test_a_pipeline_fetch_no_rank_makes_is_refused_by_name():
    """The loss scale, a state each stage keeps and no stage's compute makes, fetched from a
    pipeline: refused naming it (it was an AttributeError from inside the assembly)."""
    from autopar.errors import AutoparError
    from autopar.testing.amp import twinned

    mesh = autopar.ProcessMesh([0, 1], dim_names=["pp"])
    seed = amp_mlp(Amp("O1", loss_scaling=True), widths=(8, 16, 16, 4), batch=12, stages=mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    with pytest.raises(AutoparError, match="no rank made its piece of the fetched loss_scaling_0"):
        autopar.simulate(twinned(dist), random_feeds(seed.feeds, 1, classes=4), [seed.loss, "loss_scaling_0"])


def test_a_float16_o2_twin_moves_float16_through_its_collectives():
    """The twin carries float16 O2's values in float32 but hands every collective the float16
    value its Collective says it moves (dp's gradient syncs, ZeRO-3's parameter all_gathers and
    gradient reduce_scatters, mp's row-parallel all_reduce), so the runtime sums float16 by the
    low-precision rule as on a GPU; a float32 carrier there would be refused by that rule."""
    for layout in ("dp", "mp", "zero3"):
        _, seed, dist = _compiled(FLOAT16_O2_ADAMW, layout)
        plan = twinned(dist).rank_plan(0)
        ops = list(plan.program.global_block().ops)
        moved = {c.dtype for c, _ in plan.collectives}
        assert "float16" in moved, (layout, moved)
        for collective, position in plan.collectives:
            op = ops[position]
            values = [v for v in (*op.operands_source(), *op.results()) if v.initialized()]
            assert {str(v.dtype).removeprefix("paddle.") for v in values} == {collective.dtype}, (layout, str(collective), op.name())


def test_a_float16_o2_pipeline_sums_its_float16_gradients_in_float32():
    """Under a pipeline the values the update reads cross from the backward as float16 (the twin
    carries them up after the crossing), so the runner sums each micro-batch's float16 gradient in
    float32 and rounds once (tests/unit/test_pipeline_accumulation_dtype.py), as for a real
    float16 program; a float32 carrier crossing would be summed unrounded."""
    from autopar.runtime.host_plan import build_host_plan
    from autopar.schedule import F

    _, seed, dist = _compiled(FLOAT16_O2_SGD, "pp")
    for rank in dist.mesh.ranks:
        plan = twinned(dist).rank_plan(rank)
        host = build_host_plan(plan)
        ops = list(plan.program.global_block().ops)
        key_of = {name: key for key, name in host.names.items()}
        gradients = [ops[key_of[n][0]].result(key_of[n][1]) for n, phase in zip(host.accumulated, host.accumulated_phases) if phase.kind is not F]
        assert gradients and {str(v.dtype) for v in gradients} == {"paddle.float16"}, (rank, [str(v.dtype) for v in gradients])
