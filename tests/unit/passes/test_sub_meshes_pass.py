"""passes/sub_meshes.py: on each rank, the ops of the sub-meshes it is not on are erased (with the
parameters only they read) and the views joining or splitting the sub-meshes' pieces become
plain reads; declared for a program that places something on a sub-mesh (under a pipeline: one
that is no stage, before the pipeline split)."""

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


PP_EP = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "ep"])


@pytest.fixture(scope="module")
def pipelined_local_moe():
    seed = moe.build(moe.Config(n_layers=2), batch=4, seq=8, mesh=PP_EP, experts="local")
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=1, stages=2))
    return autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)


def test_under_a_pipeline_it_runs_before_the_split_and_each_rank_keeps_its_stages_experts(pipelined_local_moe):
    """On pp x ep, an expert's sub-mesh split_mesh(mesh, "ep")[i] is, on each stage, that stage's
    ep rank i: rank r ends with the two experts of its stage (layer r // 2) and ep index
    (r % 2) only, and no two ranks share one."""
    names = [p.name for p in pipelined_local_moe.passes.passes]
    assert names.index("sub_meshes") < names.index("pipeline_split")
    experts = [{n for n in _parameters(pipelined_local_moe.rank_plan(r).program) if n.startswith("expert")} for r in range(4)]
    assert all(len(held) == 2 * 2 for held in experts)  # two experts, two weights each
    assert len(set().union(*experts)) == 4 * 2 * 2  # 4 experts a layer, 2 layers: each on one rank
    before = _parameters(pipelined_local_moe.rank_plan(0, after="op_lowering").program)
    assert experts[1] <= before - experts[0]  # rank 0 read rank 1's (same stage) experts before the pass erased them
