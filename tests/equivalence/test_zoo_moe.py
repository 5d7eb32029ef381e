"""The zoo's mixture-of-experts decoder (``autopar.testing.zoo.moe``: GShard top-2 gating with a
static capacity, an auxiliary loss, a shared expert) equal to serial in the simulator, written
both ways its users write it: stacked experts (the batch over ``dp``, the stacked experts and
the batch over ``ep``) and Paddle's way (``experts="local"``: the router per group of tokens in
``autopar.local_map``, each expert its own layer on a sub-mesh of ``ep``, which is no pipeline
stage). Losses every step and every parameter after 3 SGD steps. Written Paddle's way, the
dispatch and the combine are one all_to_all each way per layer on the GPU profile (the stacked
experts' counts, routed per group: tests/equivalence/test_stacked_moe.py)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.local_map import split_mesh
from autopar.testing.serial import assert_simulation_equals_serial, assert_within_floor
from autopar.testing.zoo import moe

M = autopar.ProcessMesh
MESHES = {
    "dp": M([0, 1], ["dp"]),
    "ep2": M([0, 1], ["ep"]),
    "ep4": M([0, 1, 2, 3], ["ep"]),
    "dp x ep": M([[0, 1], [2, 3]], ["dp", "ep"]),
    "ep x mp": M([[0, 1], [2, 3]], ["ep", "mp"]),  # tensor-parallel attention beside the experts
}


@pytest.mark.parametrize("name", list(MESHES))
def test_the_zoo_moe_equals_serial(name):
    config, mesh = moe.Config(), MESHES[name]
    seed = moe.build(config, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))


@pytest.mark.parametrize(("name", "groups"), [("ep4", 4), ("dp x ep", 4), ("ep x mp", 2)])
def test_stacked_experts_routing_per_group_of_the_batch_split_equal_serial(name, groups):
    """Stacked experts with ``router_groups`` = the batch's split (dp x ep: 4 groups, one a rank;
    ep x mp: 2, one per ep rank, the attention tensor-parallel over mp): each rank routes its own
    tokens, and the serial program routes the same groups."""
    config, mesh = moe.Config(n_layers=1, router_groups=groups), MESHES[name]
    seed = moe.build(config, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))


@pytest.fixture(scope="module")
def local_moe():
    """The Paddle-way MoE compiled on each expert-parallel mesh (built once per module)."""
    config, built = moe.Config(), {}

    def compiled(name):
        if name not in built:
            seed = moe.build(config, batch=4, seq=8, mesh=MESHES[name], experts="local")
            built[name] = seed, autopar.compile(seed.main, MESHES[name], startup_program=seed.startup)
        return built[name]

    return config, compiled


@pytest.mark.parametrize("name", ["ep2", "ep4", "dp x ep", "ep x mp"])
def test_the_zoo_moe_with_experts_on_sub_meshes_equals_serial(local_moe, name):
    """Experts on ``split_mesh(mesh, "ep")[i]`` compile without a pipeline (they were read as
    stages: "... runs on mesh(dp=2), which is no pipeline stage of it") and equal the serial
    program, which routes per group as each rank does."""
    config, compiled = local_moe
    seed, dist = compiled(name)
    assert dist.strategy.pipeline is None
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))


def test_an_experts_gradients_are_reduced_over_its_holders_only(local_moe):
    """On dp x ep, expert e's weights live on the two ranks of its ep sub-mesh: their gradients
    are summed over those two (dp), never over the ranks holding other experts."""
    _, compiled = local_moe
    seed, dist = compiled("dp x ep")
    mesh, holders = MESHES["dp x ep"], split_mesh(MESHES["dp x ep"], "ep")
    for rank in mesh.ranks:
        mine = holders[mesh.coordinate(rank)[1]].ranks
        expert_syncs = [c for c in dist.comm_ops(rank) if "gradient" in c.reason and "Expert" in c.reason]
        assert expert_syncs and {c.group for c in expert_syncs} == {mine}, (rank, [(c.group, c.reason[:80]) for c in expert_syncs])


def test_local_experts_need_an_expert_dim():
    with pytest.raises(ValueError, match="experts='local' places the experts on the sub-meshes of the mesh's 'ep' dim"):
        moe.build(moe.Config(), mesh=MESHES["dp"], experts="local")


def test_zero_1_shards_an_experts_states_over_its_holders():
    """ZeRO-1 with momentum on dp x ep: an expert's gradient is reduce-scattered over the two
    ranks holding it and its updated shards gathered back there; equal to serial."""
    config, mesh = moe.Config(n_layers=1), MESHES["dp x ep"]
    seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local", optimizer="momentum")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=1))
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))
    expert = {(c.kind.value, c.group) for c in dist.comm_ops(0) if "Expert" in c.reason}
    assert expert == {("reduce_scatter", (0, 2)), ("all_gather", (0, 2))}


def test_zero_1_shards_the_stacked_experts_states_over_dp():
    """ZeRO-1 with momentum on dp x ep, stacked experts routed per rank (4 groups): each ep rank
    holds its slice of the stacked experts, replicated over dp, so its gradient is
    reduce-scattered over dp and the updated shards gathered back there; equal to serial."""
    config, mesh = moe.Config(n_layers=1, router_groups=4), MESHES["dp x ep"]
    seed = moe.build(config, batch=4, seq=8, mesh=mesh, optimizer="momentum")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=1))
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))
    experts = [z for z in dist.state.zero if str(z.whole) == "[R,S(0)]"]  # the stacked experts: split by expert over ep
    assert len(experts) == 2 and all(str(z.sharded) == "[S(0)#1,S(0)]" for z in experts), [str(z) for z in dist.state.zero]
    scattered = [c for c in dist.comm_ops(0) if c.kind.value == "reduce_scatter"]
    assert scattered and all(c.group == (0, 2) and all(f"grad({z.label})" in c.reason for z in experts) for c in scattered)
    assert any(c.kind.value == "all_gather" and c.group == (0, 2) and "ZeRO parameter gather" in c.reason for c in dist.comm_ops(0))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["ep2", "ep4", "dp x ep"]), st.integers(1, 2), st.sampled_from([0.5, 1.0, 2.0]))
def test_random_expert_counts_and_capacities_equal_serial(name, per_rank, capacity_factor):
    """Experts per rank and the capacity factor (tokens dropped or not) drawn: equal to serial."""
    mesh = MESHES[name]
    config = moe.Config(n_layers=1, n_experts=mesh.dim_size("ep") * per_rank, capacity_factor=capacity_factor)
    seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 2))


@pytest.mark.parametrize("name", ["ep2", "dp x ep"])
def test_dispatch_and_combine_are_two_all_to_alls_each_way_on_the_gpu_profile(name):
    """Per MoE layer and step on h100-node, rank 0 moves exactly 2 all_to_alls forward (dispatch
    to the experts' ranks, combine back to each group's) and 2 backward; everything else it
    moves is a gradient sync (the experts': over their holders)."""
    config, mesh = moe.Config(n_layers=1), MESHES[name]
    seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(cluster="h100-node"))
    moved = dist.comm_ops(0)
    all_to_alls = [c for c in moved if c.kind.value == "all_to_all"]
    assert len(all_to_alls) == 4 * config.n_layers and {c.group for c in all_to_alls} == {(0, 1)}
    assert all("gradient sync" in c.reason for c in moved if c.kind.value != "all_to_all")


@pytest.mark.parametrize(
    ("experts", "first", "second"),
    [("stacked", "ep2", "ep4"), ("local", "dp x ep", "ep4")],  # (local: the same 4 groups of tokens on both)
)
def test_experts_saved_on_one_expert_parallel_degree_resume_on_another(tmp_path, experts, first, second):
    """2 Momentum steps on one mesh, save; load on another, 2 steps: equal to 4 serial steps. Written
    Paddle's way, each expert is its own parameters on a sub-mesh: 2 experts a rank on dp x ep, 1 on ep4."""
    import numpy as np
    import paddle

    from autopar.testing.serial import run_serial

    config = moe.Config(n_layers=1)
    seeds, dists = [], []
    for name in (first, second):
        with paddle.utils.unique_name.guard():  # (the same parameter names in both builds)
            seed = moe.build(config, batch=4, seq=8, mesh=MESHES[name], experts=experts, optimizer="momentum")
        seeds.append(seed)
        dists.append(autopar.compile(seed.main, MESHES[name], startup_program=seed.startup))
    feeds, path = moe.feeds(config, 4, 8, 4), tmp_path / "ckpt"
    start = paddle.get_rng_state()
    before = autopar.simulate(dists[0], feeds[:2], [seeds[0].loss], save_to=path)
    after = autopar.simulate(dists[1], feeds[2:], [seeds[1].loss], load_from=path)
    paddle.set_rng_state(start)
    serial = run_serial(seeds[0].main, seeds[0].startup, feeds, [seeds[0].loss])
    for step, (want, got) in enumerate(zip(serial.fetches, before.fetches + after.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"loss at step {step}")
    assert serial.parameters.keys() == after.parameters.keys()
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(after.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def adamw_floor():
    """The fp32 floor of 3 AdamW steps of the local MoE on dp x ep (4 groups of one row each):
    per parameter, how far the serial program moves when the batch's rows come in another order
    (the groups permuted: the same sums, added in another order)."""
    import paddle

    from autopar.testing.processes import reordered_floor
    from autopar.testing.serial import run_serial

    config, mesh = moe.Config(n_layers=1), MESHES["dp x ep"]
    with paddle.utils.unique_name.guard():  # (the parameters named as in each test's build)
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local", optimizer="adamw")
    feeds = moe.feeds(config, 4, 8, 3)
    floor = reordered_floor(seed.main, seed.startup, seed.loss, feeds, rows=[2, 0, 3, 1])
    start = paddle.get_rng_state()
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    paddle.set_rng_state(start)
    return config, feeds, serial, floor


def test_adamws_floor_on_the_local_moe_is_the_attention_key_bias(adamw_floor):
    """The key bias's gradient is zero up to rounding (softmax does not see a constant added to
    every key's score), and Adam normalises that noise into full-size steps: serial against
    serial moves it by ~1e-2, every other parameter by ~1e-6."""
    _, _, serial, floor = adamw_floor
    big = {n for n, f in floor.items() if f > 1e-4}
    assert len(big) == 1 and serial.parameters[big.pop()].shape == (3 * moe.Config().dim,), floor


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_and_adamw_on_the_local_experts_equal_serial_within_the_floor(adamw_floor, stage):
    """ZeRO-1/2/3 with AdamW on dp x ep: losses within 1e-5 relative, every parameter within
    twice its floor (at least 1e-5). An expert is sharded over its holders at every stage; the
    router's weight, read whole by every local_map copy on its sub-mesh, is stored whole at
    stage 3 (its states and gradient still sharded)."""
    import numpy as np
    import paddle

    config, feeds, serial, floor = adamw_floor
    mesh = MESHES["dp x ep"]
    with paddle.utils.unique_name.guard():
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local", optimizer="adamw")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=stage))
    experts = [z for z in dist.state.zero if "expert" in z.label]
    assert experts and all(z.sharded is not None and z.reason == f"stage {stage}" for z in experts)
    whole = [z for z in dist.state.zero if z.reason.startswith("stage 3, stored whole")]
    assert len(whole) == (config.n_layers if stage == 3 else 0)  # each layer's router weight, read by every copy
    start = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [seed.loss])
    paddle.set_rng_state(start)
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"loss at step {step}")
    assert_within_floor(result.parameters, serial.parameters, floor)
