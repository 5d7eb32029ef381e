"""The zoo MoE written Paddle's way (``experts="local"``: the router per rank in
``autopar.local_map``, each expert on ``split_mesh(mesh, "ep")[i]``) under a 2-stage pipeline,
``pp x ep``. On each stage, an expert's sub-mesh is read as its ranks there (stage mesh x the
ep-fixed sub-mesh), not as a stage. A local region's serial meaning is ``fn`` per rank's shard
of the whole batch; micro-batches run it per micro-batch's shard, so the opt-in is in the
program: ``Config(router_groups=q x copies)`` has each copy route ``q`` groups of its rows,
group-major (``local_map(..., groups=q)``), and with ``q`` a multiple of the micro-batches each
micro-batch holds whole groups. One micro-batch is exact without it; more are refused by name.
Losses every step and every parameter after 3 SGD steps equal serial."""

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import moe

PP_EP = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "ep"])
PP_DP_EP = autopar.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "ep"])


def pipelined(micro_batches: int, zero_stage: int = 0) -> autopar.Strategy:
    return autopar.Strategy(zero_stage=zero_stage, pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2))


@pytest.mark.parametrize(
    ("router_groups", "micro_batches"),
    [(4, 2), (8, 2), (1, 1)],  # 2 groups a copy in 2 micro-batches, 4 in 2; one group a copy in one micro-batch (no opt-in)
)
def test_the_local_moe_under_ep_x_pp_equals_serial(router_groups, micro_batches):
    config = moe.Config(router_groups=router_groups)
    seed = moe.build(config, batch=4, seq=8, mesh=PP_EP, experts="local")
    dist = autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=pipelined(micro_batches))
    assert len(dist.state.pipeline.meshes) == 2
    experts = {dist.dist_attr(p).mesh.ranks for layer in seed.layers["model"].layers for e in layer.moe.experts for p in e.parameters()}
    assert experts == {(0,), (1,), (2,), (3,)}  # each expert on its stage's ep rank: stage mesh x the ep-fixed sub-mesh
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 3))


@pytest.mark.parametrize(("router_groups", "micro_batches"), [(1, 2), (4, 4)])
def test_a_local_router_not_grouped_by_the_micro_batches_is_refused_by_name(router_groups, micro_batches):
    """One group a copy in 2 micro-batches, and 2 groups a copy in 4: a micro-batch would route
    pieces of the serial program's groups. The refusal names the op, local_map and the opt-in."""
    config = moe.Config(router_groups=router_groups)
    seed = moe.build(config, batch=4, seq=8, mesh=PP_EP, experts="local")
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op\.\w+#\d+ \(in [\w/]*LocalMoE\).*autopar\.local_map region.*groups=q"):
        autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=pipelined(micro_batches))


def test_zero_1_under_pp_x_dp_x_ep_shards_each_expert_over_its_holders_in_its_stage():
    """8 ranks, 2 stages of dp x ep, 2 groups a copy in 2 micro-batches, ZeRO-1 with momentum:
    each expert's states are sharded over the dp ranks holding it in its stage, its gradient
    reduce-scattered among them; equal to serial."""
    config = moe.Config(router_groups=8)
    seed = moe.build(config, batch=8, seq=8, mesh=PP_DP_EP, experts="local", optimizer="momentum")
    dist = autopar.compile(seed.main, PP_DP_EP, startup_program=seed.startup, strategy=pipelined(2, zero_stage=1))
    experts = [z for z in dist.state.zero if z.label.startswith("expert")]
    assert len(experts) == 2 * config.n_experts * config.n_layers and all(z.sharded is not None for z in experts)
    kinds = {(c.kind.value, c.group) for c in dist.comm_ops(0)}
    assert ("reduce_scatter", (0, 2)) in kinds  # expert 0 of stage 0: held by ranks 0 and 2 (dp), ep == 0
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 8, 8, 3))


def test_each_micro_batch_moves_two_all_to_alls_each_way_per_layer_on_the_gpu_profile():
    """h100-node, pp x ep, 2 groups a copy in 2 micro-batches: rank 0 (stage 0, one MoE layer)
    moves, per micro-batch, exactly 2 all_to_alls forward and 2 backward over its stage's ep
    ranks, each of one micro-batch's tokens x top-k x hidden x 4 bytes (8 x 2 x 32 x 4); the
    rest is the pipeline's send / recv and the gradient syncs."""
    config = moe.Config(router_groups=4)
    seed = moe.build(config, batch=4, seq=8, mesh=PP_EP, experts="local")
    strategy = autopar.Strategy(cluster="h100-node", pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    dist = autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)
    for rank, stage_ranks in ((0, (0, 1)), (2, (2, 3))):
        moved = dist.comm_ops(rank)
        all_to_alls = [c for c in moved if c.kind.value == "all_to_all"]
        tokens = 4 * 8 // 2 // 2  # one micro-batch's tokens on one ep rank
        assert len(all_to_alls) == 4 and {(c.group, c.bytes) for c in all_to_alls} == {(stage_ranks, tokens * config.top_k * config.dim * 4)}
        rest = [c for c in moved if c.kind.value != "all_to_all"]
        assert all(c.kind.value in ("send", "recv") and "pipeline stage boundary" in c.reason or "gradient sync" in c.reason for c in rest)
        assert any(c.kind.value == "send" for c in rest) and any("gradient sync" in c.reason for c in rest)


def test_recomputed_local_moe_under_ep_x_pp_equals_serial():
    """Recompute after the stage cut: the clone of the join that gives the experts' outputs back
    (a view: each rank's piece is its value) runs where that join runs. Without its op mesh it was
    no view, and its pieces were sent and broadcast from the experts' sub-meshes ("pd_op.broadcast
    reads a result of pd_op.concat, which runs on a sub-mesh without this rank")."""
    config = moe.Config(router_groups=4)
    seed = moe.build(config, batch=4, seq=8, mesh=PP_EP, experts="local")
    strategy = autopar.Strategy(recompute=True, pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    dist = autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)
    assert not [c for c in dist.comm_ops(1) if c.kind.value == "broadcast"]
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 2))
