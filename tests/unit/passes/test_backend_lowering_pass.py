"""passes/backend_lowering.py: for the native backend, collectives Paddle lacks become ones it has
(stage: comm-inserted -> lowered). The host form keeps one op per planned collective."""

from pass_programs import around, count, data_parallel, op_names


def test_a_reduce_scatter_becomes_an_all_reduce_and_this_ranks_slice_on_native_only():
    _, dist = data_parallel(zero_stage=2, fuse_allreduce=False)  # six gradient reduce_scatters
    before, after = around(dist, "backend_lowering", backend="native")
    assert count(before, "pd_op.reduce_scatter") == 6 and count(after, "pd_op.reduce_scatter") == 0
    assert count(after, "pd_op.all_reduce") == count(before, "pd_op.all_reduce") + 6
    assert count(after, "pd_op.slice") == count(before, "pd_op.slice") + 6
    names = op_names(after)
    scattered = [(c, position) for c, position in after.collectives if c.kind == "reduce_scatter"]
    assert len(scattered) == 6  # the values stay as planned; their op is now the slice ending the lowering
    for _, position in scattered:  # all_reduce, the slice's bounds, the slice
        assert names[position] == "pd_op.slice" and "pd_op.all_reduce" in names[position - 3 : position]
    assert after.stages[-1] == "lowered" and after.backend == "native"


def test_the_host_form_is_left_as_emitted():
    _, dist = data_parallel(zero_stage=2, fuse_allreduce=False)
    before, after = around(dist, "backend_lowering", backend="host")
    assert op_names(after) == op_names(before) and count(after, "pd_op.reduce_scatter") == 6
    assert after.collectives == before.collectives
