"""``autopar.suggest`` with an expert axis (issue 40 item 7): where the program has stacked
experts (``[E, in, out]`` weights an einsum batches over E), the search also splits them by
expert over an ``ep`` mesh dim, the batch over data x expert (as the zoo's stacked MoE is
annotated), and an unannotated MoE whose experts do not fit replicated gets an ep plan under a
memory budget (which compiles and equals serial)."""

import warnings

import pytest

import autopar
from autopar.graph import ProgramGraph
from autopar.suggest import price_plan
from autopar.suggest.annotations import expert_count, expert_parameters
from autopar.suggest.search import Shape, shapes
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import llama, moe

warnings.filterwarnings("ignore", category=UserWarning)
CONFIG = moe.Config(n_layers=1, expert_hidden=512)  # the experts: 2 x 4 x 32 x 512 float32 = 512 KiB of 660 KiB
BUDGET = 1_500_000  # bytes; ep=4 needs 1.46 MB; the least a plan without ep needs is 1.55 MB (dp=4, ZeRO-3)


def _moe(optimizer="adamw"):
    return moe.build(CONFIG, batch=4, seq=8, optimizer=optimizer)


@pytest.fixture(scope="module")
def searched():
    seed = _moe()
    return seed, autopar.suggest(seed.main, 4, seed.startup, memory_per_rank=BUDGET, cluster="h100-node", top=100)


def test_the_stacked_experts_are_found_and_nothing_else():
    graph = ProgramGraph(_moe().main)
    found = expert_parameters(graph)
    assert sorted(graph.values[key].shape for key in found) == [(4, 32, 512), (4, 512, 32)]
    assert expert_count(graph) == CONFIG.n_experts
    assert expert_count(ProgramGraph(llama.build(llama.Config(vocab_size=64, dim=32, n_layers=1), batch=2, seq=8).main)) == 0


def test_an_moe_whose_experts_do_not_fit_replicated_gets_an_expert_parallel_plan(searched):
    _, plans = searched
    best = plans[0]
    assert best.fits and best.shape.ep > 1
    assert "expert-parallel ranks" in best.why
    assert all(plan.shape.ep > 1 for plan in plans if plan.fits)
    without = [plan for plan in plans if plan.shape.ep == 1]
    assert without and min(plan.price.memory for plan in without) > BUDGET > best.price.memory


def test_without_the_expert_shapes_nothing_fits():
    seed = _moe()
    plain = list(shapes(4))
    with pytest.warns(UserWarning, match="nothing fits"):
        plans = autopar.suggest(seed.main, 4, seed.startup, memory_per_rank=BUDGET, cluster="h100-node", shapes=plain)
    assert not any(plan.fits for plan in plans)


def test_the_experts_parameter_memory_per_rank_is_1_over_ep():
    """dp=4, dp=2 x ep=2 and ep=4 priced as given (no ZeRO): the experts' parameters, gradients
    and AdamW's two moments (512 KiB of parameters) divided by ep, the rest alike."""
    seed = _moe()
    held = {shape[-1]: price_plan(seed.main, shape, startup_program=seed.startup, cluster="h100-node").price.parameter_memory
            for shape in ((4, 1, 1, 1, 1), (2, 1, 1, 1, 2), (1, 1, 1, 1, 4))}  # fmt: skip
    experts = 2 * CONFIG.n_experts * CONFIG.dim * CONFIG.expert_hidden * 4 * 4  # (parameter, gradient, 2 moments) x float32
    assert held[1] - held[2] == experts - experts // 2
    assert held[1] - held[4] == experts - experts // 4


def test_the_suggested_expert_parallel_plan_compiles_and_equals_serial(searched):
    """The best plan's shape and strategy on the same model with SGD (AdamW normalises rounding
    noise of tiny gradients past the tolerance: the issue's floor comparison)."""
    _, plans = searched
    best = plans[0]
    assert "ep" in best.mesh.dim_names
    seed = _moe("sgd")
    plan = price_plan(seed.main, best.shape, best.strategy, seed.startup, cluster="h100-node")
    assert_simulation_equals_serial(seed, plan.compile(), feeds=moe.feeds(CONFIG, 4, 8, 2))


def test_an_expert_parallel_shape_is_a_mesh_with_an_ep_dim_and_refuses_what_does_not_split():
    shape = Shape(2, 1, 1, 1, 2)
    assert shape.world == 4 and shape.data == 4 and str(shape) == "dp=2 x ep=2"
    mesh = shape.mesh()
    assert tuple(mesh.dim_names) == ("dp", "ep") and tuple(mesh.shape) == (2, 2)
    assert sorted(s.ep for s in shapes(4, (1,), (1, 2, 4))) == [1] * 6 + [2, 2, 2, 4]
    seed = _moe()
    with pytest.raises(autopar.AutoparError, match="the 4 experts do not split over 3 expert-parallel ranks"):
        price_plan(seed.main, (1, 1, 1, 1, 3), startup_program=seed.startup, cluster="h100-node")
    dense = llama.build(llama.Config(vocab_size=64, dim=32, n_layers=1), batch=2, seq=8)
    with pytest.raises(autopar.AutoparError, match="no stacked experts"):
        price_plan(dense.main, (1, 1, 1, 1, 2), startup_program=dense.startup, cluster="h100-node")
