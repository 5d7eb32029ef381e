"""The seed's LinearNet (linear regression) with Adam, data parallel on 2 ranks.

    python -m autopar.launch --nproc 2 examples/linear_net.py

Ends by comparing with the serial run and printing the largest difference.
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.compare import train_and_compare  # noqa: E402
from autopar.testing.models import linear_net  # noqa: E402


def build():
    seed = linear_net(batch=16)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["auto", "host", "native"], default="auto")
    args = parser.parse_args()
    seed, dist = build()
    train_and_compare(seed, dist, backend=args.backend, label="linear_net adam dp")
