"""The ported MoE (``autopar.testing.zoo.qwen2_moe``: PaddleNLP's Qwen2-MoE block, top-2 gating,
a shared expert) in real processes, host backend: losses and parameters after 3 SGD steps equal
serial (rtol 1e-5), each rank running only its own copy of the gate (``autopar.local_map``) and
its own experts (on its sub-mesh of ``ep``). Four processes: ep4, dp x ep, ep x mp, and ZeRO-1
with momentum on dp x ep. Two processes: ep2, dp, and the reference's one-device gate over the
whole batch on ep2 (``routing="whole_batch"``: its gathers and partial sums in real processes).
One launch per process count, several configurations each."""

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
    from autopar.testing.zoo import qwen2_moe

    M = autopar.ProcessMesh
    config = qwen2_moe.Config(num_hidden_layers=1)
    CASES = {
        4: [
            ("ep4", M([0, 1, 2, 3], ["ep"]), "sgd", None),
            ("dp x ep", M([[0, 1], [2, 3]], ["dp", "ep"]), "sgd", None),
            ("ep x mp", M([[0, 1], [2, 3]], ["ep", "mp"]), "sgd", None),
            ("dp x ep zero-1", M([[0, 1], [2, 3]], ["dp", "ep"]), "momentum", autopar.Strategy(zero_stage=1)),
        ],
        2: [
            ("ep2", M([0, 1], ["ep"]), "sgd", None),
            ("dp", M([0, 1], ["dp"]), "sgd", None),
            ("ep2 whole-batch gate", M([0, 1], ["ep"]), "sgd", None),
        ],
    }
    for name, mesh, optimizer, strategy in CASES[int(sys.argv[1])]:
        routing = "whole_batch" if "whole-batch" in name else "per_rank"
        seed = qwen2_moe.build(config, batch=4, seq=8, mesh=mesh, optimizer=optimizer, routing=routing)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, qwen2_moe.feeds(config, 4, 8, 3))
        print("RESULT", name, "equal", flush=True)
    """
)


@pytest.mark.parametrize(("processes", "cases"), [(4, 4), (2, 3)])
def test_the_ported_moe_in_real_processes_equals_serial(tmp_path, processes, cases):
    results = launch(SCRIPT, processes, tmp_path, args=[str(processes)])
    assert len(results) == cases * processes, results
