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


def _o2_row_parallel():
    """Paddle's AMP O2 (bfloat16 parameters through ``paddle.amp.decorate``, fp32 masters) on
    mp = 2: the row-parallel output is a bfloat16 all_reduce, which Paddle's CPU build registers
    no kernel for (its op cannot be built on a bfloat16 input)."""
    import paddle

    import autopar

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
    return autopar.compile(main, mesh, startup_program=startup)


def test_a_collective_of_a_dtype_the_build_cannot_carry_is_carried_in_the_host_form():
    """The host form's op is a placeholder the runtime performs: a bfloat16 all_reduce reading
    the bfloat16 value itself, typed bfloat16, with no trace of the float32 proxy it was built on;
    its Collective says bfloat16 and counts 2 bytes an element."""
    import paddle

    dist = _o2_row_parallel()
    plan = dist.rank_plan(0)
    (collective,) = dist.comm_ops(0)
    assert (collective.kind, collective.dtype, collective.bytes) == ("all_reduce", "bfloat16", 4 * 4 * 2)
    ops = list(plan.program.global_block().ops)
    carrier = ops[plan.collectives[0][1]]
    assert carrier.name() == "pd_op.all_reduce"
    assert carrier.operand_source(0).dtype == carrier.result(0).dtype == paddle.bfloat16
    assert carrier.operand_source(0).get_defining_op().name() == "pd_op.matmul"  # the value itself, no cast between
    assert "(tensor<4x4xbf16>) -> tensor<4x4xbf16>" in str(plan.program).split("pd_op.all_reduce")[1].splitlines()[0]
    casts = [op.name() for op in dist.serial_program.global_block().ops].count("pd_op.cast")
    assert [op.name() for op in ops].count("pd_op.cast") == casts  # the proxy cast erased


def test_a_collective_of_a_dtype_the_build_cannot_carry_is_refused_by_name_in_the_native_form():
    """The native form runs the op itself: on a build without the kernel (the CPU build) it is
    refused naming the collective, the value and its dtype (a CUDA build carries it); the auto
    backend then runs the host form."""
    import paddle
    import pytest

    from autopar.errors import NativeUnsupported

    dist = _o2_row_parallel()
    if paddle.is_compiled_with_cuda():
        assert dist.rank_plan(0, "native").collectives
        return
    with pytest.raises(NativeUnsupported, match=r"all_reduce of .* \(bfloat16, row-parallel output.*no bfloat16 kernel"):
        dist.rank_plan(0, "native")
    assert dist.rank_plan(0, "auto").backend == "host"
