"""passes/reshard_emission.py: the planned reshards become ops of one rank's program, each
collective recorded as a value with the op carrying it (stage: partitioned -> comm-inserted)."""

from pass_programs import around, assert_declared_emit_stage, data_parallel, megatron_mlp, op_names


def test_each_planned_collective_is_one_op_at_its_site_typed_to_the_local_shape():
    _, dist = megatron_mlp()
    planned = dist.decisions.reshards()
    for rank in (0, 1):
        before, after = around(dist, "reshard_emission", rank)
        assert before.collectives == ()
        names = op_names(after)
        assert len(names) == len(op_names(before)) + len(planned)  # one op per collective, nothing else
        assert [(c.key.source, c.key.index) for c, _ in after.collectives] == [("reshard", r.index) for r in planned]
        for collective, position in after.collectives:
            assert names[position] == "pd_op.all_reduce" and collective.group == (0, 1)
            op = after.program.global_block().ops[position]
            assert tuple(op.result(0).shape) == collective.output_shape == (4, 16)
    assert_declared_emit_stage(dist, "reshard_emission")


def test_gradients_planned_into_a_bucket_are_left_to_the_fusion():
    _, fused = data_parallel()
    assert around(fused, "reshard_emission")[1].collectives == ()
    _, unfused = data_parallel(fuse_allreduce=False)
    emitted = around(unfused, "reshard_emission")[1].collectives
    assert [c.kind for c, _ in emitted] == ["all_reduce"] * 6 and {c.key.source for c, _ in emitted} == {"reshard"}
