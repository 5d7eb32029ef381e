"""``autopar.suggest``: known answers on the h100-node profile (model-level, no GPU needed), the
search's own bookkeeping, and refusals by name. (Suggested plans equal serial:
tests/equivalence/test_suggested_plans.py.)"""

import warnings

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.suggest.search import Shape
from autopar.testing.models import gpt_block_program

warnings.filterwarnings("ignore", category=UserWarning)


def _gpt(optimizer="adamw", batch=8):
    return gpt_block_program(batch=batch, seq=16, hidden=64, heads=4, vocab=128, layers=2, optimizer=optimizer, seed=1, layer_calls=True)


def _states_bytes(seed):
    """Parameters x 2 (with their gradients) + the optimizer's state tensors, whole."""
    from autopar.graph import ProgramGraph
    from autopar.suggest import _parameter_bytes

    params, states = _parameter_bytes(ProgramGraph(seed.main))
    return 2 * params + states


def test_a_model_with_room_to_spare_gets_pure_data_parallelism():
    seed = _gpt()
    plans = autopar.suggest(seed.main, 8, seed.startup, cluster="h100-node")
    best = plans[0]
    assert (best.shape.dp, best.shape.mp, best.shape.pp) == (8, 1, 1) and best.fits
    assert best.strategy.zero_stage in (0, 1) and not best.strategy.recompute
    assert "8 data-parallel ranks" in best.why and "fits" in best.why
    assert plans.searched >= 50 and plans.pruned == 0 and len(plans) == 5
    busy = [p.price.step for p in plans if p.fits and not p.idle]  # (one device, 3 % faster here, is a tie: ranked after)
    assert busy == sorted(busy)


def test_a_model_whose_weights_and_adam_states_exceed_the_budget_gets_a_plan_that_fits():
    seed = _gpt(batch=16)
    budget = int(_states_bytes(seed) * 0.6)  # replicated weights + Adam states alone do not fit
    plans = autopar.suggest(seed.main, 16, seed.startup, memory_per_rank=budget, cluster="h100-node", top=20)
    assert plans[0].fits and plans[0].price.memory <= budget
    assert all(not (p.shape.mp == 1 and p.shape.pp == 1 and p.strategy.zero_stage == 0) for p in plans if p.fits)
    assert plans.pruned > 0  # pure dp without ZeRO dropped before any compile
    assert all(p.shape.mp <= 8 for p in plans)  # tensor parallelism inside a node of 8
    assert any("would cross nodes" in why for _, why in plans.skipped)


def test_activations_over_the_budget_of_a_compute_bound_model_get_gradient_accumulation():
    """Micro-batches of a quarter of the rows hold a quarter of the activations for a few more
    op launches; recompute would pay a third more compute: where the model is compute-bound
    (hidden 1024, 1024 tokens) and the activations do not fit, the best plan accumulates."""
    seed = gpt_block_program(batch=32, seq=1024, hidden=1024, heads=16, vocab=1024, layers=2, optimizer="adamw", seed=1)
    roomy = autopar.suggest(seed.main, 2, seed.startup, cluster="h100-node")[0]
    activations = roomy.price.memory - roomy.price.parameter_memory
    budget = roomy.price.parameter_memory + activations // 3
    best = autopar.suggest(seed.main, 2, seed.startup, cluster="h100-node", memory_per_rank=budget)[0]
    assert best.fits and not best.strategy.recompute
    assert best.strategy.pipeline.stages == 1 and best.strategy.pipeline.micro_batches == 4, best
    assert "accumulate m=4" in best.features and "accumulated over 4 micro-batches" in best.why
    assert best.price.step < 1.1 * roomy.price.step


def test_the_table_and_a_plan_compile():
    seed = _gpt("sgd")
    plans = autopar.suggest(seed.main, 2, seed.startup, top=3)
    text = str(plans)
    assert "candidates priced" in text and "best:" in text
    dist = plans[0].compile()
    assert isinstance(dist, autopar.DistributedProgram) and dist.mesh == plans[0].mesh
    assert not autopar.annotate.annotations_of(seed.main).tensors  # the user's program was not annotated


@pytest.mark.parametrize(("kwargs", "message"), [({"world": 0}, "positive number of devices"), ({"world": 2, "top": 0}, "top must be")])
def test_wrong_arguments_are_refused_by_name(kwargs, message):
    seed = _gpt("sgd")
    with pytest.raises(AutoparError, match=message):
        autopar.suggest(seed.main, startup_program=seed.startup, **kwargs)


def test_the_command_line_prints_the_table(capsys):
    from autopar import cli

    assert cli.main(["suggest", "examples/suggest_plans.py:program", "--world", "2", "--top", "2", "--memory", "64MiB", "--all-devices"]) == 0
    out = capsys.readouterr().out
    assert "mesh" in out and "candidates priced" in out and "fits in 64 MiB" in out and "of 2 devices" not in out
    assert cli.parse_bytes("80GB") == 80 * 10**9 and cli.parse_bytes("512 MiB") == 512 << 20
    assert cli.main(["suggest", "examples/suggest_plans.py:program", "--world", "2", "--memory", "lots"]) == 2
    assert "expected a size" in capsys.readouterr().err


def test_the_example_runs():
    import runpy

    runpy.run_path("examples/suggest_plans.py", run_name="__main__")


def test_only_the_shapes_asked_for_and_one_given_plan_priced_alike():
    seed = _gpt()
    plans = autopar.suggest(seed.main, 4, seed.startup, cluster="h100-node", top=100, shapes=[(2, 2, 1), Shape(4, 1, 1)])
    assert {(p.shape.dp, p.shape.mp, p.shape.pp) for p in plans} == {(2, 2, 1), (4, 1, 1)}
    chosen = next(p for p in plans if p.shape.mp == 2 and p.strategy.zero_stage == 1 and not p.strategy.recompute and not p.strategy.sequence_parallel)
    given = autopar.price_plan(seed.main, (2, 2, 1), autopar.Strategy(zero_stage=1), seed.startup, cluster="h100-node")
    assert given.price == chosen.price and given.strategy == chosen.strategy and given.placements == chosen.placements
    with pytest.raises(AutoparError, match=r"mesh shape dp=2 x mp=4 has 8 devices, more than the world's 4"):
        autopar.suggest(seed.main, 4, seed.startup, cluster="h100-node", shapes=[(2, 4, 1)])
    with pytest.raises(AutoparError, match=r"a mesh shape is a Shape or \(dp, mp, pp\) of positive ints, got \(2, 2\)"):
        autopar.price_plan(seed.main, (2, 2), cluster="h100-node")
    with pytest.raises(AutoparError, match="price_plan: dp=3: the batch of 8 rows does not split over 3 data ranks"):
        autopar.price_plan(seed.main, (3, 1, 1), cluster="h100-node")
