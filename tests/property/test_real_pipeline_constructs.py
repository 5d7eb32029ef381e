"""A property over random small decoders mixing the constructs real models write (issue 35):
a mask from Python scalars or tensors (from the ids too), a ``masked_select`` or sum / count
criterion, a class-token glue op outside any layer, a dead router statistic, the mask
annotated on the whole mesh, a global-norm clip; cut by the user's placements or by
``PipelineConfig(stages=2)``, on pp, pp x dp or pp x mp, any schedule and 2 or 4
micro-batches: the run equals serial, or compile refuses by name (an ``AutoparError``) —
never a raw exception."""

import os

from hypothesis import event, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import AutoparError
from autopar.testing import real_pipelines as rp
from autopar.testing.serial import assert_simulation_equals_serial

M = autopar.ProcessMesh
MESHES = {
    "pp": M([0, 1], ["pp"]),
    "pp x dp": M([[0, 1], [2, 3]], ["pp", "dp"]),
    "pp x mp": M([[0, 1], [2, 3]], ["pp", "mp"]),
}
EXAMPLES = (
    None if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else int(os.environ.get("RP_EXAMPLES", 8))
)  # (each example compiles and runs: ~6 s here)


@st.composite
def decoders(draw):
    config = rp.Config(
        layers=draw(st.sampled_from([2, 3])),
        mask=draw(st.sampled_from(["scalars", "tensors"])),
        padding=draw(st.booleans()),
        mask_on_mesh=draw(st.booleans()),
        criterion=draw(st.sampled_from(["masked_select", "positive", "sum_count"])),
        cls_token=draw(st.booleans()),
        dead_statistic=draw(st.booleans()),
        clip=draw(st.sampled_from([None, 1e-3])),
    )
    return config, draw(st.sampled_from(list(MESHES))), draw(st.booleans())


@settings(max_examples=EXAMPLES) if EXAMPLES else settings()
@given(decoders(), st.sampled_from(["FThenB", "1F1B", "ZBH1"]), st.sampled_from([2, 4]))
def test_random_decoders_equal_serial_or_are_refused_by_name(decoder, schedule, micro_batches):
    config, mesh_name, staged = decoder
    mesh = MESHES[mesh_name]
    seed = rp.build(config, batch=8, seq=6, mesh=mesh, staged=staged)
    pipeline = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule, stages=None if staged else 2)
    try:
        dist = autopar.compile(
            seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=pipeline)
        )
    except AutoparError as refused:
        assert str(refused).strip(), "a refusal must say why"
        event(f"refused: {str(refused)[:60]}")  # (none today: 40 cases of the ci profile all ran equal to serial)
        return
    assert_simulation_equals_serial(seed, dist, feeds=rp.feeds(config, 8, 6, 2), steps=2)
