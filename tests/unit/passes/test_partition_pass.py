"""passes/partition.py: a rank's program with local shapes, the serial program untouched
(stage: propagated -> partitioned)."""

from pass_programs import data_parallel, data_shapes, megatron_mlp, op_names, parameter_shapes


def test_feeds_and_parameters_take_their_local_shapes_and_nothing_is_communicated():
    seed, dist = megatron_mlp()
    plan = dist.rank_plan(0, after="partition")
    assert dist.passes.names()[0] == "partition"
    assert plan.stages == ("propagated", "partitioned") and plan.collectives == ()
    assert data_shapes(plan.program)["x"] == [4, 16]  # x is replicated over mp
    local, serial = parameter_shapes(plan.program), parameter_shapes(seed.main)
    fc1, fc2 = seed.layers["fc1"], seed.layers["fc2"]
    assert local[fc1.weight.name] == [16, 32] and local[fc1.bias.name] == [32]  # columns split over mp = 2
    assert local[fc2.weight.name] == [32, 16] and local[fc2.bias.name] == [16]  # rows split; the bias whole
    assert serial[fc1.weight.name] == [16, 64]  # the serial program is cloned, never modified


def test_an_uneven_batch_gives_each_rank_its_own_rows():
    seed, dist = data_parallel(world=3, batch=7)
    rows = [data_shapes(dist.rank_plan(rank, after="partition").program)["x"][0] for rank in range(3)]
    assert rows == [dist.local_shape("x", rank)[0] for rank in range(3)] and sorted(rows) == [2, 2, 3]
    assert data_shapes(seed.main)["x"] == [7, 16]


def test_a_mean_over_split_rows_is_scaled_to_its_share_right_after_it():
    """The local ``mean`` divides by the rank's rows: partition applies the rule's local scale
    after it (and after its gradient), and later readers read the scaled value."""
    seed, dist = data_parallel(world=3, batch=7)
    serial = [op.name() for op in seed.main.global_block().ops]
    plan = dist.rank_plan(0, after="partition")
    names = op_names(plan)
    assert names.count("pd_op.scale") == serial.count("pd_op.scale") + 2 == len(plan.replaced)
    for (op_index, _), (position, _) in plan.replaced.items():
        assert names[position] == "pd_op.scale" and position > plan.op_positions[op_index]
        assert serial[op_index] in ("pd_op.mean", "pd_op.mean_grad")
