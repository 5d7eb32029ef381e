"""Pipeline parallelism in two real processes (host backend; send / recv over sockets):
an MLP pp=2 with m = 2, 3, 4 micro-batches for FThenB, 1F1B and ZB-H1, m = 2, 4 for interleaved
1F1B (two virtual stages per rank), Momentum and Adam; losses and
parameters after 3 steps equal serial (rtol 1e-5); the measured timeline of a step holds the
schedule's stash (1F1B: p, FThenB: m) and draws. Also two residual blocks cut inside the second
(its LayerNorm on stage 0, where ``PipelineConfig(stages=2)`` cut it: messages go 1 -> 0 -> 1 -> 0
within a backward, so the ranks send and receive them in different orders; FIFO links once
handed rank 1 the wrong micro-batch's tensor) under 1F1B and ZB-H1 with 2 and 4 micro-batches."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.pipeline_models import residual_cut_inside, staged_mlp
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    from autopar.schedule_timeline import render_svg

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    configs = [(s, m, o) for s in ("FThenB", "1F1B", "ZBH1") for m in (2, 3, 4) for o in ("momentum", "adam")]
    configs += [("Interleaved1F1B", m, o) for m in (2, 4) for o in ("momentum", "adam")]
    for schedule, micro_batches, optimizer in configs:
        placement = (0, 1, 0, 1) if schedule == "Interleaved1F1B" else None
        seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10), optimizer=optimizer, placement=placement)
        config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
        exe = train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=10))
        timeline = exe.timeline()  # the last step as it ran on both ranks
        if schedule in ("FThenB", "1F1B"):
            assert timeline.peak_stash[0] == (micro_batches if schedule == "FThenB" else min(2, micro_batches))
        assert str(timeline.spans[1][0].action) == "1F0" and 0 < timeline.bubble_fraction < 1
        assert "<svg" in render_svg(timeline)
        print("RESULT", schedule, micro_batches, optimizer, "equal", flush=True)

    for schedule, micro_batches in (("1F1B", 2), ("1F1B", 4), ("ZBH1", 2)):
        seed = residual_cut_inside(mesh)  # (its random_seed: the serial and distributed start-ups draw alike)
        config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=5))
        print("RESULT residual cut inside", schedule, micro_batches, "equal", flush=True)
    """
)


def test_pipeline_in_two_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path)
    assert len(results) == 2 * (22 + 3), results
