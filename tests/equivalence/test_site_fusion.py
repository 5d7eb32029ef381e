"""Site fusion: the all_gathers one op reads are one collective (passes/site_fusion.py).

Three column-parallel linears concatenated along their split dim: ``concat`` reads the three
outputs whole, so each would be gathered on its own; fused, one all_gather carries the three
(the same bytes), and the step equals serial. Pieces that are not equal blocks (an uneven
split) keep their own gathers."""

import pytest

import autopar
from autopar.pricing import added_ops
from autopar.testing.models import three_columns
from autopar.testing.serial import assert_simulation_equals_serial


@pytest.mark.parametrize("width, fused", [(6, True), (5, False)], ids=["even", "uneven"])
def test_gathers_read_by_one_op_are_one_collective(width, fused):
    seed, dist = three_columns(width)
    for rank in (0, 1):
        gathers = [c for c in dist.comm_ops(rank) if c.kind == "all_gather"]
        if fused:
            (gather,) = gathers
            assert gather.key.source == "site" and gather.bytes == 3 * 4 * width * 4  # the three whole outputs
            assert "pd_op.concat#" in gather.reason and "3 all_gathers at one site fused into one buffer" in gather.reason
            assert gather.time > 0
        else:
            assert len(gathers) == 3 and not [c for c in gathers if c.key.source == "site"]
        added = len(dist.rank_program(rank).global_block().ops) - len(seed.main.global_block().ops)
        assert sum(added_ops(dist.state, rank)) == added  # what suggest's pricing counts
    assert_simulation_equals_serial(seed, dist)


def test_a_valid_token_mean_all_reduces_its_sum_and_count_in_one():
    """GPT-2 on dp2: the loss averaged over the valid tokens divides two pending sums (the
    token losses', the count's): one all_reduce of the two, then the gradient bucket — two
    collectives a step, the loss fetched, equal serial."""
    from autopar.testing.zoo import gpt2

    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    config = gpt2.Config()
    seed = gpt2.build(config, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    for rank in mesh.ranks:
        comms = [c for c, _ in dist.rank_plan(rank, fetches=[seed.loss]).collectives]
        assert [(c.kind.value, c.key.source) for c in comms] == [("all_reduce", "site"), ("all_reduce", "bucket")]
        assert comms[0].bytes == 8 and "pd_op.divide#" in comms[0].reason and "2 all_reduces at one site" in comms[0].reason
    assert_simulation_equals_serial(seed, dist, feeds=gpt2.feeds(config, 4, 8, 3))
