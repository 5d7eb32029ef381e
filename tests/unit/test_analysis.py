"""One analysis, many strategies: ``autopar.analyze`` once, then ``compile(..., analysis=a)`` for
strategies that differ in the ZeRO stage, gradient fusion or the schedule plans exactly what a
fresh compile plans (collectives, schedules, the run equal to serial), leaves the analysis as it
was, and refuses a strategy that needs another analysis, naming the field."""

import dataclasses

import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.passes.results import ZeroPlan
from autopar.testing.models import simple_net
from autopar.testing.pipeline_models import tied_lm
from autopar.testing.serial import random_feeds


def _collectives(dist):
    return {rank: [str(c) for c in dist.comm_ops(rank)] for rank in dist.mesh.ranks}


def _dp_net():
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10), optimizer="adam")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return seed, mesh


STRATEGIES = [autopar.Strategy(zero_stage=z, fuse_allreduce=f, allreduce_bucket_mb=b)
              for z in (0, 1, 2, 3) for f, b in ((True, 32.0), (False, 32.0), (True, 0.0001))]  # fmt: skip


def test_strategies_from_one_analysis_plan_what_fresh_compiles_plan():
    seed, mesh = _dp_net()
    analysis = autopar.analyze(seed.main, mesh, seed.startup, STRATEGIES[0])
    propagation = analysis.propagation
    before = (dict(propagation.states), dict(propagation.op_results), propagation.reshards)
    feeds = random_feeds(seed.feeds, 2)
    for strategy in STRATEGIES:
        shared = autopar.compile(seed.main, mesh, seed.startup, strategy, analysis=analysis)
        fresh = autopar.compile(seed.main, mesh, seed.startup, strategy)
        assert _collectives(shared) == _collectives(fresh), strategy
        assert str(shared.passes) == str(fresh.passes)
        if strategy.zero_stage in (0, 3) and strategy.fuse_allreduce:
            got = autopar.simulate(shared, feeds, [seed.loss])
            want = autopar.simulate(fresh, feeds, [seed.loss])
            for name, value in want.parameters.items():
                np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)
    # the analysis is untouched: the same value, with the same contents
    assert analysis.propagation is propagation
    assert (dict(propagation.states), dict(propagation.op_results), propagation.reshards) == before


def test_zero_layers_its_placements_over_the_analysis_propagation():
    """ZeRO-3 then plain dp from one analysis: ZeRO's propagation is a new value whose override
    names what it changed (the rest falls through to the analysis'), and the dp compile after it
    reads the analysis' own propagation and plans what a fresh dp compile plans."""
    seed, mesh = _dp_net()
    analysis = autopar.analyze(seed.main, mesh, seed.startup, autopar.Strategy())
    zero = autopar.compile(seed.main, mesh, seed.startup, autopar.Strategy(zero_stage=3), analysis=analysis)
    placed = zero.state.propagation
    assert placed is not analysis.propagation and placed.base is analysis.propagation
    assert placed.override is not None and placed.override.reason == "ZeRO stage 3"
    changed = set(placed.override.states)
    assert any(placed.states[k] != analysis.propagation.states[k] for k in changed)
    assert all(placed.states[k] is analysis.propagation.states[k] for k in analysis.propagation.states if k not in changed)
    with pytest.raises(TypeError):
        placed.states[next(iter(changed))] = analysis.propagation.states[next(iter(changed))]  # read only
    dp = autopar.compile(seed.main, mesh, seed.startup, autopar.Strategy(), analysis=analysis)
    fresh = autopar.compile(seed.main, mesh, seed.startup, autopar.Strategy())
    assert dp.state.propagation is analysis.propagation
    assert _collectives(dp) == _collectives(fresh)
    assert not dp.state.zero and len(zero.state.zero) == len(zero.decisions.zero()) > 0


def test_a_pass_result_is_recorded_once():
    """Passes return frozen results; the compile keeps each once, so no pass replaces another's."""
    seed, mesh = _dp_net()
    dist = autopar.compile(seed.main, mesh, seed.startup, autopar.Strategy(zero_stage=2))
    plan = dist.state.result(ZeroPlan)
    assert plan is not None and plan.stage == 2 and dist.state.zero == plan.shards
    with pytest.raises(AutoparError, match="recorded once"):
        dist.state.record(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stage = 1  # type: ignore[misc]


def test_pipeline_schedules_from_one_analysis():
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = tied_lm(mesh, (0, 1, 1), seed=3)
    base = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, schedule="1F1B"))
    analysis = autopar.analyze(seed.main, mesh, seed.startup, base)
    for schedule in ("FThenB", "1F1B", "ZBH1"):
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, schedule=schedule))
        shared = autopar.compile(seed.main, mesh, seed.startup, strategy, analysis=analysis)
        fresh = autopar.compile(seed.main, mesh, seed.startup, strategy)
        assert [shared.schedule(r) for r in (0, 1)] == [fresh.schedule(r) for r in (0, 1)]
        assert _collectives(shared) == _collectives(fresh)
        assert autopar.check(shared, random_feeds(seed.feeds, 1, classes=10)).clean


def test_a_strategy_needing_another_analysis_is_refused_by_name():
    seed, mesh = _dp_net()
    analysis = autopar.analyze(seed.main, mesh, seed.startup)
    with pytest.raises(AutoparError, match="strategy's recompute=True but the analysis was made with recompute=False"):
        autopar.compile(seed.main, mesh, seed.startup, autopar.Strategy(recompute=True), analysis=analysis)
    with pytest.raises(AutoparError, match="the analysis was made on mesh"):
        autopar.compile(seed.main, autopar.ProcessMesh([0, 1], ["x"]), seed.startup, analysis=analysis)
    other, _ = _dp_net()
    with pytest.raises(AutoparError, match="made for another program"):
        autopar.compile(other.main, mesh, other.startup, analysis=analysis)
    with pytest.raises(AutoparError, match="analysis must be what autopar.analyze returned"):
        autopar.compile(seed.main, mesh, seed.startup, analysis=object())


def _gpt_pp_mp():
    from autopar.testing.models import annotate_megatron, gpt_block_program

    seed = gpt_block_program(batch=4, seq=8, hidden=16, heads=2, vocab=32, layers=2, optimizer="sgd", seed=1, layer_calls=True)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])
    annotate_megatron(seed, mesh)
    return seed, mesh


@pytest.mark.parametrize(
    "fields",
    [{"micro_batches": 4}, {"sequence_parallel": True}, {"recompute": True}, {"micro_batches": 4, "sequence_parallel": True}],
)
def test_an_analysis_derived_from_another_is_the_analysis_made_afresh(fields):
    """``analyze(..., base=a)`` reuses the rewrites both strategies run first (and, adding only
    sequence parallelism, ``a``'s propagation): what it gives compiles exactly like a fresh one."""
    seed, mesh = _gpt_pp_mp()

    def strategy(micro_batches=2, **rest):
        return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2), **rest)

    base = autopar.analyze(seed.main, mesh, seed.startup, strategy())
    derived = autopar.analyze(seed.main, mesh, seed.startup, strategy(**fields), base=base)
    fresh = autopar.analyze(seed.main, mesh, seed.startup, strategy(**fields))
    assert derived.steps[0] is base.steps[0]  # the graph and annotations were not made again
    assert {k: s.dist for k, s in derived.propagation.states.items()} == {k: s.dist for k, s in fresh.propagation.states.items()}
    shared = autopar.compile(seed.main, mesh, seed.startup, strategy(**fields), analysis=derived)
    assert _collectives(shared) == _collectives(autopar.compile(seed.main, mesh, seed.startup, strategy(**fields)))
    with pytest.raises(AutoparError, match="another program"):
        autopar.analyze(_gpt_pp_mp()[0].main, mesh, seed.startup, strategy(**fields), base=base)


def test_recompute_after_micro_batching_places_its_clones_as_propagation_would():
    """Recompute runs after micro-batching, so strategies differing in recompute share the
    micro-batch analysis: its clones are placed and scaled as the ops they copy. That is what a
    micro-batch propagation over the recomputed program itself finds, value by value."""
    from autopar.graph import ProgramGraph
    from autopar.rewrites.micro_batching import micro_batching

    seed, mesh = _gpt_pp_mp()
    base = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    first = autopar.analyze(seed.main, mesh, seed.startup, base)
    derived = autopar.analyze(seed.main, mesh, seed.startup, dataclasses.replace(base, recompute=True), base=first)
    assert [type(r).__name__ for r in derived.rewrites][-2:] == ["MicroBatch", "Recompute"]
    assert derived.steps[-2] is first.steps[-1]  # the micro-batch analysis was not made again
    rewrite = derived.state.recompute
    assert rewrite.copies and set(rewrite.copies) <= set(rewrite.clones)
    graph = ProgramGraph(rewrite.program, recomputes=rewrite.clones)
    propagated, view = micro_batching(graph, 2)
    micro = derived.state.micro
    assert micro.placements == propagated.placements and micro.scales == propagated.scales
    got = {k: v.shape for k, v in derived.graph.values.items()}
    assert got == {k: v.shape for k, v in view.values.items()}


@pytest.mark.parametrize("counts", [(2, 4), (4, 2)])
def test_another_micro_batch_count_is_derived_from_the_split_of_one(counts, monkeypatch):
    """Strategies differing in the micro-batch count share the split: the count asked for is
    derived from the base's (no micro-batch propagation), and equals the analysis made afresh —
    placements, scales and one micro-batch's shapes."""
    from autopar.rewrites import micro_batching as module
    from autopar.rewrites.micro_batching import micro_batching

    seed, mesh = _gpt_pp_mp()
    first, then = counts
    base = autopar.analyze(seed.main, mesh, seed.startup, autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=first, stages=2)))
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=then, stages=2))
    with monkeypatch.context() as patch:
        patch.setattr(module, "_cut_whole_batch_values", lambda *a: pytest.fail("the micro-batch split was propagated again"))
        derived = autopar.analyze(seed.main, mesh, seed.startup, strategy, base=base)
    fresh, view = micro_batching(derived.steps[-2].graph, then)
    assert derived.state.micro.placements == fresh.placements and derived.state.micro.scales == fresh.scales
    assert {k: v.shape for k, v in derived.graph.values.items()} == {k: v.shape for k, v in view.values.items()}


def test_a_count_that_does_not_divide_a_split_is_analysed_afresh():
    """A split the new count does not divide (a batch of 4 rows in 8 micro-batches) is not
    derived: micro-batching itself says why."""
    seed, mesh = _gpt_pp_mp()
    base = autopar.analyze(seed.main, mesh, seed.startup, autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2)))
    with pytest.raises(AutoparError, match="micro-batches do not divide evenly"):
        autopar.analyze(seed.main, mesh, seed.startup, autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=8, stages=2)), base=base)
