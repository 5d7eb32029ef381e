"""Gradient accumulation (``PipelineConfig(stages=1)``) in two real processes on the host
backend: dp=2 with m = 2 and 4 micro-batches, 1F1B and ZB-H1, ZeRO 0 and 2, Momentum and Adam;
losses and parameters after 3 steps equal serial (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    for schedule in ("1F1B", "ZBH1"):
        for micro_batches in (2, 4):
            for zero, optimizer in ((0, "momentum"), (2, "adam")):
                seed = simple_net(batch=8, sizes=(16, 32, 16, 10), optimizer=optimizer)
                autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
                config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule, stages=1)
                strategy = autopar.Strategy(zero_stage=zero, pipeline=config)
                dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
                train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=10))
                print("RESULT", schedule, micro_batches, zero, optimizer, "equal", flush=True)
    """
)


def test_gradient_accumulation_in_two_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path)
    assert len(results) == 2 * 8, results
