"""Mixed-precision programs written with Paddle's AMP (``paddle.amp.decorate`` + ``auto_cast``)
compiled and run through the numerics twin equal the serial twin, within twice the program's
measured precision floor (autopar.testing.amp.assert_twin_equals_serial): O1 (bf16 and fp16)
and O2 (SGD and AdamW) on dp, mp, dp x mp, a 2-stage pipeline and ZeRO-1/2/3. (O2's bf16 collectives on
dp x mp and ZeRO 1-3: tests/equivalence/test_amp_collectives.py.)"""

import functools

import pytest

import autopar
from autopar.testing.amp import Amp, amp_mlp, assert_twin_equals_serial
from autopar.testing.serial import random_feeds


def _compiled(amp: Amp, layout: str):
    """``layout``: dp, mp, pp (2 ranks), dpxmp (2 x 2), zero1 / zero2 / zero3 (dp = 2)."""
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
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
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
    ],
    ids=str,
)
def test_the_twin_equals_the_serial_twin(amp, layout):
    build, seed, dist = _compiled(amp, layout)
    assert_twin_equals_serial(build, amp, seed, dist, random_feeds(seed.feeds, 3, classes=4))
