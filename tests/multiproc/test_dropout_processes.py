"""Training dropout in a real 2-process pipeline (host backend; send / recv over sockets): the
zoo's GPT-2 with dropout 0.1 on a 2-stage 1F1B pipeline with 2 micro-batches, each micro-batch
applying its rows of the serial mask (its number fed per micro-batch); losses and parameters
after 3 steps equal serial (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import os
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.zoo import gpt2

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    config = gpt2.Config(dropout=0.1)
    seed = gpt2.build(config, batch=4, seq=8, mesh=mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, schedule="1F1B"))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    train_equals_serial(dist, seed.main, seed.startup, seed.loss, gpt2.feeds(config, 4, 8, 3))
    print("RESULT ok", os.environ["PADDLE_TRAINER_ID"], flush=True)
    """
)


def test_gpt2_with_dropout_on_a_two_process_pipeline_equals_serial(tmp_path):
    lines = launch(SCRIPT, 2, tmp_path)
    assert sorted(line.split("RESULT ")[1] for line in lines) == ["ok 0", "ok 1"]
