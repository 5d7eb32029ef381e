"""Mixture-of-experts priced (cost_model/moe.py; issue 40 item 7): one layer's dispatch and
combine all_to_alls against ``tokens x top-k x hidden`` written here, the gate's imbalance
(the busiest rank decides), the static capacity's padded buffer, and the experts' memory per
rank ``1 / ep`` of the replicated — in the formulas and in the compiled zoo MoE's price, with
its experts on sub-meshes (Paddle's way) and stacked."""

import warnings

import pytest

import autopar
from autopar.cost_model import collective_time, shipped_profile
from autopar.cost_model.moe import MoELayer, expert_memory, price_moe_layer
from autopar.errors import CostModelError
from autopar.testing.zoo import moe

warnings.filterwarnings("ignore", category=UserWarning)
H100 = shipped_profile("h100-node")
T, K, H, E = 4096, 2, 1024, 8  # tokens of one rank's group, top-2, hidden, experts


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_a_uniform_router_sends_tokens_times_top_k_times_hidden_per_all_to_all(ep):
    layer = MoELayer(T, H, E, K, capacity_factor=None, dtype="bfloat16")
    price = price_moe_layer(layer, ep, H100)
    n = T * K * H * 2
    assert price.sent == n and price.busiest == n
    assert (price.forward_collectives, price.backward_collectives) == (2, 2)
    link = H100.link_for(tuple(range(ep)), "all_to_all")
    assert price.seconds == pytest.approx((ep - 1) * link.latency + (ep - 1) / ep * n / link.bandwidth, rel=1e-9)
    assert price.comm == pytest.approx(4 * price.seconds)


def test_an_imbalanced_gate_prices_the_busiest_rank():
    """f = 1.5: the busiest rank's experts receive 1.5 x their share; the step waits for it."""
    layer = MoELayer(T, H, E, K, capacity_factor=None, dtype="bfloat16")
    even, skewed = price_moe_layer(layer, 4, H100), price_moe_layer(layer, 4, H100, imbalance=1.5)
    assert skewed.busiest == 1.5 * T * K * H * 2
    assert skewed.seconds == pytest.approx(collective_time("all_to_all", (0, 1, 2, 3), 1.5 * T * K * H * 2, H100))
    assert skewed.seconds > even.seconds and skewed.dropped == 0.0


def test_a_static_capacity_sends_its_padded_buffer_whatever_the_balance_and_drops_past_it():
    layer = MoELayer(100, H, E, K, capacity_factor=1.25)
    capacity = -(-2 * 100 * 1.25 // 8)  # ceil(k T / E x c) = 32
    assert layer.capacity == capacity == 32
    even, skewed = price_moe_layer(layer, 2, H100), price_moe_layer(layer, 2, H100, imbalance=2.0)
    assert even.sent == skewed.sent == E * 32 * H * 4
    assert even.seconds == skewed.seconds
    assert even.dropped == 0.0 and skewed.dropped == pytest.approx(1 - 1.25 / 2.0)


def test_one_expert_rank_moves_nothing_and_bad_arguments_are_refused():
    layer = MoELayer(T, H, E, K)
    assert price_moe_layer(layer, 1, H100).collectives == 0
    with pytest.raises(CostModelError, match="8 experts do not split over ep=3"):
        price_moe_layer(layer, 3, H100)
    with pytest.raises(CostModelError, match="imbalance"):
        price_moe_layer(layer, 2, H100, imbalance=0.5)
    with pytest.raises(CostModelError, match="top_k=9"):
        MoELayer(T, H, E, 9)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_the_experts_memory_per_rank_is_1_over_ep_of_the_replicated(ep):
    layer = MoELayer(T, H, E, K, expert_parameters=2 * H * 4 * H)  # w_in [H, 4H], w_out [4H, H]
    replicated = E * 2 * H * 4 * H * (1 + 1 + 2) * 4  # parameter, gradient, AdamW's 2 moments, float32
    assert expert_memory(layer, ep, states=2) * ep == replicated


# ---- the compiled zoo MoE ---------------------------------------------------------------------
M = autopar.ProcessMesh
CONFIG = moe.Config(n_layers=1, expert_hidden=64)
BATCH, SEQ = 4, 8
MESHES = {1: M([0, 1], ["dp"]), 2: M([0, 1], ["ep"]), 4: M([0, 1, 2, 3], ["ep"])}


def _compiled(ep, experts):
    mesh = MESHES[ep]
    seed = moe.build(CONFIG, batch=BATCH, seq=SEQ, mesh=mesh, experts=experts if ep > 1 else "stacked", optimizer="momentum")
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(cluster="h100-node"))


@pytest.fixture(scope="module")
def parameter_memory():
    return {(ep, experts): _compiled(ep, experts).decisions.price().parameter_memory
            for ep in (1, 2, 4) for experts in ("stacked", "local")}  # fmt: skip


@pytest.mark.parametrize("experts", ["stacked", "local"])
@pytest.mark.parametrize("ep", [2, 4])
def test_the_compiled_plans_memory_holds_1_over_ep_of_the_experts(parameter_memory, experts, ep):
    """Momentum: parameter, gradient and velocity of each expert, only on its holders (on the
    sub-mesh of its ep rank, or its slice of the stacked weights); everything else replicated
    alike on every mesh, so the difference from ep = 1 is the experts' (1 - 1/ep)."""
    experts_bytes = CONFIG.n_experts * 2 * CONFIG.dim * CONFIG.expert_hidden * 3 * 4
    saved = parameter_memory[(1, experts)] - parameter_memory[(ep, experts)]
    assert saved == experts_bytes - experts_bytes // ep


@pytest.mark.parametrize("ep", [2, 4])
def test_the_compiled_dispatch_and_combine_are_priced_by_the_formula(ep):
    """Paddle's way on h100-node: rank 0's 4 all_to_alls per layer, each ``T x k x h`` bytes of
    its group's tokens (capacity factor 1: the padded buffer is exactly that), at the formula's
    seconds."""
    dist = _compiled(ep, "local")
    tokens = BATCH * SEQ // ep  # one group per ep rank
    layer = MoELayer(tokens, CONFIG.dim, CONFIG.n_experts, 2, capacity_factor=CONFIG.capacity_factor)
    price = price_moe_layer(layer, ep, H100)
    moved = [c for c in dist.comm_ops(0) if c.kind.value == "all_to_all"]
    assert len(moved) == price.collectives == 4
    assert {c.bytes for c in moved} == {tokens * 2 * CONFIG.dim * 4} == {price.sent}
    assert [c.time for c in moved] == pytest.approx([price.seconds] * 4)
