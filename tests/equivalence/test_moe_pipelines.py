"""The zoo MoE (stacked experts split over ``ep``) under a 2-stage pipeline, ``pp x ep``. A
router's statistics are over the tokens it routes (its cumsum over token slots, the means of
its gates and expert counts): micro-batches are exact for them only where each micro-batch
holds whole groups of routed tokens. The opt-in is in the program, so the serial reference
routes the same way: ``Config(router_groups=g)`` routes each of ``g`` groups on its own, and
with ``g`` a multiple of the micro-batches, each micro-batch routes its own groups. Without it,
one micro-batch (gradient accumulation over the whole batch) is exact, and more are refused by
name, naming the router's op and the opt-in. Losses every step and every parameter after 3 steps
equal serial."""

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import moe

PP_EP = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "ep"])


def pipelined(micro_batches: int) -> autopar.Strategy:
    return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2))


@pytest.mark.parametrize(
    ("router_groups", "micro_batches"),
    [(4, 2), (2, 2), (1, 1)],  # per micro-batch (2 groups each, 1 group each); the whole batch in one micro-batch
)
def test_the_zoo_moe_under_ep_x_pp_equals_serial(router_groups, micro_batches):
    config = moe.Config(router_groups=router_groups)
    seed = moe.build(config, batch=4, seq=8, mesh=PP_EP)
    dist = autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=pipelined(micro_batches))
    assert dist.strategy.pipeline.micro_batches == micro_batches
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))


def test_routing_over_the_whole_batch_is_refused_by_name_under_micro_batches():
    """One group for the step's tokens, 2 micro-batches: the router's statistics would need
    every micro-batch at once. The refusal names the op, its layer, and the opt-in."""
    seed = moe.build(moe.Config(), batch=4, seq=8, mesh=PP_EP)
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op\.\w+#\d+ \(in [\w/]*Router\).*router_groups"):
        autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=pipelined(2))


def test_zero_1_under_pp_x_dp_x_ep_shards_the_experts_over_dp_in_their_stage():
    """8 ranks, 2 stages of dp x ep, routing per micro-batch (8 groups, 2 micro-batches), ZeRO-1
    with momentum: each stage's experts are sharded over its dp ranks; equal to serial."""
    mesh = autopar.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "ep"])
    config = moe.Config(router_groups=8)
    seed = moe.build(config, batch=8, seq=8, mesh=mesh, optimizer="momentum")
    strategy = autopar.Strategy(zero_stage=1, pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    experts = [z for z in dist.state.zero if z.label.startswith("mo_e")]  # (the stacked w_in, w_out of each layer)
    assert len(experts) == 2 * config.n_layers and all(z.sharded is not None for z in experts)
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 8, 8, 3))
