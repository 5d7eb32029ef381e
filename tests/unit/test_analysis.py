"""One analysis, many strategies: ``autopar.analyze`` once, then ``compile(..., analysis=a)`` for
strategies that differ in the ZeRO stage, gradient fusion or the schedule plans exactly what a
fresh compile plans (collectives, schedules, the run equal to serial), leaves the analysis as it
was, and refuses a strategy that needs another analysis, naming the field."""

import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError
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
    before = (dict(analysis.propagation.states), list(analysis.propagation.reshards))
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
    assert (analysis.propagation.states, analysis.propagation.reshards) == before  # the analysis is untouched


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
