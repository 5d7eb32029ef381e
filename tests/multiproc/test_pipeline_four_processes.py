"""Pipeline with data or tensor parallelism inside the stages on 4 real processes (host
backend): pp=2 x dp=2 and pp=2 x mp=2, 3 micro-batches, equal to serial after 3 steps. A stage's
collectives run among its own ranks over the p2p links (the world exchange cannot serve them
while the other stage runs other jobs)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings; warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.pipeline_models import staged_mlp
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    for mode in ("dp", "mp"):
        mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", mode])
        seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10))
        if mode == "dp":
            autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
        else:
            for name, stage, mapping in (("linear1", 0, [None, "mp"]), ("linear2", 0, ["mp", None]), ("linear3", 1, [None, "mp"]), ("linear4", 1, ["mp", None])):
                autopar.shard_tensor(seed.layers[name].weight, mesh[stage], mapping)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=3)))
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=10))
        print("RESULT pp x", mode, "equal", flush=True)
    """
)


def test_pipeline_with_dp_or_mp_inside_stages_on_four_processes(tmp_path):
    results = launch(SCRIPT, 4, tmp_path, timeout=400)
    assert len(results) == 4 * 2, results
