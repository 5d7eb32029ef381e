"""The zoo MoE in real processes, host backend, losses and parameters after 3 SGD steps equal
serial (rtol 1e-5). Four processes: written Paddle's way (``experts="local"``: the router per rank
in ``autopar.local_map``, each expert on a sub-mesh of ``ep``) on ep4 and dp x ep, each rank
running only its own copy of the router and its own experts; and the stacked experts under
ep x pp (2 stages, 2 micro-batches, routing per micro-batch: ``Config(router_groups=4)``). Two
processes: the local and the stacked experts on ep2, and the stacked ones in a 2-stage pipeline
routing per micro-batch. One launch per process count, several configurations each."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.zoo import moe

    M = autopar.ProcessMesh
    pipelined = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    CASES = {
        4: [
            ("ep4 local", M([0, 1, 2, 3], ["ep"]), "local", moe.Config(), None),
            ("dp x ep local", M([[0, 1], [2, 3]], ["dp", "ep"]), "local", moe.Config(), None),
            ("pp x ep stacked", M([[0, 1], [2, 3]], ["pp", "ep"]), "stacked", moe.Config(router_groups=4), pipelined),
        ],
        2: [
            ("ep2 local", M([0, 1], ["ep"]), "local", moe.Config(), None),
            ("ep2 stacked", M([0, 1], ["ep"]), "stacked", moe.Config(), None),
            ("pp2 stacked", M([0, 1], ["pp"]), "stacked", moe.Config(router_groups=4), pipelined),
        ],
    }
    for name, mesh, experts, config, strategy in CASES[int(sys.argv[1])]:
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts=experts)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, moe.feeds(config, 4, 8, 3))
        print("RESULT", name, "equal", flush=True)
    """
)


@pytest.mark.parametrize("processes", [4, 2])
def test_the_zoo_moe_in_real_processes_equals_serial(tmp_path, processes):
    results = launch(SCRIPT, processes, tmp_path, args=[str(processes)])
    assert len(results) == 3 * processes, results
