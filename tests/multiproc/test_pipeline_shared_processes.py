"""A tied word embedding across two pipeline stages in two real processes (host backend):
FThenB, 1F1B and ZB-H1 with 2 and 4 micro-batches, interleaved 1F1B with 2 and 4, SGD and
Momentum; losses and parameters after 3 steps equal serial (rtol 1e-5), and the two copies of
the tied weight (the embedding's stage, the head's stage) are bit-identical after each run
(``check_replicas``)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.pipeline_models import tied_lm
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    placements = {"FThenB": (0, 1, 1), "1F1B": (0, 1, 1), "ZBH1": (0, 1, 1), "Interleaved1F1B": (0, 1, 0, 1)}
    for schedule, placement in placements.items():
        for micro_batches in (2, 4):
            for optimizer in ("sgd", "momentum"):
                seed = tied_lm(mesh, placement, optimizer=optimizer, seed=5)  # (serial and ranks draw alike)
                config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
                dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
                exe = train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=10))
                exe.check_replicas()
                print("RESULT", schedule, micro_batches, optimizer, "equal", flush=True)
    """
)


def test_tied_embedding_in_two_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path)
    assert len(results) == 2 * 16, results
