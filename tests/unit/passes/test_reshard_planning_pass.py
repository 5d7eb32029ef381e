"""passes/reshard_planning.py: every reshard need planned once for the job, as values with
their steps and why (stage: propagated -> reshard-planned; compile time only)."""

from pass_programs import around, data_parallel, declared, megatron_mlp


def test_each_need_is_planned_once_with_its_steps_price_and_reason():
    _, dist = megatron_mlp()
    reshards = dist.decisions.reshards()
    assert [r.kinds for r in reshards] == [("all_reduce",), ("all_reduce",)]
    forward, backward = reshards
    assert str(forward.have) != str(forward.need) and forward.bytes == 4 * 16 * 4 and forward.time > 0
    assert forward.reason.startswith("row-parallel output in ") and forward.op.startswith("pd_op.add#")
    assert backward.reason.startswith("tensor-parallel input gradient in ")
    # emission reads the plan: every rank emits the planned reshards under their indices
    for rank in (0, 1):
        emitted = [(c.key.source, c.key.index) for c in dist.comm_ops(rank)]
        assert emitted == [("reshard", r.index) for r in reshards]


def test_gradient_syncs_are_planned_where_the_update_reads_them():
    _, dist = data_parallel(fuse_allreduce=False)
    reshards = dist.decisions.reshards()
    assert len(reshards) == 6 and {r.kinds for r in reshards} == {("all_reduce",)}
    assert all(r.op.startswith("pd_op.momentum_#") and r.site == "before read" for r in reshards)
    assert all(r.reason.startswith("gradient sync over dp in Linear") for r in reshards)


def test_planning_is_compile_time_only():
    _, dist = megatron_mlp()
    planning = declared(dist, "reshard_planning")
    assert not planning.per_rank and planning.plan_ensures == "reshard-planned"
    assert "reshard-planned" in declared(dist, "reshard_emission").emit_requires
    before, after = around(dist, "reshard_planning")
    assert after.stages == before.stages and len(after.program.global_block().ops) == len(
        before.program.global_block().ops
    )
