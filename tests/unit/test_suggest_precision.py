"""``autopar.suggest`` in mixed precision: a user's AMP O2 program (``paddle.amp.decorate`` +
``auto_cast``, docs/paddle_amp.md) is priced as the bfloat16 program it is and the search says
so; a float32 program asked ``precision="bf16"`` is priced as the mixed-precision program it
stands for (bfloat16 activations, GEMMs and collectives, fp32 masters and Adam states, ZeRO
sharding masters and states alike)."""

import warnings

import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.models import gpt_block_program

H100 = "h100-node"


def _mlp(level=None, batch=8):
    """Linear(64, 256) -> ReLU -> Linear(256, 16), cross-entropy, SGD: in float32, or written
    with Paddle's AMP as users write it (``level`` "O1" / "O2", bfloat16)."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 64], "float32")
        y = paddle.static.data("y", [batch, 1], "int64")
        model = paddle.nn.Sequential(paddle.nn.Linear(64, 256), paddle.nn.ReLU(), paddle.nn.Linear(256, 16))
        opt = paddle.optimizer.SGD(0.01, parameters=model.parameters(), multi_precision=level is not None)
        if level is None:
            logits = model(x)
        else:
            model, opt = paddle.amp.decorate(models=model, optimizers=opt, level=level, dtype="bfloat16")
            with paddle.amp.auto_cast(level=level, dtype="bfloat16"):
                logits = model(x)
        loss = paddle.nn.functional.cross_entropy(logits.astype("float32"), y).mean()
        opt.minimize(loss)
    return main, startup


PARAMS = 64 * 256 + 256 + 256 * 16 + 16  # the MLP's parameter elements


def test_an_o2_program_is_priced_in_bf16_with_its_fp32_masters():
    """Parameters and their gradients bfloat16 (2 + 2 bytes), the persistable fp32 masters (4) and
    the learning rate (4 bytes); the activations kept for the backward in their own dtypes:
    the bfloat16 cast of x and ReLU's output (2 bytes an element), the int64 label, the float32
    softmax and loss."""
    main, startup = _mlp("O2")
    plan = autopar.price_plan(main, (1, 1, 1), None, startup, cluster=H100)
    assert plan.precision == "bfloat16 (O2: parameters bfloat16, 4 fp32 master weights)"
    assert plan.price.parameter_memory == PARAMS * (2 + 2 + 4) + 4
    kept = 8 * 64 * 2 + 8 * 256 * 2 + 8 * 1 * 8 + 8 * 16 * 4 + 4
    assert plan.price.memory - plan.price.parameter_memory == kept
    main, startup = _mlp()
    fp32 = autopar.price_plan(main, (1, 1, 1), None, startup, cluster=H100)
    assert fp32.precision == "float32" and fp32.price.parameter_memory == PARAMS * (4 + 4) + 4


def test_suggest_on_an_o2_program_reports_bf16():
    main, startup = _mlp("O2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = autopar.suggest(main, 2, startup, cluster=H100, top=2)
    assert plans.precision.startswith("bfloat16 (O2") and all(plan.precision == plans.precision for plan in plans)
    assert "precision: bfloat16 (O2: parameters bfloat16, 4 fp32 master weights)" in str(plans)
    main, startup = _mlp("O1")
    o1 = autopar.suggest(main, 1, startup, cluster=H100, top=1)
    assert o1.precision == "bfloat16 (O1: parameters float32)"


def test_a_mixed_precision_program_is_priced_as_built_only():
    main, startup = _mlp("O2")
    assert autopar.price_plan(main, (1, 1, 1), None, startup, cluster=H100, precision="bf16").precision.startswith("bfloat16 (O2")
    with pytest.raises(AutoparError, match=r"price_plan: precision='fp32', but the program computes in bfloat16 \(O2"):
        autopar.price_plan(main, (1, 1, 1), None, startup, cluster=H100, precision="fp32")
    with pytest.raises(AutoparError, match="precision='fp16', but the program computes in bfloat16"):
        autopar.suggest(main, 1, startup, cluster=H100, precision="fp16")
    with pytest.raises(AutoparError, match="suggest: precision: unknown 'int8'"):
        autopar.suggest(main, 1, startup, cluster=H100, precision="int8")


@pytest.fixture(scope="module")
def gpt():
    return gpt_block_program(batch=16, seq=512, hidden=1024, heads=8, vocab=1024, layers=2, optimizer="adamw", seed=1, layer_calls=True)


def test_a_float32_program_priced_as_bf16_computes_and_communicates_in_bf16(gpt):
    """Data parallel on two H100s: its matmuls priced at the bfloat16 rate, its gradient
    all_reduce moving half the bytes; weights + gradients + states the same 16 bytes a
    parameter (4 + 4 + 8 in float32; 2 + 2 + 4 master + 8 in mixed precision)."""
    fp32 = autopar.price_plan(gpt.main, (2, 1, 1), None, gpt.startup, cluster=H100)
    bf16 = autopar.price_plan(gpt.main, (2, 1, 1), None, gpt.startup, cluster=H100, precision="bf16")
    assert bf16.precision.startswith("bfloat16 (a float32 program priced as mixed precision")
    assert bf16.price.sent == fp32.price.sent // 2
    assert bf16.price.compute < fp32.price.compute / 3
    assert bf16.price.parameter_memory == fp32.price.parameter_memory
    assert bf16.price.memory < fp32.price.memory  # the activations take half


def test_zero_shards_the_fp32_masters_with_the_adam_states(gpt):
    """ZeRO-1 over two data ranks: float32 holds 4 + 4 + 8 / 2 bytes a parameter; mixed precision
    2 + 2 + (4 master + 8 states) / 2 — two bytes less, both measured against the same plan."""
    zero = autopar.Strategy(zero_stage=1)
    plain = autopar.price_plan(gpt.main, (1, 1, 1), None, gpt.startup, cluster=H100)
    fp32 = autopar.price_plan(gpt.main, (2, 1, 1), zero, gpt.startup, cluster=H100)
    bf16 = autopar.price_plan(gpt.main, (2, 1, 1), zero, gpt.startup, cluster=H100, precision="bf16")
    per_param = plain.price.parameter_memory / 16  # (each parameter's 16 bytes unsharded; the few others are small)
    assert fp32.price.parameter_memory == pytest.approx(per_param * 12, rel=0.01)
    assert bf16.price.parameter_memory == pytest.approx(per_param * 10, rel=0.01)


def test_the_search_prices_every_plan_in_the_precision_asked(gpt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = autopar.suggest(gpt.main, 2, gpt.startup, cluster=H100, top=1, shapes=[(2, 1, 1)])
        bf16 = autopar.suggest(gpt.main, 2, gpt.startup, cluster=H100, top=1, shapes=[(2, 1, 1)], precision="bf16")
    assert fp32.precision == "float32" and bf16.precision.startswith("bfloat16")
    assert bf16[0].price.step < fp32[0].price.step / 3


def test_gradients_reduced_in_float32_as_asked_keep_their_bytes_in_bf16(gpt):
    """``Strategy(reduce_dtype="float32")``: the mixed-precision program's gradient all_reduces
    move float32, as the float32 program's do."""
    fp32 = autopar.price_plan(gpt.main, (2, 1, 1), None, gpt.startup, cluster=H100)
    asked = autopar.Strategy(reduce_dtype="float32")
    bf16 = autopar.price_plan(gpt.main, (2, 1, 1), asked, gpt.startup, cluster=H100, precision="bf16")
    assert bf16.price.sent == fp32.price.sent
    assert bf16.price.communication == pytest.approx(fp32.price.communication)


def test_the_twins_amp_programs_are_priced_by_the_dtypes_they_carry():
    """``autopar.testing.amp``'s programs as users write them, on two data ranks: an O2 SGD
    program's bfloat16 gradients all-reduced in half the bytes of the float32 program's; an O2
    AdamW program (the real adamw_ on the bf16 parameter and its master) holding 2 + 2 + 4 (master) + 8 (Adam) bytes a parameter; a float16 O1 program
    reported as such."""
    from autopar.testing.amp import Amp, amp_mlp

    def priced(amp):
        seed = amp_mlp(amp, widths=(64, 256, 16))
        return autopar.price_plan(seed.main, (2, 1, 1), None, seed.startup, cluster=H100)

    fp32, o2 = priced(Amp("O0")), priced(Amp("O2", "bfloat16", "sgd"))
    assert fp32.precision == "float32" and o2.precision.startswith("bfloat16 (O2")
    assert o2.price.sent == fp32.price.sent // 2 and o2.price.communication < fp32.price.communication
    adamw = priced(Amp("O2", "bfloat16", "adamw"))
    assert adamw.price.parameter_memory == pytest.approx(PARAMS * (2 + 2 + 4 + 8), abs=64)  # (+ the step's scalars)
    assert adamw.price.sent == o2.price.sent  # (its gradients all-reduced in bfloat16 too)
    assert priced(Amp("O1", "float16", "sgd")).precision == "float16 (O1: parameters float32)"
