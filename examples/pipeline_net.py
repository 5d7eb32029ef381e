"""SimpleNet as a two-stage pipeline (the primer's example), compared with the serial run.

    python -m autopar.launch --nproc 2 examples/pipeline_net.py --schedule 1F1B --micro-batches 4

Linear1 runs on mesh[0] (rank 0), Linear2 and Linear3 on mesh[1] (rank 1), placed with
``autopar.shard_op``; the activation crosses stages as a send / recv per micro-batch and its
gradient comes back the same way. Rank 0 prints its schedule; every rank compares its losses
(every step) and the parameters (after the last step) with the serial program's.
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.compare import train_and_compare  # noqa: E402
from autopar.testing.pipeline_models import staged_mlp  # noqa: E402


def build(schedule: str = "1F1B", micro_batches: int = 4):
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    net = staged_mlp(mesh, widths=(64, 128, 64, 10), batch=16)
    config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
    return net, autopar.compile(net.main, mesh, startup_program=net.startup, strategy=autopar.Strategy(pipeline=config))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["FThenB", "1F1B"], default="1F1B")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    net, dist = build(args.schedule, args.micro_batches)
    print("rank 0 runs:", " ".join(map(str, dist.schedule(0))))
    train_and_compare(net, dist, args.steps, "host", label=f"pp=2 {args.schedule} m={args.micro_batches}")


if __name__ == "__main__":
    main()
