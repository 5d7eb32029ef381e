"""An overflow in one rank's piece of a gradient, on demand: programs with dynamic loss scaling
and a *probe* feed that makes one element of one gradient non-finite at a chosen step.

Dynamic loss scaling skips a step when any gradient holds an inf or nan; a distributed run
must skip it on every rank together, although only the rank holding the overflowing piece can
see it (tests/equivalence/test_found_inf.py). The probe does this inside the user's program, so
the serial run sees the same overflow:

    loss = cross_entropy(...) + 0.0 * sum(sqrt(probe + 0.0 * h))        # h = linear1(x)

The added term is 0 in the forward (sqrt(1) or sqrt(0) times 0). Its gradient at ``h`` is 0
where ``probe`` is 1 and nan where it is 0 (sqrt's slope at 0 is infinite, times the zero
factor), so one zero in ``probe`` at step ``k`` makes the gradients of linear1's weight and bias
non-finite in exactly the piece of the rank that holds that element of ``h``: the last row
(the last data-parallel rank's), the last column (the last tensor-parallel rank's), stage 0 of
a pipeline. The scaler is Paddle's float16 path forced on a program whose gradients are fp32
(docs/paddle_amp.md, Q3), the only form that emits the scaling ops on this CPU build;
``low_precision`` runs the forward under bf16 O1 autocast, ``float16_o2`` builds Paddle's float16
O2 program, whose scaling ops check the float16 gradients (run both through the numerics twin).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autopar.testing.amp import Amp, minimize, retype_to_float16
from autopar.testing.models import SeedProgram

INIT_LOSS_SCALING = 1024.0
INCR_EVERY_N_STEPS = 2  # the scale doubles after two good steps: a run sees it move both ways


def probed_mlp(
    optimizer: str = "adamw", low_precision: bool = False, stages: Any = None, batch: int = 4, widths: Sequence[int] = (8, 16, 4),
    float16_o2: bool = False,
) -> SeedProgram:  # fmt: skip
    """Linear -> GELU -> Linear, cross-entropy on fp32 logits, the probe term (module
    docstring), trained with dynamic loss scaling as a user writes it (``paddle.amp.decorate``,
    ``GradScaler.scale`` / ``minimize``). ``stages``: a pipeline mesh: linear1 and the probe's
    sum on ``stages[0]``, the rest on ``stages[1]``. ``values["scaled"]``: the scaled loss
    (over the loss: the scale the step ran with). ``float16_o2``: Paddle's float16 O2 program
    instead (float16 parameters and gradients, fp32 masters, the scaling ops on the float16
    gradients: built as autopar.testing.amp builds it; run it through the numerics twin)."""
    import paddle

    level = "O2" if float16_o2 else "O1"

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x = paddle.static.data("x", [batch, widths[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        probe = paddle.static.data("probe", [batch, widths[1]], "float32")
        layers = {"linear1": paddle.nn.Linear(widths[0], widths[1]), "linear2": paddle.nn.Linear(widths[1], widths[2])}
        model = paddle.nn.Sequential(*layers.values())
        if optimizer == "sgd":
            opt = paddle.optimizer.SGD(0.05, parameters=model.parameters(), multi_precision=True)
        else:
            opt = paddle.optimizer.AdamW(0.05, parameters=model.parameters(), weight_decay=0.01, multi_precision=True)
        model, opt = paddle.amp.decorate(models=model, optimizers=opt, level=level, dtype="bfloat16")  # float16: retyped below

        def first(x: Any, probe: Any) -> tuple[Any, Any]:
            with paddle.amp.auto_cast(enable=low_precision or float16_o2, level=level, dtype="bfloat16"):
                h = layers["linear1"](x)
            return h, paddle.sum(paddle.sqrt(probe + 0.0 * h))

        def second(h: Any, poke: Any) -> Any:
            with paddle.amp.auto_cast(enable=low_precision or float16_o2, level=level, dtype="bfloat16"):
                logits = layers["linear2"](paddle.nn.functional.gelu(h))
            return paddle.mean(paddle.nn.functional.cross_entropy(logits.astype("float32"), label)) + 0.0 * poke

        if stages is None:
            loss = second(*first(x, probe))
        else:
            import autopar

            loss = autopar.shard_op(second, stages[1])(*autopar.shard_op(first, stages[0])(x, probe))
        if float16_o2:
            scaled = minimize(Amp("O2", "float16", optimizer, loss_scaling=True, init_loss_scaling=INIT_LOSS_SCALING), opt, loss)["scaled"]
        else:
            scaled = minimize_scaled(opt, loss)
    if float16_o2:
        retype_to_float16(main)
        retype_to_float16(startup)
    return SeedProgram(main, startup, {"x": x, "label": label, "probe": probe}, loss, layers, {"scaled": scaled})


def minimize_scaled(opt: Any, loss: Any) -> Any:
    """``GradScaler(use_dynamic_loss_scaling=True)``'s float16 path, forced (bf16 disables it)."""
    import paddle
    from paddle.amp.auto_cast import amp_global_state
    from paddle.base import core

    opt._amp_vartype = core.DataType.FLOAT16
    state = amp_global_state()
    before, state.amp_dtype = state.amp_dtype, "float16"
    try:
        scaler = paddle.amp.GradScaler(
            init_loss_scaling=INIT_LOSS_SCALING, incr_every_n_steps=INCR_EVERY_N_STEPS, decr_every_n_nan_or_inf=1,
            use_dynamic_loss_scaling=True,
        )  # fmt: skip
        scaled = scaler.scale(loss)
        scaler.minimize(opt, scaled)
    finally:
        state.amp_dtype = before
    return scaled


def probed_feeds(seed: SeedProgram, steps: int, overflow_at: int | None, element: tuple[int, int] = (-1, -1)) -> list[dict[str, np.ndarray]]:
    """``steps`` random feeds; ``probe`` all ones but at ``element`` of step ``overflow_at``
    (the last row and column by default: the last rank's piece along dp and mp)."""
    rng = np.random.default_rng(0)
    classes = int(seed.layers["linear2"].weight.shape[1])
    feeds = []
    for step in range(steps):
        probe = np.ones(seed.feeds["probe"].shape, "float32")
        if step == overflow_at:
            probe[element] = 0.0
        feeds.append({
            "x": rng.standard_normal(seed.feeds["x"].shape).astype("float32"),
            "label": rng.integers(0, classes, seed.feeds["label"].shape).astype("int64"),
            "probe": probe,
        })  # fmt: skip
    return feeds
