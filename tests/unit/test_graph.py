import networkx as nx

from autopar.graph import ProgramGraph, Role
from autopar.testing.models import gpt_block_program, simple_net


def test_roles_and_forward_links_of_simple_net():
    net = simple_net(sizes=(16, 32, 10))
    graph = ProgramGraph(net.main)
    roles = {op.name: set() for op in graph.ops}
    for op in graph.ops:
        roles[op.name].add(op.role)
    assert roles["pd_op.matmul"] == {Role.FORWARD}
    assert roles["pd_op.matmul_grad"] == {Role.BACKWARD}
    assert roles["pd_op.momentum_"] == {Role.OPTIMIZER}
    assert roles["pd_op.full_like"] == {Role.BACKWARD}  # the loss-gradient seed
    for op in graph.ops:
        if op.name.endswith("_grad"):
            forward = graph.ops[op.forward_op]
            assert forward.name + "_grad" == op.name and forward.index < op.index
            assert (set(forward.inputs) | set(forward.outputs)) & set(op.inputs), f"{op} reads nothing of {forward}"


def test_values_have_names_shapes_and_kinds():
    net = simple_net(batch=8, sizes=(16, 32, 10))
    graph = ProgramGraph(net.main)
    x = graph.values[graph.by_name["x"]]
    assert x.shape == (8, 16) and x.kind == "feed" and x.dtype == "float32"
    w = graph.values[graph.by_name[net.layers["linear1"].weight.name]]
    assert w.kind == "parameter" and w.shape == (16, 32)
    assert graph.values[graph.by_name[net.layers["linear1"].weight.name + "_velocity_0"]].kind == "state"
    assert graph.key_of(net.feeds["x"]) == graph.by_name["x"]


def test_networkx_view_is_a_dag_of_ops_and_values():
    net = gpt_block_program()
    graph = ProgramGraph(net.main)
    assert nx.is_directed_acyclic_graph(graph.nx)
    op_nodes = [n for n, d in graph.nx.nodes(data=True) if d["kind"] == "op"]
    assert len(op_nodes) == len(graph.ops)


def test_vector_plumbing_is_flattened():
    net = gpt_block_program()
    graph = ProgramGraph(net.main)
    split = next(op for op in graph.ops if op.name == "pd_op.split_with_num")
    assert len(split.outputs) == 3 and all(graph.values[k].kind == "activation" for k in split.outputs)
    concat_like = [op for op in graph.ops if any(n.endswith("[0]") for n in op.input_names)]
    assert concat_like, "some op reads a combined list (split_with_num_grad / concat)"
