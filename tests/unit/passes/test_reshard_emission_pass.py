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


def test_a_collective_of_a_dtype_the_build_cannot_carry_is_refused_by_name():
    """Paddle's AMP O2 (bfloat16 parameters, ``paddle.amp.decorate``) on mp = 2: the row-parallel
    output is a bfloat16 all_reduce. Paddle's CPU build registers no bfloat16 all_reduce kernel, so
    the op cannot be built: an AutoparError naming the collective, the value and its dtype, not
    Paddle's TypeError (a CUDA build carries it)."""
    import paddle
    import pytest

    import autopar
    from autopar.errors import AutoparError

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        y = paddle.static.data("y", [4, 1], "int64")
        model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
        sgd = paddle.optimizer.SGD(0.1, parameters=model.parameters(), multi_precision=True)
        model, sgd = paddle.amp.decorate(models=model, optimizers=sgd, level="O2", dtype="bfloat16")
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            logits = model(x)
        sgd.minimize(paddle.nn.functional.cross_entropy(logits.astype("float32"), y).mean())
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    autopar.shard_tensor(model[0].weight, mesh, [None, "mp"])
    autopar.shard_tensor(model[2].weight, mesh, ["mp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    if paddle.is_compiled_with_cuda():
        assert any(c.dtype == "bfloat16" for c in dist.comm_ops(0))
        return
    with pytest.raises(AutoparError, match=r"all_reduce of .* \(bfloat16, row-parallel output.*no bfloat16 kernel"):
        dist.rank_plan(0)
