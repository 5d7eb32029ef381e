"""SimpleNet trained data / tensor / hybrid parallel, compared with the serial run.

    python -m autopar.launch --nproc 2 examples/simple_net.py --mode dp
    python -m autopar.launch --nproc 2 examples/simple_net.py --mode mp
    python -m autopar.launch --nproc 4 examples/simple_net.py --mode dp_mp

Every rank also runs the serial program (it is small) and prints the largest difference of
the losses (every step) and of the parameters (after the last step).
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.compare import train_and_compare  # noqa: E402
from autopar.testing.models import simple_net  # noqa: E402

MESHES = {
    "dp": lambda: autopar.ProcessMesh([0, 1], ["dp"]),
    "mp": lambda: autopar.ProcessMesh([0, 1], ["mp"]),
    "dp_mp": lambda: autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
}


def build(mode: str):
    net = simple_net(batch=8, sizes=(64, 128, 64, 10))
    mesh = MESHES[mode]()
    if "dp" in mode:
        autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    if "mp" in mode:
        autopar.shard_tensor(net.layers["linear1"].weight, mesh, [None, "mp"])  # column parallel
        autopar.shard_tensor(net.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(net.layers["linear2"].weight, mesh, ["mp", None])  # row parallel
    return net, autopar.compile(net.main, mesh, startup_program=net.startup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MESHES), default="dp")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", choices=["auto", "host", "native"], default="auto")
    args = parser.parse_args()
    net, dist = build(args.mode)
    train_and_compare(net, dist, args.steps, args.backend, label=args.mode)


if __name__ == "__main__":
    main()
