"""passes/zero_fusion.py: ZeRO's per-parameter reduce_scatters and write-back all_gathers become
one collective per bucket (stage: reshard-planned -> zero-buckets-planned at compile;
comm-inserted -> zero-comm-fused per rank). (Moved here from test_zero_plan.py.)"""

import pytest
from pass_programs import around, assert_declared_emit_stage
from test_zero_sharding_pass import _compile, _kinds, _wire_bytes


def test_fused_buckets_move_the_same_bytes_in_two_collectives():
    """Stage 1 packs the reduce_scatters at the updates and the write-back all_gathers into one
    buffer each, laid out rank-major; with even shards no padding: the unfused bytes exactly.
    Stages 2 and 3 pack the gradients' reduce_scatters after backward the same way."""
    _, fused = _compile(1, fuse=True)
    _, unfused = _compile(1, fuse=False)
    assert _kinds(fused) == {"reduce_scatter": 1, "all_gather": 1}
    assert _wire_bytes(fused) == pytest.approx(_wire_bytes(unfused))
    assert "6 gradient reduce_scatters at the updates fused into one buffer" in fused.comm_ops(0)[0].reason
    for stage, gathers in ((2, 1), (3, 12)):  # stage 3 still gathers each parameter before each use
        _, fused = _compile(stage, fuse=True)
        _, unfused = _compile(stage, fuse=False)
        assert _kinds(fused) == {"reduce_scatter": 1, "all_gather": gathers}
        assert _wire_bytes(fused) == pytest.approx(_wire_bytes(unfused))
        (bucket,) = [c for c in fused.comm_ops(0) if c.kind == "reduce_scatter"]
        assert "6 gradient reduce_scatters after backward fused into one buffer" in bucket.reason


def test_stage_two_bucket_runs_right_after_its_last_gradient():
    """Stage 2's fused reduce_scatter follows the last gradient backward makes (only its own
    packing between) and comes before the updates, which read shards."""
    packing = {"pd_op.slice", "pd_op.reshape", "pd_op.concat", "builtin.combine", "pd_op.full", "pd_op.full_int_array"}
    _, dist = _compile(2, fuse=True)
    names = [op.name() for op in dist.rank_plan(0).program.global_block().ops]
    bucket = names.index("pd_op.reduce_scatter")
    last_grad = max(i for i, n in enumerate(names) if n.endswith("_grad"))
    assert last_grad < bucket < names.index("pd_op.adam_")
    assert set(names[last_grad + 1 : bucket]) <= packing, set(names[last_grad + 1 : bucket]) - packing


def test_the_pass_emits_the_buckets_it_planned():
    _, dist = _compile(1, fuse=True)
    before, after = around(dist, "zero_bucket_fusion")
    assert "zero_bucket" not in {c.key.source for c, _ in before.collectives}
    fused = [c.kind for c, _ in after.collectives if c.key.source == "zero_bucket"]
    assert sorted(fused) == ["all_gather", "reduce_scatter"]
    assert_declared_emit_stage(dist, "zero_bucket_fusion")
    _, unfused = _compile(1, fuse=False)
    assert "zero_bucket_fusion" not in unfused.passes.names()
