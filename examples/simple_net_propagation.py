"""SimpleNet on a 2 x 2 mesh: data parallel x Megatron tensor parallel, propagated by autopar.

Annotates only the input batch and two weights; autopar works out the placement of every
other tensor (gradients, optimizer states, activations) and reports where data must move.

    .venv/bin/python examples/simple_net_propagation.py
"""

import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import simple_net  # noqa: E402

net = simple_net(batch=8, sizes=(256, 1024, 256, 10))
mesh = autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])  # batch split over dp
linear1, linear2 = net.layers["linear1"], net.layers["linear2"]
autopar.shard_tensor(linear1.weight, mesh, [None, "mp"])  # column parallel
autopar.shard_tensor(linear1.bias, mesh, ["mp"])
autopar.shard_tensor(linear2.weight, mesh, ["mp", None])  # row parallel

dist = autopar.compile(net.main, mesh, startup_program=net.startup)

print(f"{'tensor':<28} {'shape':<14} placement (per mesh dim {list(mesh.dim_names)})")
for layer in net.layers.values():
    for param in (layer.weight, layer.bias):
        print(f"{param.name:<28} {str(list(param.shape)):<14} {dist.dist_attr(param)}")
for name, value in [("x", net.feeds["x"]), ("label", net.feeds["label"])] + list(net.values.items()):
    print(f"{name:<28} {str(list(value.shape)):<14} {dist.dist_attr(value)}")
print(f"{'loss':<28} {'[]':<14} {dist.dist_attr(net.loss)}")
print()
print("gradients:")
for op in dist.graph.ops:
    if op.name == "pd_op.matmul_grad":
        w = dist.graph.values[op.inputs[1]].label
        print(f"  d({w}) -> {dist.propagation.dist(op.outputs[1])}")
print()
print(dist.report)
