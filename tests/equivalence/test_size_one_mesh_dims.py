"""Meshes with dims of size 1, as Paddle users write them (issue: real models, 8 and 14):
``[dp, mp]`` with ``mp=1``, and PaddleNLP's ``[pp=1, dp, mp]`` annotated on its ``[dp, mp]``
slice. A split or pending sum over one rank is nothing: no collective runs over one rank
(before: 4 all_reduces over the group [0] on a one-block GPT, and the native backend refused
the plan), the plan runs natively, and the slice's annotations mean what they say on the
global mesh (before: refused, "annotate with the mesh given to compile")."""

import pytest

import autopar
from autopar.testing.models import annotate_megatron, gpt_block_program
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import assert_simulation_equals_serial


def _gpt(mesh, feeds_mesh=None):
    seed = gpt_block_program(batch=4, seq=8, hidden=16, heads=2, vocab=32, layers=1, optimizer="sgd", seed=1)
    annotate_megatron(seed, mesh)
    for feed in seed.feeds.values():
        autopar.shard_tensor(feed, feeds_mesh or mesh, ["dp"] + [None] * (len(feed.shape) - 1))
    return seed


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_no_collective_over_one_rank(shape):
    ranks = list(range(shape[0] * shape[1]))
    mesh = autopar.ProcessMesh([ranks[i * shape[1] : (i + 1) * shape[1]] for i in range(shape[0])], ["dp", "mp"])
    seed = _gpt(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    groups = [c.group for rank in mesh.ranks for c, _ in dist.rank_plan(rank).collectives]
    assert groups and all(len(group) == 2 for group in groups), groups
    assert dist.collectives_span_world and dist.rank_plan(0, "auto").backend == "native"
    assert_simulation_equals_serial(seed, dist, classes=32)


def test_annotations_on_the_slice_of_a_size_one_pipeline_dim():
    mesh = autopar.ProcessMesh([[[0, 1], [2, 3]]], ["pp", "dp", "mp"])
    flat = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    seed = _gpt(mesh[0])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    reference = _gpt(flat)
    want = autopar.compile(reference.main, flat, startup_program=reference.startup)
    kinds = [(c.kind.value, c.bytes) for c in dist.comm_ops(0)]
    assert kinds == [(c.kind.value, c.bytes) for c in want.comm_ops(0)] and len(kinds) >= 4
    assert_simulation_equals_serial(seed, dist, classes=32)


def test_a_layer_placed_on_the_whole_slice_is_no_pipeline_stage():
    """``shard_op(layer, mesh[0])`` on a ``pp=1`` mesh places the layer on every rank: data /
    tensor parallelism as usual, no pipeline of one stage."""
    mesh = autopar.ProcessMesh([[0, 1]], ["pp", "dp"])
    seed = staged_mlp(mesh, stages=1, batch=4)
    autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
    autopar.shard_tensor(seed.feeds["label"], mesh[0], ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert dist.decisions.pipeline() is None
    assert {c.kind.value for c in dist.comm_ops(0)} == {"all_reduce"}
    assert_simulation_equals_serial(seed, dist)
