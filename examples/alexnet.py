"""The seed's AlexNet-style net: convolutions data parallel, classifier model parallel.

    python -m autopar.launch --nproc 2 examples/alexnet.py          # 1-d mesh: conv DP, FC MP over the same ranks
    python -m autopar.launch --nproc 4 examples/alexnet.py --ranks 4  # 2 x 2 mesh: conv over dp, FC over mp

Ends by comparing with the serial run and printing the largest difference.
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.compare import train_and_compare  # noqa: E402
from autopar.testing.models import alexnet_program  # noqa: E402


def build(ranks: int):
    seed = alexnet_program(batch=8, image=16)
    if ranks == 2:
        mesh, dp, mp = autopar.ProcessMesh([0, 1], ["x"]), "x", "x"
    else:
        mesh, dp, mp = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), "dp", "mp"
    autopar.shard_tensor(seed.feeds["x"], mesh, [dp, None, None, None])  # batch split: conv data parallel
    autopar.shard_tensor(seed.layers["fc1"].weight, mesh, [None, mp])  # classifier: column parallel
    autopar.shard_tensor(seed.layers["fc1"].bias, mesh, [mp])
    autopar.shard_tensor(seed.layers["fc2"].weight, mesh, [mp, None])  # then row parallel
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, choices=[2, 4], default=2)
    parser.add_argument("--backend", choices=["auto", "host", "native"], default="auto")
    args = parser.parse_args()
    seed, dist = build(args.ranks)
    train_and_compare(seed, dist, backend=args.backend, label=f"alexnet {args.ranks} ranks")
