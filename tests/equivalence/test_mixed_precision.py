"""Mixed-precision programs written with Paddle's AMP (``paddle.amp.decorate`` + ``auto_cast``)
compiled and run through the numerics twin equal the serial twin, within twice the program's
measured precision floor (autopar.testing.amp.assert_twin_equals_serial), for the strategies
whose collectives move fp32 values (an O1 program's gradients are fp32; O2 with AdamW updates
fp32 masters from fp32 gradients) and the pipeline (its transfers move bf16 activations as
they are)."""

import functools

import pytest

import autopar
from autopar.testing.amp import Amp, amp_mlp, assert_twin_equals_serial
from autopar.testing.serial import random_feeds


def _compiled(amp: Amp, axis: str):
    mesh = autopar.ProcessMesh([0, 1], dim_names=[axis])
    build = functools.partial(amp_mlp, widths=(8, 16, 16, 4), batch=12, stages=mesh if axis == "pp" else None)
    seed = build(amp)
    strategy = autopar.Strategy()
    if axis == "dp":
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    elif axis == "mp":
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    else:
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    return build, seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize(
    "amp, axis",
    [
        (Amp("O1", optimizer="sgd"), "dp"),
        (Amp("O1", optimizer="sgd"), "mp"),
        (Amp("O1", optimizer="sgd"), "pp"),
        (Amp("O1", optimizer="adamw"), "dp"),
        (Amp("O1", optimizer="adamw"), "mp"),
        (Amp("O1", dtype="float16", optimizer="sgd"), "mp"),
        (Amp("O1", dtype="float16", optimizer="adamw"), "dp"),
        (Amp("O2", optimizer="sgd"), "pp"),
        (Amp("O2", optimizer="adamw"), "dp"),
    ],
    ids=str,
)
def test_the_twin_equals_the_serial_twin(amp, axis):
    build, seed, dist = _compiled(amp, axis)
    assert_twin_equals_serial(build, amp, seed, dist, random_feeds(seed.feeds, 3, classes=4))
