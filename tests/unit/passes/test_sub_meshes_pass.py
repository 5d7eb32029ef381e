"""passes/sub_meshes.py: on each rank, the ops of the sub-meshes it is not on are erased (with the
parameters only they read) and the views joining or splitting the sub-meshes' pieces become
plain reads; declared only for an unpipelined program that places something on a sub-mesh."""

import pytest

import autopar
from autopar.testing.zoo import moe

EP2 = autopar.ProcessMesh([0, 1], ["ep"])


@pytest.fixture(scope="module")
def local_moe():
    seed = moe.build(moe.Config(n_layers=1), batch=4, seq=8, mesh=EP2, experts="local")
    return autopar.compile(seed.main, EP2, startup_program=seed.startup)


def _parameters(program):
    return {op.attrs()["parameter_name"] for op in program.global_block().ops if op.name() == "builtin.parameter"}


def test_declared_only_where_something_lies_on_a_sub_mesh(local_moe):
    assert "sub_meshes()" in str(local_moe.passes)
    stacked = moe.build(moe.Config(n_layers=1), batch=4, seq=8, mesh=EP2)
    assert "sub_meshes" not in str(autopar.compile(stacked.main, EP2, startup_program=stacked.startup).passes)


def test_each_rank_keeps_the_experts_of_its_own_sub_mesh(local_moe):
    """Before the pass every rank's program still reads all four experts' weights; after it, rank
    r reads the two experts of sub-mesh r only, and the weights every rank shares stay."""
    before = [_parameters(local_moe.rank_plan(r, after="op_lowering").program) for r in (0, 1)]
    after = [_parameters(local_moe.rank_plan(r).program) for r in (0, 1)]
    assert before[0] == before[1]
    dropped = [before[r] - after[r] for r in (0, 1)]
    assert dropped[0] and dropped[1] and not dropped[0] & dropped[1]
    assert dropped[0] == after[1] - after[0] and dropped[1] == after[0] - after[1]  # what one drops, the other keeps
    assert len(dropped[0]) == len(dropped[1]) == 2 * 2  # two experts, two weights each
