"""Global-norm clipping inside a pipeline (``ClipGradByGlobalNorm`` given to the optimizer):
equal to serial, and the norms cross each stage pair once per step (simulator).

Each stage adds the squared norms of its own gradients before they are stacked
(:mod:`autopar.rewrites.stage_norms`): stage 0 sends one partial sum to the stage making the
clip factor, which sends the factor back, whatever the number of parameters and micro-batches
(it sent one scalar per parameter before: 4 sends per step on this 2-stage MLP).
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds, run_serial

CLIP = 1e-2  # far below the global gradient norm of these models: the clip scales every step
PP = autopar.ProcessMesh([0, 1], ["pp"])
PP_DP = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
PP_MP = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])


def _seed(mesh: autopar.ProcessMesh):
    """A 2-stage MLP with clipping; pp x dp splits the batch, pp x mp each stage's pair of
    Linears (column- then row-parallel)."""
    if "mp" not in mesh.dim_names:
        seed = staged_mlp(mesh, clip=CLIP)
        if "dp" in mesh.dim_names:
            autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
        return seed
    seed = staged_mlp(mesh, widths=(16, 32, 16, 32, 10), clip=CLIP)
    for name, stage, mapping in (("linear1", 0, [None, "mp"]), ("linear2", 0, ["mp", None]),
                                 ("linear3", 1, [None, "mp"]), ("linear4", 1, ["mp", None])):  # fmt: skip
        autopar.shard_tensor(seed.layers[name].weight, mesh[stage], mapping)
    return seed


def _global_norms(seed, feeds) -> list[float]:
    """The serial program's global gradient norm (the clip's ``sqrt``) at each step."""
    norm = next(op for op in seed.main.global_block().ops if op.name() == "pd_op.sqrt").result(0)
    return [
        float(np.asarray(step[0]).reshape(-1)[0]) for step in run_serial(seed.main, seed.startup, feeds, [norm]).fetches
    ]


def clip_transfers(dist: autopar.DistributedProgram, rank: int) -> list[str]:
    """The send / recv of global-norm clipping rank ``rank`` runs per step, as ``send[0, 1]``."""
    return [
        f"{c.kind}{list(c.group)}" for c in dist.comm_ops(rank)
        if c.kind.value in ("send", "recv") and c.reason.startswith("global-norm clipping")
    ]  # fmt: skip


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
@pytest.mark.parametrize("mesh", [PP_DP, PP_MP], ids=["pp_dp", "pp_mp"])
def test_clipped_pipeline_equals_serial_with_one_transfer_each_way(mesh, schedule, micro_batches):
    seed = _seed(mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    first, last = mesh[0].ranks, mesh[1].ranks
    for a, b in zip(first, last):  # the partial sum of the squared norms forward, the clip factor back
        assert clip_transfers(dist, a) == [f"send[{a}, {b}]", f"recv[{b}, {a}]"], [str(c) for c in dist.comm_ops(a)]
        assert clip_transfers(dist, b) == [f"recv[{a}, {b}]", f"send[{b}, {a}]"], [str(c) for c in dist.comm_ops(b)]
    assert any("summed per stage first" in text for _, text in dist.decisions.rewrites()), dist.decisions.rewrites()
    feeds = random_feeds(seed.feeds, 3)
    assert min(_global_norms(seed, feeds)) > 10 * CLIP  # the clip scales: a wrong norm cannot pass
    assert_simulation_equals_serial(seed, dist, feeds=feeds)


def test_every_stage_sends_one_partial_sum_on_four_stages():
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["pp"])
    seed = staged_mlp(mesh, widths=(8, 16, 16, 16, 10), stages=4, clip=CLIP)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                           strategy=autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2)))  # fmt: skip
    sends = {rank: sorted(t for t in clip_transfers(dist, rank) if t.startswith("send")) for rank in mesh.ranks}
    assert sends == {
        0: ["send[0, 3]"],
        1: ["send[1, 3]"],
        2: ["send[2, 3]"],
        3: ["send[3, 0]", "send[3, 1]", "send[3, 2]"],
    }, sends
    assert_simulation_equals_serial(seed, dist)
