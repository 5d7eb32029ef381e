"""Stages placed the way Paddle's semi-auto users place them (issue: real models, what to build
1): no ``shard_op``; each layer's parameters annotated on its stage's sub-mesh, activations
moved with ``autopar.reshard`` (or not at all), every op on the mesh its inputs live on.
Before: refused ("sub-mesh placements land with the pipeline (place a stage's ops with
shard_op)")."""

import pytest

import autopar
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.serial import assert_simulation_equals_serial

MESH = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])


def _annotated_mlp(move: bool) -> SeedProgram:
    """Two Megatron MLPs, the first's parameters on mesh[0], the second's on mesh[1]."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    F = paddle.nn.functional
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        label = paddle.static.data("label", [4, 1], "int64")
        layers = [paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 6), paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 3)]
        for i, layer in enumerate(layers):
            stage = MESH[i // 2]
            column = i % 2 == 0
            autopar.shard_tensor(layer.weight, stage, [None, "mp"] if column else ["mp", None])
            autopar.shard_tensor(layer.bias, stage, ["mp"] if column else [None])
        h = layers[1](F.relu(layers[0](x)))
        if move:
            h = autopar.reshard(h, MESH[1], [autopar.Replicate()])
        loss = paddle.mean(F.cross_entropy(layers[3](F.relu(layers[2](h))), label))
        make_optimizer("sgd").minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss)


@pytest.mark.parametrize("move", [True, False])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_stages_from_parameter_annotations(move, micro_batches):
    seed = _annotated_mlp(move)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches)) if micro_batches > 1 else None
    dist = autopar.compile(seed.main, MESH, startup_program=seed.startup, strategy=strategy)
    assert dist.decisions.pipeline().meshes == (MESH[0], MESH[1])
    kinds = [(c.kind.value, c.group) for c in dist.comm_ops(0)]
    assert kinds == [("all_reduce", (0, 1)), ("send", (0, 2)), ("recv", (2, 0))]  # row-parallel sum, then the stage boundary
    assert_simulation_equals_serial(seed, dist, classes=3)
