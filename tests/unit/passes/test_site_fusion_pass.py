"""passes/site_fusion.py: the all_gathers one op needs of several values become one collective
of their flat buffer (stage: reshard-planned -> sites-planned at compile; comm-inserted ->
sites-fused per rank). (That the fused step equals serial: tests/equivalence/test_site_fusion.py.)"""

from pass_programs import around, assert_declared_emit_stage, op_names

from autopar.testing.models import three_columns


def test_three_gathers_read_by_one_concat_are_emitted_as_one():
    _, dist = three_columns(width=6)
    for rank in (0, 1):
        before, after = around(dist, "site_fusion", rank)
        assert [c for c, _ in before.collectives if c.kind == "all_gather"] == []  # left to this pass
        ((gather, position),) = after.collectives
        assert gather.kind == "all_gather" and gather.key.source == "site" and gather.group == (0, 1)
        assert gather.bytes == 3 * 4 * 6 * 4  # the three whole [4, 6] outputs, one buffer
        assert "3 all_gathers at one site fused into one buffer" in gather.reason and "pd_op.concat#" in gather.reason
        assert op_names(after)[position] == "pd_op.all_gather"
    assert_declared_emit_stage(dist, "site_fusion")


def test_uneven_pieces_keep_their_own_gathers_and_the_pass_changes_nothing():
    _, dist = three_columns(width=5)  # 5 columns over 2 ranks: 3 + 2, not equal blocks
    before, after = around(dist, "site_fusion")
    assert [(c.kind, c.key.source) for c, _ in after.collectives] == [("all_gather", "reshard")] * 3
    assert after.collectives == before.collectives and op_names(after) == op_names(before)
