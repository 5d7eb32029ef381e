"""Models whose repeated blocks sit under other layers (``Model/Decoder/DecoderLayer_k``, issue:
real models, 7, 9, 15): ``PipelineConfig(stages=n)`` cuts between the decoder layers (before:
the whole model on stage 0 and the loss alone on stage 1), ``recompute=("DecoderLayer",)``
matches them where they sit (before: matched nothing) and ``recompute=True`` recomputes each
of them (before: the whole model was one segment, the embedding included)."""

import pytest

import autopar
from autopar.graph import Role
from autopar.layer_paths import path_of
from autopar.testing.pipeline_models import nested_decoder
from autopar.testing.serial import assert_simulation_equals_serial

PP = autopar.ProcessMesh([0, 1], ["pp"])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_automatic_cut_falls_between_the_decoder_layers(micro_batches):
    seed = nested_decoder(layers=4)
    config = autopar.PipelineConfig(micro_batches=micro_batches, stages=2)
    dist = autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
    meshes = dist.decisions.pipeline().meshes
    layer_stage = {}
    for op in dist.decisions.ops():
        path = path_of(op)
        if op.role is Role.FORWARD and len(path) >= 3 and path[2].startswith("DecoderLayer"):
            layer_stage.setdefault(path[2], set()).add(meshes.index(dist.decisions.value(op.outputs[0]).placement.mesh))
    assert all(len(stages) == 1 for stages in layer_stage.values()), layer_stage  # no layer is cut
    assert sorted(layer_stage) == ["DecoderLayer", "DecoderLayer_1", "DecoderLayer_2", "DecoderLayer_3"]
    assert [layer_stage[name] for name in sorted(layer_stage)] == [{0}, {0}, {1}, {1}]
    assert_simulation_equals_serial(seed, dist, classes=16)


def _recomputed_layers(dist):
    report = dist.decisions.recompute()
    ops = dist.decisions.ops()
    return {path_of(ops[origin])[2] if len(path_of(ops[origin])) > 2 else "/".join(path_of(ops[origin]))
            for origin in report.clones.values()}  # fmt: skip


@pytest.mark.parametrize("selection", [("DecoderLayer",), True])
def test_recompute_names_a_layer_wherever_it_sits(selection):
    seed = nested_decoder(layers=3)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=selection))
    assert _recomputed_layers(dist) == {"DecoderLayer", "DecoderLayer_1", "DecoderLayer_2"}
    assert_simulation_equals_serial(seed, dist, classes=16)


def test_a_leading_slash_anchors_a_layer_path_at_the_top():
    seed = nested_decoder(layers=2)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    with pytest.raises(autopar.AutoparError, match="'/DecoderLayer' match\\(es\\) no forward op type or layer path"):
        autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=("/DecoderLayer",)))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=("/Model/Decoder/DecoderLayer_1",)))
    assert _recomputed_layers(dist) == {"DecoderLayer_1"}
