"""The zoo MoE written Paddle's way (``experts="local"``: the router per rank in
``autopar.local_map``, each expert on a sub-mesh of ``ep``) in 4 real processes, host backend:
ep4 and dp x ep, losses and parameters after 3 SGD steps equal serial (rtol 1e-5). Each rank
runs only its own copy of the router and its own experts."""

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

    M = autopar.ProcessMesh
    config = moe.Config()
    for name, mesh in [("ep4", M([0, 1, 2, 3], ["ep"])), ("dp x ep", M([[0, 1], [2, 3]], ["dp", "ep"]))]:
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts="local")
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, moe.feeds(config, 4, 8, 3))
        print("RESULT", name, "equal", flush=True)
    """
)


def test_the_local_moe_in_four_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 4, tmp_path)
    assert len(results) == 2 * 4, results
