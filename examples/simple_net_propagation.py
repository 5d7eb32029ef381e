"""SimpleNet on a 2 x 2 mesh: data parallel x Megatron tensor parallel, propagated by autopar.

Annotates only the input batch and two weights; autopar works out the placement of every
other tensor (gradients, optimizer states, activations), inserts the collectives (each with
its reason, bytes and predicted time), and — in the in-process simulator — trains 5 steps
that equal the serial run.

    .venv/bin/python examples/simple_net_propagation.py
"""

import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.testing.models import simple_net  # noqa: E402
from autopar.testing.serial import random_feeds, run_serial  # noqa: E402

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
for value in dist.decisions.values():  # the query API: every value's decided placement
    if value.producer.startswith("pd_op.matmul_grad") and value.label.startswith("grad("):
        print(f"  {value.label.split()[0]} -> {value.placement}")
print()
print(dist.report)
print()
print("collectives on rank 0:")
for comm in dist.comm_ops(0):
    print(f"  {comm}")
print()
feeds = random_feeds(net.feeds, steps=5)
serial = run_serial(net.main, net.startup, feeds, [net.loss])
result = autopar.simulate(dist, feeds, [net.loss])  # all 4 ranks in this process
losses = [float(step[0]) for step in result.fetches]
loss_diff = max(abs(a - float(b[0])) for a, b in zip(losses, serial.fetches))
param_diff = max(float(np.max(np.abs(result.parameters[n] - v))) for n, v in serial.parameters.items())
print(f"5 steps on 4 simulated ranks: losses {[round(x, 4) for x in losses]}")
print(f"max |loss - serial| = {loss_diff:.2g}, max |parameter - serial| = {param_diff:.2g}")
