"""Meshes wider than one node of the default profile (8 devices) compile with the default
profile, and a 16-rank one trains equal to serial in the simulator."""

import pytest
from test_simulator import assert_equivalent

import autopar
from autopar.testing.models import annotate_megatron, gpt_block_program, simple_net


def _mesh(dp: int, mp: int) -> autopar.ProcessMesh:
    return autopar.ProcessMesh(shape=[dp, mp], process_ids=list(range(dp * mp)), dim_names=["dp", "mp"])


@pytest.mark.parametrize("dp, mp", [(8, 2), (32, 2), (8, 8)], ids=["16", "64", "64-8x8"])
def test_wide_meshes_compile_with_the_default_profile(dp, mp):
    mesh = _mesh(dp, mp)
    seed = gpt_block_program(batch=dp, seq=8, hidden=32, heads=mp, vocab=64, layers=1)
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    annotate_megatron(seed, mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    last = mesh.ranks[-1]
    kinds = {c.kind for c in dist.comm_ops(last)}
    assert "all_reduce" in kinds  # Megatron's row-parallel sums and the dp gradient bucket
    assert all(last in c.group and len(c.group) in (mp, dp) for c in dist.comm_ops(last))
    if dp * mp == 16:
        assert dist.cost.step_time > 0  # the cost report prices every rank


@pytest.mark.slow
def test_sixteen_ranks_train_equal_to_serial():
    mesh = _mesh(8, 2)
    seed = simple_net(batch=16, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
    autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    assert_equivalent(seed, autopar.compile(seed.main, mesh, startup_program=seed.startup), steps=3)
