"""Selective recompute as a serial rewrite (autopar/rewrites/recompute.py): what is selected, what is
refused by name, and the rewritten program — which backward reads moved to clones, that the
dropped values leave saved_activations, that dropout is recomputed from its forward mask, and
that the rewritten program alone computes exactly what the user's does."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, Role
from autopar.inspect.cost_report import saved_activations
from autopar.rewrites.recompute import recompute
from autopar.testing.models import annotate_megatron, gpt_block_program
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import random_feeds, run_serial


def gpt(**options):
    return gpt_block_program(batch=2, seq=4, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum", **options)


def names(program):
    return [op.name() for op in program.global_block().ops]


def small(inplace=False, noise=False):
    """x -> Linear -> exp -> (relu_ in place) -> tanh -> mean: one op of each case."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        h = paddle.exp(paddle.nn.Linear(8, 8)(x))
        h = paddle._C_ops.relu_(h) if inplace else paddle.nn.functional.relu(h)
        if noise:
            h = h + paddle.rand([4, 8])
        loss = paddle.mean(paddle.tanh(h))
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup, x, loss


# ---- selection ----------------------------------------------------------------------------------


def test_strategy_accepts_false_true_and_names_and_refuses_the_rest():
    assert autopar.Strategy(recompute=["softmax", "dropout"]).recompute == ("softmax", "dropout")
    assert autopar.Strategy(recompute="gelu").recompute == ("gelu",)
    assert autopar.Strategy(recompute=True).recompute is True
    for junk in (1, (), ("softmax", 3), ("",), {"softmax"}):
        with pytest.raises(
            AutoparError, match="Strategy.recompute must be False, True, or a tuple of op types / layer paths"
        ):
            autopar.Strategy(recompute=junk)


def test_op_types_select_the_op_and_its_in_place_form_layer_paths_by_struct_name():
    main, _, _, _ = small(inplace=True)
    report = recompute(main, ("relu", "tanh", "exp"))
    assert any("pd_op.relu_#" in why and "in place" in why for why in report.kept)  # matched by "relu", left alone
    assert any(
        why.startswith("pd_op.exp#") and "which pd_op.relu_#" in why for why in report.kept
    )  # its output is overwritten
    assert [v.op.split("#")[0] for v in report.dropped] == ["pd_op.tanh"]
    seed = gpt(layer_calls=True)
    layers = sorted({str(op.attrs()["struct_name"]).strip("/").split("/")[0]
                     for op in seed.main.global_block().ops if op.has_attr("struct_name")})  # fmt: skip
    # one call's path, e.g. TransformerLayer_3 (in a fresh process the first call is the bare
    # "TransformerLayer", which also names the class: every call)
    first = next(name for name in layers if name.startswith("TransformerLayer_"))
    one = recompute(seed.main, (first,))
    every = recompute(seed.main, ("TransformerLayer*",))
    assert 0 < len(one.clones) < len(every.clones)
    assert recompute(seed.main, ("TransformerLayer",)).clones.keys() == every.clones.keys()  # the class: every call
    assert recompute(seed.main, ("TransformerLayer*/Linear*",)).clones  # the layers' own Linear calls
    # Megatron's selective recompute: the core attention, from q, k and v (kept anyway for their matmul_grads)
    core = recompute(
        gpt(layer_calls=True, dropout=0.1).main,
        ("TransformerLayer*/matmul", "TransformerLayer*/scale", "softmax", "dropout"),
    )
    graph = core.graph()
    matmuls = [graph.ops[i] for i in core.clones if graph.ops[i].name == "pd_op.matmul"]
    assert len(matmuls) == 2 and all(op.attrs["struct_name"].count("/") == 2 for op in matmuls)  # q·kᵀ, not a Linear's
    assert not core.checkpoints and {v.op.split("#")[0] for v in core.dropped} == {"pd_op.softmax", "pd_op.dropout"}


def test_unknown_names_random_ops_and_programs_without_layers_or_backward_are_refused_by_name():
    main, _, _, _ = small()
    with pytest.raises(
        AutoparError,
        match="'sofmax', 'Block/Attn' match\\(es\\) no forward op type or layer path .* "
        "op types: add, exp, matmul, mean, relu, tanh; layer paths: Linear",
    ):
        recompute(main, ("sofmax", "tanh", "Block/Attn"))
    with pytest.raises(
        AutoparError, match="recompute=True recomputes every layer call .* no op of the program was made by an nn.Layer"
    ):
        recompute(functional_program(), True)
    with pytest.raises(AutoparError, match="selects pd_op.uniform#\\d+, which draws random numbers"):
        recompute(small(noise=True)[0], ("uniform",))
    paddle.enable_static()
    forward_only = paddle.static.Program()
    with paddle.static.program_guard(forward_only, paddle.static.Program()):
        paddle.tanh(paddle.static.data("x", [2, 2], "float32"))
    with pytest.raises(AutoparError, match="the program has no backward"):
        recompute(forward_only, ("tanh",))


def functional_program():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 3], "float32")
        w = paddle.create_parameter([3, 3], "float32")
        loss = paddle.mean(paddle.tanh(paddle.matmul(x, w)))
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main


# ---- the rewritten program ------------------------------------------------------------------------


def test_backward_reads_move_to_clones_and_dropout_reuses_its_forward_mask():
    seed = gpt(dropout=0.1)
    before = names(seed.main)
    report = recompute(seed.main, ("softmax", "dropout"))
    assert names(seed.main) == before  # the user's program is never modified
    after = names(report.program)
    assert after.count("pd_op.dropout") == before.count("pd_op.dropout")  # no mask is drawn again
    assert after.count("pd_op.softmax") == before.count("pd_op.softmax") + 2  # one clone per layer
    graph = report.graph()
    clones = [graph.ops[i] for i in report.clones]
    assert all(op.role is Role.BACKWARD and op.recomputes == op.forward_op for op in clones)
    for op in graph.ops:
        if op.name == "pd_op.softmax_grad":  # reads the clone's softmax, linked to the forward softmax
            maker = graph.ops[op.inputs[0][0]]
            assert maker.recomputes is not None and maker.name == "pd_op.softmax"
            assert graph.ops[op.forward_op].role is Role.FORWARD
    attention = [op for op in graph.ops if op.name == "pd_op.dropout" and len(graph.values[op.outputs[0]].shape) == 4]
    for dropout in attention:  # the attention dropout's output is read again only through its clone
        readers = {graph.ops[u].role for u in graph.values[dropout.outputs[0]].users}
        assert readers == {Role.FORWARD}
        clone = next(op for op in clones if op.recomputes == dropout.index and op.name == "pd_op.cast")
        assert clone.inputs == [dropout.outputs[1]]  # x * cast(mask) / (1 - p): the forward mask
    ffn = [op for op in graph.ops if op.name == "pd_op.dropout" and op not in attention]
    assert ffn and not {op.recomputes for op in clones} & {op.index for op in ffn}  # add_grad reads only its shape
    assert all(str(op) in report.idle for op in ffn)


def test_saved_activations_drop_the_recomputed_values():
    seed = gpt(dropout=0.1)
    plain = ProgramGraph(seed.main)
    report = recompute(seed.main, ("softmax", "dropout"))
    graph = report.graph()
    saved = {graph.values[k].label for k in saved_activations(graph)}
    dropped = {v.label for v in report.dropped}
    assert dropped and not dropped & saved
    kinds = {plain.ops[k[0]].name for k in saved_activations(plain)}
    assert {"pd_op.softmax", "pd_op.dropout"} <= kinds
    assert not {graph.ops[k[0]].name for k in saved_activations(graph)} & {"pd_op.softmax"}
    bytes_of = {v.label: v.bytes for v in report.checkpoints}
    assert report.dropped_bytes > sum(bytes_of.values())  # softmax + dropout out, for the scores kept instead


def test_the_rewritten_program_alone_equals_the_users_bit_for_bit():
    for selection, options in (
        (("softmax", "dropout"), {"dropout": 0.1}),
        (True, {"layer_calls": True, "dropout": 0.1}),
    ):
        seed = gpt(**options)
        report = recompute(seed.main, selection)
        feeds = random_feeds(seed.feeds, 3, classes=32)
        want = run_serial(seed.main, seed.startup, feeds, [seed.loss])
        got = run_serial(report.program, seed.startup, feeds, [report.value(seed.loss)])
        assert [float(f[0]) for f in got.fetches] == [float(f[0]) for f in want.fetches]
        for name, value in want.parameters.items():
            np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)


def test_whole_layers_keep_only_each_layer_input():
    seed = gpt(layer_calls=True)
    report = recompute(seed.main, ("TransformerLayer*",))
    graph = report.graph()
    norms = [op for op in graph.ops if op.name == "pd_op.layer_norm" and op.role is Role.FORWARD]
    first_out, last_out = norms[1].outputs[0], norms[-1].outputs[0]  # layer 1's output is layer 2's input
    dropped = {v.label for v in report.dropped}
    assert graph.values[first_out].label not in dropped and graph.values[last_out].label in dropped
    layer2 = [op for op in graph.ops if op.recomputes is not None and op.recomputes > norms[1].index]
    assert any(first_out in op.inputs for op in layer2)  # layer 2's clones read layer 1's output as kept
    assert not report.checkpoints  # each layer's input is kept anyway (its matmul_grad reads it)


def test_fetches_annotations_and_comm_ops_resolve_through_the_rewrite():
    seed = gpt(dropout=0.1)
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    annotate_megatron(seed, mesh)
    plain = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    dist = autopar.compile(
        seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=("softmax", "dropout"))
    )
    assert str(dist.dist_attr(seed.layers["qkv0"].weight)) == "[S(1)]"  # the user's annotation, through the rewrite
    assert dist.key(seed.loss) in dist.values and dist.state.recompute.dropped
    kinds = [(c.kind.value, c.bytes) for c in dist.comm_ops(0)]
    assert kinds == [(c.kind.value, c.bytes) for c in plain.comm_ops(0)]  # attention's recomputation moves nothing
    acts = [r.memory.activations for r in dist.cost.ranks]
    assert all(a < b for a, b in zip(acts, (r.memory.activations for r in plain.cost.ranks)))


def test_a_clone_reading_a_resharded_input_reshards_it_again_in_the_backward():
    """layer_norm over a feature-split feed needs it whole: the clone's all_gather is planned in
    the backward (not kept alive from the forward's), and the run equals serial."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [6, 10], "float32")
        loss = paddle.mean(paddle.nn.Linear(10, 3)(paddle.nn.functional.gelu(paddle.nn.LayerNorm(10)(x))) ** 2)
        paddle.optimizer.SGD(0.1).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["d"])
    autopar.shard_tensor(x, mesh, [None, "d"])
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(recompute=("layer_norm",)))
    gathers = [c for c in dist.comm_ops(0) if c.kind == "all_gather"]
    clone = next(dist.graph.ops[i] for i in dist.state.recompute.clones)
    assert len(gathers) == 2 and f"{clone} reads x as [R]" in gathers[1].reason
    feeds = random_feeds({"x": x}, 3)
    start = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [loss])
    paddle.set_rng_state(start)
    serial = run_serial(main, startup, feeds, [loss])
    for want, got in zip(serial.fetches, result.fetches):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)


def test_values_sent_between_pipeline_stages_stay_kept():
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    strategy = {"pipeline": autopar.PipelineConfig(micro_batches=2)}
    seed = staged_mlp(mesh, widths=(16, 32, 32, 16, 10))
    plain = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))
    dist = autopar.compile(
        seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=("relu",), **strategy)
    )
    assert len(dist.state.recompute.dropped) == 2  # the relus whose output stays on their stage
    for rank in (0, 1):  # the stage boundary's relu is not sent again in the backward
        assert [c.kind.value for c in dist.comm_ops(rank)] == [c.kind.value for c in plain.comm_ops(rank)]
    phases = dict(zip((op.id() for op in dist.rank_program(0).global_block().ops), dist.rank_plan(0).pipeline.phases))
    ops = list(dist.rank_program(0).global_block().ops)
    clones = [op for op in ops if op.name() == "pd_op.relu"][2:]  # after stage 0's two forward relus
    assert clones and all(phases[op.id()].startswith("B") for op in clones)
