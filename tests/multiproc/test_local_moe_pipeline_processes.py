"""The zoo MoE written Paddle's way (``experts="local"``: the router per rank in
``autopar.local_map``, each expert on ``split_mesh(mesh, "ep")[i]``) under a 2-stage pipeline in
4 real processes, ``pp x ep``, host backend: losses and parameters after 3 steps equal serial
(rtol 1e-5). Each rank runs its stage's copy of the router and its stage's experts only. Routing
per micro-batch with the opt-in (``Config(router_groups=4)``: 2 groups a copy, 2 micro-batches),
with it under ZeRO-1 and momentum, and one group a copy in one micro-batch (exact without it).
One launch, several configurations."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.zoo import moe

    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "ep"])

    def pipelined(micro_batches, zero_stage=0):
        return autopar.Strategy(zero_stage=zero_stage, pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2))

    CASES = [
        ("per micro-batch", moe.Config(router_groups=4), "sgd", pipelined(2)),
        ("per micro-batch, ZeRO-1", moe.Config(router_groups=4), "momentum", pipelined(2, zero_stage=1)),
        ("one micro-batch", moe.Config(), "sgd", pipelined(1)),
    ]
    for name, config, optimizer, strategy in CASES:
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local", optimizer=optimizer)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, moe.feeds(config, 4, 8, 3))
        print("RESULT", name, "equal", flush=True)
    """
)


def test_the_local_moe_under_pp_x_ep_in_4_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 4, tmp_path)
    assert len(results) == 3 * 4, results
