"""The zoo MoE in real processes, host backend, losses and parameters after 3 steps equal serial
(rtol 1e-5), both ways of writing the experts: Paddle's (``experts="local"``: the router per rank
in ``autopar.local_map``, each expert on a sub-mesh of ``ep``, each rank running only its own copy
of the router and its own experts) and stacked (GSPMD's: the experts' weights split by expert over
``ep``; ``Config(router_groups=g)`` routes per group of the batch's split).

Four processes: ep4, dp x ep and ep x mp (Megatron's tensor-parallel attention beside the
experts) both ways; ZeRO-1 with momentum on dp x ep both ways (an expert's states sharded over
its holders); ZeRO-1 with AdamW on the local dp x ep against serial training's own fp32 floor
(every parameter within twice what reordering the batch's groups moves it, at least 1e-5); the stacked experts
under ep x pp (2 stages, 2 micro-batches, routing per micro-batch). Two processes: dp (stacked:
the local experts need an ep dim), ep2 both ways, ZeRO-1 with momentum on the local ep2, and the
stacked experts in a 2-stage pipeline routing per micro-batch. One launch per process count,
several configurations each; one MoE layer but under a pipeline (a layer a stage)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings
    warnings.filterwarnings("ignore")
    import paddle
    import autopar
    from autopar.testing.processes import reordered_floor, train_equals_serial
    from autopar.testing.zoo import moe

    M = autopar.ProcessMesh
    S = autopar.Strategy
    pipelined = S(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    one = moe.Config(n_layers=1)
    DP_EP, EP_MP = M([[0, 1], [2, 3]], ["dp", "ep"]), M([[0, 1], [2, 3]], ["ep", "mp"])
    # (name, mesh, experts, config, strategy, optimizer)
    CASES = {
        4: [
            ("ep4 local", M([0, 1, 2, 3], ["ep"]), "local", one, None, "sgd"),
            ("ep4 stacked", M([0, 1, 2, 3], ["ep"]), "stacked", moe.Config(n_layers=1, router_groups=4), None, "sgd"),
            ("dp x ep local", DP_EP, "local", one, None, "sgd"),
            ("dp x ep stacked", DP_EP, "stacked", moe.Config(n_layers=1, router_groups=4), None, "sgd"),
            ("ep x mp local", EP_MP, "local", one, None, "sgd"),
            ("ep x mp stacked", EP_MP, "stacked", moe.Config(n_layers=1, router_groups=2), None, "sgd"),
            ("dp x ep local zero1", DP_EP, "local", one, S(zero_stage=1), "momentum"),
            ("dp x ep stacked zero1", DP_EP, "stacked", moe.Config(n_layers=1, router_groups=4), S(zero_stage=1), "momentum"),
            ("dp x ep local zero1 adamw", DP_EP, "local", one, S(zero_stage=1), "adamw"),
            ("pp x ep stacked", M([[0, 1], [2, 3]], ["pp", "ep"]), "stacked", moe.Config(router_groups=4), pipelined, "sgd"),
        ],
        2: [
            ("dp stacked", M([0, 1], ["dp"]), "stacked", one, None, "sgd"),
            ("ep2 local", M([0, 1], ["ep"]), "local", one, None, "sgd"),
            ("ep2 stacked", M([0, 1], ["ep"]), "stacked", one, None, "sgd"),
            ("ep2 local zero1", M([0, 1], ["ep"]), "local", one, S(zero_stage=1), "momentum"),
            ("pp2 stacked", M([0, 1], ["pp"]), "stacked", moe.Config(router_groups=4), pipelined, "sgd"),
        ],
    }
    for name, mesh, experts, config, strategy, optimizer in CASES[int(sys.argv[1])]:
        with paddle.utils.unique_name.guard():
            seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts=experts, optimizer=optimizer)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        feeds = moe.feeds(config, 4, 8, 3)
        if optimizer == "adamw":  # within twice the floor of serial training (the batch's 4 groups, a row each, reordered), at least 1e-5
            floor = reordered_floor(seed.main, seed.startup, seed.loss, feeds, rows=[2, 0, 3, 1])
            train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds, atol=1e-5, floor=floor)
        else:
            train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds)
        print("RESULT", name, "equal", flush=True)
    """
)
CONFIGURATIONS = {4: 10, 2: 5}


@pytest.mark.parametrize("processes", [4, 2])
def test_the_zoo_moe_in_real_processes_equals_serial(tmp_path, processes):
    results = launch(SCRIPT, processes, tmp_path, args=[str(processes)])
    assert len(results) == CONFIGURATIONS[processes] * processes, results
