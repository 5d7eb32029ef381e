"""The zoo MoE's stacked experts (GSPMD's formulation: ``moe.build(..., experts="stacked")``)
routed per group of tokens lined up with the batch split (``Config(router_groups=g)``, g the
ranks splitting the batch: ep2 g=2, ep4 g=4, dp x ep g=4, ep x mp g=2). Each rank's tokens are
then whole groups: the router runs on them with no collective, and on the GPU profile the
dispatch and the combine are one all_to_all each way per MoE layer, as the local experts'
(tests/equivalence/test_zoo_moe.py). Equal to serial with SGD, and with AdamW within the fp32
floor (serial against serial with the groups in another order)."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.dropless import WHOLE_BATCH_ROUTER
from autopar.testing.processes import reordered_floor
from autopar.testing.serial import assert_simulation_equals_serial, assert_within_floor, run_serial
from autopar.testing.zoo import moe

M = autopar.ProcessMesh
BATCH, SEQ = 4, 8
# name -> (mesh, router groups: the ranks splitting the batch)
LINED_UP = {
    "ep2": (M([0, 1], ["ep"]), 2),
    "ep4": (M([0, 1, 2, 3], ["ep"]), 4),
    "dp x ep": (M([[0, 1], [2, 3]], ["dp", "ep"]), 4),
    "ep x mp": (M([[0, 1], [2, 3]], ["ep", "mp"]), 2),  # Megatron's tensor-parallel attention beside the experts
}
GPU = autopar.Strategy(cluster="h100-node")


def _build(name: str, optimizer: str = "sgd") -> tuple[moe.Config, object]:
    mesh, groups = LINED_UP[name]
    config = moe.Config(n_layers=1, router_groups=groups)
    with paddle.utils.unique_name.guard():  # (the same parameter names in every build of a config)
        return config, moe.build(config, batch=BATCH, seq=SEQ, mesh=mesh, optimizer=optimizer)


@pytest.fixture(scope="module")
def on_the_gpu_profile():
    """Each configuration's SGD program compiled for h100-node (built once per module)."""
    built = {}

    def compiled(name):
        if name not in built:
            config, seed = _build(name)
            built[name] = (
                config,
                seed,
                autopar.compile(seed.main, LINED_UP[name][0], startup_program=seed.startup, strategy=GPU),
            )
        return built[name]

    return compiled


@pytest.mark.parametrize("name", list(LINED_UP))
def test_routing_per_group_lined_up_with_the_batch_split_moves_two_all_to_alls_each_way(on_the_gpu_profile, name):
    """Rank 0, per MoE layer and step: 2 all_to_alls forward (dispatch to the experts' ranks,
    combine back to the tokens') and 2 backward, over the ep ranks; nothing else in the MoE
    layer but gradient syncs (the stacked experts' over their holders: the dp ranks sharing their
    ep coordinate). On ep x mp the attention's Megatron collectives over mp are the attention's."""
    config, _, dist = on_the_gpu_profile(name)
    mesh = LINED_UP[name][0]
    ep = mesh.dim_names.index("ep")
    ep_ranks = tuple(r for r in mesh.ranks if all(c == 0 for d, c in enumerate(mesh.coordinate(r)) if d != ep))
    moved = dist.comm_ops(0)
    all_to_alls = [c for c in moved if c.kind.value == "all_to_all"]
    assert len(all_to_alls) == 4 * config.n_layers and {c.group for c in all_to_alls} == {ep_ranks}, all_to_alls
    others = [c for c in moved if c.kind.value != "all_to_all" and "gradient sync" not in c.reason]
    assert all("Attention" in c.reason and "MoE" not in c.reason for c in others), [
        (c.kind.value, c.reason[:90]) for c in others
    ]
    assert bool(others) == ("mp" in mesh.dim_names)
    holders = tuple(r for r in mesh.ranks if mesh.coordinate(r)[ep] == mesh.coordinate(0)[ep])
    expert_syncs = [c for c in moved if "gradient sync" in c.reason and "grad(mo_e" in c.reason]
    assert all(set(c.group) <= set(holders) for c in expert_syncs), [(c.group, c.reason[:90]) for c in expert_syncs]
    assert bool(expert_syncs) == ("dp" in mesh.dim_names)  # (over mp each rank computes the same gradient: no sum)


@pytest.mark.parametrize("name", list(LINED_UP))
def test_routing_per_group_lined_up_with_the_batch_split_equals_serial(on_the_gpu_profile, name):
    """3 SGD steps of the plan counted above, in the simulator: losses and parameters equal serial."""
    config, seed, dist = on_the_gpu_profile(name)
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, BATCH, SEQ, 3))


@pytest.mark.parametrize("name", ["ep4", "dp x ep", "ep x mp"])
def test_adamw_on_the_stacked_experts_equals_serial_within_the_floor(name):
    """3 AdamW steps: losses within 1e-5 relative, every parameter within twice its floor (at
    least 1e-5). The floor: serial against serial with the batch's routing groups permuted (the
    same sums added in another order; autopar.testing.processes.reordered_floor, as the local experts')."""
    import autopar.runtime.simulator as simulator

    config, seed = _build(name, "adamw")
    groups = LINED_UP[name][1]
    per_group = BATCH // groups
    order = [2, 0, 3, 1] if groups == 4 else [1, 0]
    feeds = moe.feeds(config, BATCH, SEQ, 3)
    floor = reordered_floor(
        seed.main, seed.startup, seed.loss, feeds, [g * per_group + r for g in order for r in range(per_group)]
    )
    dist = autopar.compile(seed.main, LINED_UP[name][0], startup_program=seed.startup)
    start = paddle.get_rng_state()
    result = simulator.simulate(dist, feeds, [seed.loss])
    paddle.set_rng_state(start)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    paddle.set_rng_state(start)
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"loss at step {step}")
    assert_within_floor(result.parameters, serial.parameters, floor)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4), (2, 1, 1, 1, 2)])  # (dp, mp, pp, cp, ep): ep4, dp2 x ep2
def test_suggests_expert_parallel_plans_price_the_routing_the_program_writes(shape):
    """``suggest`` prices a plan by compiling it: where the program routes 4 groups and the plan
    splits the batch over 4 ranks (dp x ep, as suggest annotates stacked experts), rank 0 moves the
    2 all_to_alls each way and nothing else but gradient syncs, and the plan is priced below the
    same plan of the whole-batch router (its buffer reduce-scattered and gathered each way)."""
    from autopar.suggest import price_plan

    prices, kinds = {}, {}
    for groups in (1, 4):
        config = moe.Config(n_layers=1, router_groups=groups)
        with paddle.utils.unique_name.guard():
            seed = moe.build(config, batch=BATCH, seq=SEQ)
        plan = price_plan(seed.main, shape, startup_program=seed.startup, cluster="h100-node")
        moved = [c for c in plan.compile().comm_ops(0) if "gradient sync" not in c.reason]
        prices[groups], kinds[groups] = plan.price.step, sorted(c.kind.value for c in moved)
    assert kinds[4] == ["all_to_all"] * 4 and "reduce_scatter" in kinds[1]
    assert prices[4] < prices[1]


def test_whole_batch_routing_keeps_the_token_split_through_the_router(on_the_gpu_profile):
    """router_groups=1 on ep2 (h100-node): topk, one_hot and the cumsum over token slots keep the
    tokens' split; rank 0 moves only the router's sums over the tokens (the aux loss's means, the
    first choices' counts: all_reduces of a few values), one all_gather of each shard's totals per
    cumsum (2 rows of E), and the [experts, capacity, hidden] buffer of the global capacity:
    reduce-scattered to the experts and gathered back, each way. That buffer is summed over the
    ranks because each rank's tokens fill slots anywhere in the global capacity; routing per group
    moves it as all_to_alls of 1/ep of it (the test above). Equal to serial:
    tests/equivalence/test_zoo_moe.py::test_the_zoo_moe_equals_serial (router_groups=1)."""
    config = moe.Config(n_layers=1)
    mesh = LINED_UP["ep2"][0]
    with paddle.utils.unique_name.guard():
        seed = moe.build(config, batch=BATCH, seq=SEQ, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=GPU)
    moved = [c for c in dist.comm_ops(0) if "gradient sync" not in c.reason]
    carries = [c for c in moved if c.reason.startswith("scan carry")]
    assert [(c.kind.value, c.bytes) for c in carries] == [("all_gather", 2 * config.n_experts * 4)] * 2
    buffer = config.n_experts * moe.capacity(config, BATCH * SEQ) * config.dim * 4
    big = sorted((c.kind.value, c.bytes) for c in moved if c.bytes > 64)
    assert big == [("all_gather", buffer)] * 2 + [("reduce_scatter", buffer)] * 2
    rest = [c for c in moved if c not in carries and c.bytes <= 64]
    assert rest and all(c.kind.value == "all_reduce" for c in rest), [(c.kind.value, c.reason[:80]) for c in rest]
    assert len(moved) == len(carries) + len(big) + len(rest)
    # each sum of the buffer says why it is there and how routing per group avoids it
    said = sorted(c.kind.value for c in moved if WHOLE_BATCH_ROUTER in c.reason)
    assert said == ["reduce_scatter"] * 2, said
    _, _, lined_up = on_the_gpu_profile("ep2")
    assert not [c for c in lined_up.comm_ops(0) if WHOLE_BATCH_ROUTER in c.reason]
