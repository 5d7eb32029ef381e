"""Propagation on the seed models, against hand-derived placement tables.

Each table lists, in program order, every op (data / parameter ops aside) and the placement
of each of its results ("-" for a result nobody needs). The tables were derived by hand from
the math of each op, not copied from autopar's output.
"""

import pytest

import autopar
from autopar.testing.models import alexnet_program, annotate_megatron, gpt_block_program, simple_net

SIMPLE_DP = """
matmul [S(0)] | add [S(0)] | relu [S(0)] | matmul [S(0)] | add [S(0)] | relu [S(0)] | matmul [S(0)] | add [S(0)]
cross_entropy_with_softmax [S(0)] [S(0)]
full_int_array [R] | mean [P(sum)] | full_int_array [R] | mean [P(sum)] | full [R] | full_like [R]
mean_grad [R] | mean_grad [S(0)] | cross_entropy_with_softmax_grad [S(0)]
add_grad [S(0)] [P(sum)] | matmul_grad [S(0)] [P(sum)] | relu_grad [S(0)]
add_grad [S(0)] [P(sum)] | matmul_grad [S(0)] [P(sum)] | relu_grad [S(0)]
add_grad [S(0)] [P(sum)] | matmul_grad - [P(sum)]
momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [R] [R] -
"""

SIMPLE_MP = """
matmul [S(1)] | add [S(1)] | relu [S(1)] | matmul [P(sum)] | add [R] | relu [R] | matmul [R] | add [R]
cross_entropy_with_softmax [R] [R]
full_int_array [R] | mean [R] | full_int_array [R] | mean [R] | full [R] | full_like [R]
mean_grad [R] | mean_grad [R] | cross_entropy_with_softmax_grad [R]
add_grad [R] [R] | matmul_grad [R] [R] | relu_grad [R]
add_grad [R] [R] | matmul_grad [S(1)] [S(0)] | relu_grad [S(1)]
add_grad [S(1)] [S(0)] | matmul_grad - [S(1)]
momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [R] [R] - | momentum_ [S(0)] [S(0)] - | momentum_ [S(0)] [S(0)] - | momentum_ [S(1)] [S(1)] -
"""

SIMPLE_DP_MP = """
matmul [S(0),S(1)] | add [S(0),S(1)] | relu [S(0),S(1)] | matmul [S(0),P(sum)] | add [S(0),R] | relu [S(0),R]
matmul [S(0),R] | add [S(0),R]
cross_entropy_with_softmax [S(0),R] [S(0),R]
full_int_array [R,R] | mean [P(sum),R] | full_int_array [R,R] | mean [P(sum),R] | full [R,R] | full_like [R,R]
mean_grad [R,R] | mean_grad [S(0),R] | cross_entropy_with_softmax_grad [S(0),R]
add_grad [S(0),R] [P(sum),R] | matmul_grad [S(0),R] [P(sum),R] | relu_grad [S(0),R]
add_grad [S(0),R] [P(sum),R] | matmul_grad [S(0),S(1)] [P(sum),S(0)] | relu_grad [S(0),S(1)]
add_grad [S(0),S(1)] [P(sum),S(0)] | matmul_grad - [P(sum),S(1)]
momentum_ [R,R] [R,R] - | momentum_ [R,R] [R,R] - | momentum_ [R,R] [R,R] - | momentum_ [R,S(0)] [R,S(0)] -
momentum_ [R,S(0)] [R,S(0)] - | momentum_ [R,S(1)] [R,S(1)] -
"""


def parse_table(text):
    rows = []
    for item in text.replace("\n", " | ").split("|"):
        if item.strip():
            name, *outs = item.split()
            rows.append((name, outs))
    return rows


def actual_table(dist):
    rows = []
    for op in dist.graph.ops:
        if op.name in ("pd_op.data", "builtin.parameter"):
            continue
        outs = ["-" if k is None else str(dist.propagation.dist(k)) for k in op.outputs]
        rows.append((op.short_name, outs))
    return rows


def compile_simple(mesh, dp, mp):
    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    if dp:
        autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    if mp:
        autopar.shard_tensor(net.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(net.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(net.layers["linear2"].weight, mesh, ["mp", None])
    return net, autopar.compile(net.main, mesh)


@pytest.mark.parametrize(
    "mesh, dp, mp, table, reshards",
    [
        (autopar.ProcessMesh([0, 1], ["dp"]), True, False, SIMPLE_DP, 6),
        (autopar.ProcessMesh([0, 1], ["mp"]), False, True, SIMPLE_MP, 1),
        (autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), True, True, SIMPLE_DP_MP, 7),
    ],
    ids=["dp", "mp", "dp_mp"],
)
def test_simple_net_matches_hand_derived_table(mesh, dp, mp, table, reshards):
    net, dist = compile_simple(mesh, dp, mp)
    assert actual_table(dist) == parse_table(table)
    assert dist.report.unsupported_ops == []
    assert len(dist.report.reshards) == reshards, "\n".join(map(str, dist.report.reshards))


def test_simple_net_gradients_are_sharded_like_weights():
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    net, dist = compile_simple(mesh, True, True)
    for op in dist.graph.ops:
        if op.name != "pd_op.momentum_":
            continue
        param, grad = op.inputs[0], op.inputs[1]
        weight = dist.propagation.dist(param)
        grad_attr = dist.propagation.dist(grad)
        assert grad_attr.mapping == weight.mapping, dist.graph.values[param].label
        assert grad_attr.partial_dims in ({}, {0: "sum"})  # pending data-parallel sum only
    matmul2 = [op for op in dist.graph.ops if op.name == "pd_op.matmul"][1]
    assert str(dist.propagation.dist(matmul2.outputs[0])) == "[S(0),P(sum)]"


def test_every_value_of_the_seed_programs_has_a_dist_attr():
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    for seed in (simple_net(), gpt_block_program(), alexnet_program()):
        dist = autopar.compile(seed.main, mesh)
        for op in seed.main.global_block().ops:
            for result in op.results():
                if result.initialized():
                    assert dist.dist_attr(result) is not None
        for name in dist.graph.by_name:
            assert dist.dist_attr(name).mesh == mesh


def compile_gpt(layers=1):
    seed = gpt_block_program(batch=2, seq=8, hidden=32, heads=4, vocab=64, layers=layers)
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    annotate_megatron(seed, mesh)
    return seed, autopar.compile(seed.main, mesh)


def test_gpt_block_megatron_from_weight_annotations_only():
    seed, dist = compile_gpt()
    ops = dist.graph.ops
    first = {}
    for op in ops:
        first.setdefault(op.short_name, []).append(op)
    placement = lambda op, i=0: str(dist.propagation.dist(op.outputs[i]))  # noqa: E731
    assert placement(first["softmax"][0]) == "[S(1)]"  # attention heads split over mp
    matmuls = first["matmul"]
    assert placement(matmuls[0]) == "[S(2)]"  # qkv: column parallel
    assert placement(matmuls[3]) == "[P(sum)]"  # proj: row parallel, pending sum
    assert placement(matmuls[4]) == "[S(2)]"  # fc1: column parallel
    assert placement(matmuls[5]) == "[P(sum)]"  # fc2: row parallel
    assert all(placement(op) == "[R]" for op in first["layer_norm"])
    grads = {dist.graph.values[op.inputs[0]].label: str(dist.propagation.dist(op.inputs[1])) for op in ops if op.name == "pd_op.adamw_"}
    assert grads[seed.layers["qkv0"].weight.name] == "[S(1)]"
    assert grads[seed.layers["proj0"].weight.name] == "[S(0)]"
    assert grads[seed.layers["head"].weight.name] == "[R]"
    assert dist.report.unsupported_ops == []


def test_gpt_block_forward_needs_one_all_reduce_per_row_parallel_layer():
    seed, dist = compile_gpt(layers=2)
    forward = [r for r in dist.report.reshards if dist.graph.ops[r.op].role.value == "forward"]
    kinds = [(str(r.have), str(r.need)) for r in forward]
    assert kinds == [("[P(sum)]", "[R]")] * 4, "\n".join(map(str, forward))


def test_alexnet_conv_data_parallel_classifier_model_parallel():
    seed = alexnet_program()
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None, None, None])
    autopar.shard_tensor(seed.layers["fc1"].weight, mesh, [None, "mp"])
    autopar.shard_tensor(seed.layers["fc1"].bias, mesh, ["mp"])
    autopar.shard_tensor(seed.layers["fc2"].weight, mesh, ["mp", None])
    dist = autopar.compile(seed.main, mesh)
    by_name = {}
    for op in dist.graph.ops:
        by_name.setdefault(op.short_name, []).append(op)
    out = lambda op, i=0: str(dist.propagation.dist(op.outputs[i]))  # noqa: E731
    assert [out(op) for op in by_name["conv2d"]] == ["[S(0),R]", "[S(0),R]"]
    assert [out(op) for op in by_name["pool2d"]] == ["[S(0),R]", "[S(0),R]"]
    assert [out(op) for op in by_name["matmul"]] == ["[S(0),S(1)]", "[S(0),P(sum)]"]
    conv_grads = [str(dist.propagation.dist(op.outputs[1])) for op in by_name["conv2d_grad"]]
    assert conv_grads == ["[P(sum),R]", "[P(sum),R]"]
    assert dist.dist_attr(seed.layers["conv1"].weight).is_replicated
    assert dist.report.unsupported_ops == []
