"""passes/fetch_replication.py: the values the user fetches are made whole on every rank inside
the program; a fetched loss rides in the gradient bucket (stage: comm-fused -> fetches-placed,
per rank and fetch list). (The first two tests moved here from test_rank_plan.py.)"""

from pass_programs import around, assert_declared_emit_stage

import autopar
from autopar.testing.models import simple_net
from autopar.testing.serial import assert_simulation_equals_serial


def _compile(mesh, **strategy):
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))


def test_a_fetch_list_is_made_whole_inside_the_program():
    # without a gradient bucket, the loss (a pending sum over dp) gets its own scalar all_reduce
    seed, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]), fuse_allreduce=False)
    plain = dist.rank_plan(0)
    plan = dist.rank_plan(0, fetches=[seed.loss])
    assert plan.fetches == (dist.key(seed.loss),) and len(plan.fetch_positions) == 1
    (added,) = [c for c, _ in plan.collectives if c.key.source == "fetch"]
    assert added.kind == "all_reduce" and added.group == (0, 1) and added.shape == ()  # one scalar
    assert len(plan.collectives) == len(plain.collectives) + 1 and "fetched" in added.reason
    assert dist.rank_plan(0, fetches=[seed.loss]) is plan  # cached per fetch list
    # a fetched feed split on the batch is gathered whole
    gathered = dist.rank_plan(0, fetches=["x"])
    (gather,) = [c for c, _ in gathered.collectives if c.key.source == "fetch"]
    assert gather.kind == "all_gather" and gather.output_shape == (8, 16)


def test_a_fetched_loss_rides_in_the_gradient_bucket():
    """The dp loss needs the bucket's own all_reduce (same group, sum, float32) and is made
    before it: one more element in the bucket, no collective of its own; a fetch that needs
    another collective (a gather of the batch) still gets one."""
    seed, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]))
    plain = dist.rank_plan(0, backend="native")
    plan = dist.rank_plan(0, backend="native", fetches=[seed.loss, "x"])
    (bucket,) = [c for c, _ in plain.collectives if c.key.source == "bucket"]
    (riding,) = [c for c, _ in plan.collectives if c.key.source == "bucket"]
    assert riding.shape == (bucket.shape[0] + 1,) and riding.bytes == bucket.bytes + 4
    assert "rides along (no collective of its own)" in riding.reason
    fetch_kinds = [str(c.kind) for c, _ in plan.collectives if c.key.source == "fetch"]
    assert fetch_kinds == ["all_gather"] and len(plan.collectives) == len(plain.collectives) + 1
    assert_simulation_equals_serial(seed, dist)  # the losses fetched each step: the riders' pieces


def test_without_fetches_the_pass_adds_nothing():
    seed, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]), fuse_allreduce=False)
    before, after = around(dist, "fetch_replication")
    assert after.fetches == () and [c for c, _ in after.collectives if c.key.source == "fetch"] == []
    assert len(after.program.global_block().ops) == len(before.program.global_block().ops)
    assert_declared_emit_stage(dist, "fetch_replication")
