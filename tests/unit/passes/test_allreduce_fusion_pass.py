"""passes/allreduce_fusion.py: the gradient all-reduces of a step become one per bucket
(stage: reshard-planned -> buckets-planned at compile; comm-inserted -> comm-fused per rank).
(Moved here from test_comm_optimality.py: the bucket's bytes and the cap.)"""

import numpy as np
from pass_programs import around, assert_declared_emit_stage, data_parallel


def compile_dp(**strategy):
    """SimpleNet on dp = 4 (pass_programs.data_parallel), its mesh and its parameters by name."""
    seed, dist = data_parallel(world=4, **strategy)
    params = {p.name: p for layer in seed.layers.values() for p in (layer.weight, layer.bias)}
    return dist, dist.mesh, params


def test_data_parallel_gradients_fused_into_one_all_reduce_of_the_same_bytes():
    unfused, _, params = compile_dp(fuse_allreduce=False)
    dist, mesh, _ = compile_dp()
    param_bytes = sum(4 * int(np.prod(p.shape)) for p in params.values())
    for rank in mesh.ranks:
        (comm,) = dist.comm_ops(rank)
        assert comm.kind == "all_reduce" and comm.group == (0, 1, 2, 3) and comm.output_shape == (param_bytes // 4,)
        assert comm.bytes == sum(c.bytes for c in unfused.comm_ops(rank))
        assert comm.time < sum(c.time for c in unfused.comm_ops(rank))  # one launch instead of six
        assert f"{len(params)} gradient all_reduces fused" in comm.reason


def test_bucket_cap_splits_the_fusion():
    unfused = [c.bytes for c in compile_dp(fuse_allreduce=False)[0].comm_ops(0)]
    cap = max(unfused)  # the biggest gradient fills a bucket on its own
    dist, mesh, params = compile_dp(allreduce_bucket_mb=cap / (1 << 20))
    comms = dist.comm_ops(0)
    assert 1 < len(comms) < len(params), [c.bytes for c in comms]
    assert all(c.bytes <= cap for c in comms)
    assert sum(c.bytes for c in comms) == sum(unfused)


def test_the_pass_emits_its_buckets_and_declares_its_stages():
    _, dist = data_parallel()
    before, after = around(dist, "allreduce_fusion")
    assert before.collectives == ()  # the bucketed gradients wait for this pass
    assert [(c.kind, c.key.source, c.key.index) for c, _ in after.collectives] == [("all_reduce", "bucket", 0)]
    assert_declared_emit_stage(dist, "allreduce_fusion")
    fusion = [p for p in dist.passes.passes if p.name == "allreduce_fusion"][0]
    assert fusion.plan_ensures in fusion.emit_requires  # emits what it planned at compile
    _, unfused = data_parallel(fuse_allreduce=False)
    assert "allreduce_fusion" not in unfused.passes.names()
