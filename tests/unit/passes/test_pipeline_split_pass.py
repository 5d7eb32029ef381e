"""passes/pipeline_split.py: stages and their schedule planned at compile; each rank's program
cut to its stages, the values crossing stages sent and received (stage: comm-fused ->
stage-split per rank). (Where the cut falls: tests/unit/test_pipeline_cut.py; pipelines equal
serial: tests/equivalence/test_pipeline.py.)"""

from pass_programs import SIZES, declared, op_names, previous_pass

import autopar
from autopar.testing.models import simple_net


def _two_stages():
    """SimpleNet's three linears cut into two stages on pp = 2 (two linears, then the last)."""
    seed = simple_net(batch=8, sizes=SIZES)
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    config = autopar.PipelineConfig(stages=2, micro_batches=2, schedule="1F1B")
    return seed, autopar.compile(
        seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config)
    )


def test_each_rank_keeps_its_stages_ops_and_the_compute_is_split_between_them():
    seed, dist = _two_stages()
    serial = [op.name() for op in seed.main.global_block().ops]
    plans = [dist.rank_plan(rank, after="pipeline_split") for rank in (0, 1)]
    for rank, plan in enumerate(plans):
        before = dist.rank_plan(rank, after=previous_pass(dist, "pipeline_split"))
        assert before.pipeline is None  # (a dump of the program before the split: not yet a stage's)
        assert len(op_names(plan)) < len(op_names(before))  # the other stage's ops erased
        assert plan.pipeline is not None and plan.pipeline.stage == rank and plan.pipeline.micro_batches == 2
    for name in ("pd_op.matmul", "pd_op.matmul_grad", "pd_op.momentum_"):
        per_rank = [op_names(plan).count(name) for plan in plans]
        assert sum(per_rank) == serial.count(name) and per_rank == [
            2 * serial.count(name) // 3,
            serial.count(name) // 3,
        ]


def test_the_activation_and_its_gradient_cross_between_the_stages():
    _, dist = _two_stages()
    first, last = (dist.rank_plan(rank, after="pipeline_split") for rank in (0, 1))
    assert [(c.kind, c.group) for c, _ in first.collectives] == [("send", (0, 1)), ("recv", (1, 0))]
    assert [(c.kind, c.group) for c, _ in last.collectives] == [("recv", (0, 1)), ("send", (1, 0))]


def test_the_pass_is_declared_by_the_pipeline_strategy_only():
    _, dist = _two_stages()
    split = declared(dist, "pipeline_split")
    assert split.plan_ensures in split.emit_requires and split.emit_ensures == "stage-split"
    assert dist.rank_plan(0, after="pipeline_split").stages[-1] == "stage-split"
    assert "micro_batches=2" in str(split) and "1F1B" in str(split)
    plain = autopar.compile(*_plain())
    assert "pipeline_split" not in plain.passes.names()


def _plain():
    seed = simple_net(batch=8, sizes=SIZES)
    return seed.main, autopar.ProcessMesh([0, 1], ["pp"]), seed.startup


def test_an_op_on_a_sub_mesh_of_a_stage_is_of_that_stage():
    """The local MoE on pp x ep: its router copies and experts run on one rank of a stage (the
    stage mesh x the ep-fixed sub-mesh). They are of that stage, not stages of their own: two
    stages, each op of a one-rank sub-mesh on the stage holding its rank."""
    from autopar.testing.zoo import moe

    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "ep"])
    seed = moe.build(moe.Config(n_layers=2), batch=4, seq=8, mesh=mesh, experts="local")
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=1, stages=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    plan = dist.state.pipeline
    assert [m.ranks for m in plan.meshes] == [(0, 1), (2, 3)]
    on_sub_meshes = {i: m for i, m in dist.state.propagation.op_meshes.items() if m.size == 1}
    assert {m.ranks[0] for m in on_sub_meshes.values()} == {0, 1, 2, 3}
    assert all(on_sub_meshes[i].ranks[0] in plan.meshes[plan.stage_of[i]].ranks for i in on_sub_meshes if i in plan.stage_of)
    assert sum(i in plan.stage_of for i in on_sub_meshes) > len(on_sub_meshes) // 2
