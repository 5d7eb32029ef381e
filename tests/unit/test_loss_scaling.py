"""Dynamic loss scaling compiles, and found_inf is agreed by every rank holding a different piece
of the gradients (issue 38 item 2), checked on the compiled programs.

The rules (autopar/spmd/loss_scaling.py) make found_inf a pending max over the mesh dims the
checked gradients are split or pending over; the planner resolves it into one
``all_reduce(max)`` over exactly those dims before update_loss_scaling_ reads it, and a mesh
whose gradients are whole and identical gets none. In a pipeline each stage checks its own
gradients and the stages agree at a SYNC point (passes/pipeline_split.py).
"""

from __future__ import annotations

import pytest

import autopar
from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh
from autopar.pipeline_lowering import SYNC
from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing.overflow import probed_mlp

MP = ProcessMesh([0, 1], ["mp"])
DP_MP = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def _spec(mesh: ProcessMesh, shape: tuple[int, ...], mapping: list[int], partial: dict | None = None) -> TensorSpec:
    return TensorSpec(shape, DistAttr(mesh, mapping, partial))


def test_found_inf_is_a_pending_max_over_the_dims_the_gradients_are_split_or_pending_over():
    rule, ctx = get_rule("pd_op.check_finite_and_unscale_"), RuleContext(DP_MP)
    column = _spec(DP_MP, (8, 16), [-1, 1])  # split over mp
    pending = _spec(DP_MP, (16,), [-1], {0: "sum"})  # a data-parallel gradient before its sum
    whole = _spec(DP_MP, (4,), [-1])
    scale = _spec(DP_MP, (1,), [-1])
    result = rule.infer_forward([column, pending, whole, scale], {}, ctx)
    assert result.outputs[:3] == (column.dist, pending.dist, whole.dist)  # each gradient keeps its placement
    assert result.outputs[3].partial_dims == {0: "max", 1: "max"} and not result.outputs[3].sharded_mesh_dims()
    only_mp = rule.infer_forward([column, whole, scale], {}, ctx).outputs[-1]
    assert only_mp.partial_dims == {1: "max"}
    assert rule.infer_forward([whole, scale], {}, ctx).outputs[-1].is_replicated  # whole gradients: whole flag


def test_update_loss_scaling_reads_the_flag_whole_and_keeps_the_gradients_as_they_lie():
    rule, ctx = get_rule("pd_op.update_loss_scaling_"), RuleContext(MP)
    grad = _spec(MP, (8, 16), [-1, 0])
    flag = _spec(MP, (1,), [-1], {0: "max"})
    states = [_spec(MP, (1,), [-1]) for _ in range(4)]  # scale, good, bad, stop_update
    result = rule.infer_forward([grad, flag, *states], {}, ctx)
    assert result.inputs[0] == grad.dist and result.outputs[0] == grad.dist
    assert result.inputs[1].is_replicated  # the planner reduces the pending max before the read
    assert all(d.is_replicated for d in result.outputs[1:])


def _compiled(mesh: ProcessMesh, strategy: autopar.Strategy | None = None, **kw):
    seed = probed_mlp(**kw)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    if "mp" in mesh.dim_names:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def _max_reductions(dist, rank: int) -> list:
    return [c for c in dist.comm_ops(rank) if c.kind == "all_reduce" and c.reduce == "max"]


def _ops(dist, rank: int, name: str) -> list:
    return [op for op in dist.rank_plan(rank).program.global_block().ops if op.name() == name]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_tensor_parallel_gradients_agree_on_found_inf_over_mp(optimizer):
    dist = _compiled(MP, optimizer=optimizer)
    assert not dist.report.unsupported_ops
    for rank in MP.ranks:
        (flag,) = _max_reductions(dist, rank)
        assert flag.group == (0, 1) and flag.dtype == "bool" and flag.bytes == 1, str(flag)
        assert "found_inf" in flag.reason
        (reduce,) = [op for op in _ops(dist, rank, "pd_op.all_reduce") if op.attrs()["reduce_type"] == 1]  # max
        (check,) = _ops(dist, rank, "pd_op.check_finite_and_unscale_")
        assert reduce.operand_source(0).is_same(check.result(1))  # the check's own flag, before anyone reads it
        (update,) = _ops(dist, rank, "pd_op.update_loss_scaling_")
        assert update.operand_source(1).is_same(reduce.result(0))


def test_dp_x_mp_agrees_over_both_dims():
    dist = _compiled(DP_MP)
    for rank in DP_MP.ranks:
        (flag,) = _max_reductions(dist, rank)
        assert flag.group == (0, 1, 2, 3), str(flag)  # pending over dp (partial gradients) and mp (split ones)


def test_whole_identical_gradients_need_no_agreement():
    """Nothing annotated on a 2-rank mesh: every rank holds every gradient whole and alike."""
    dist = _compiled(ProcessMesh([0, 1], ["x"]))
    assert dist.comm_ops(0) == [] and dist.comm_ops(1) == []


def test_zero2_reduce_scatters_the_checked_gradients():
    """The optimizer and ZeRO's reduce_scatter read update_loss_scaling_'s results, not the values
    the in-place ops update (autopar/rewrites/loss_scaling.py): without it the check all-gathered
    its own copies of the gradient shards and the update stepped on gradients never unscaled."""
    dist = _compiled(ProcessMesh([0, 1], ["dp"]), autopar.Strategy(zero_stage=2))
    kinds = sorted(c.kind for c in dist.comm_ops(0))
    assert kinds == ["all_gather", "all_reduce", "reduce_scatter"], [str(c) for c in dist.comm_ops(0)]
    ops = list(dist.rank_plan(0).program.global_block().ops)
    position = {op.id(): i for i, op in enumerate(ops)}
    (update,) = _ops(dist, 0, "pd_op.update_loss_scaling_")
    (scatter,) = _ops(dist, 0, "pd_op.reduce_scatter")
    assert position[update.id()] < position[scatter.id()]


def test_the_rewrite_moves_reads_onto_the_scaling_results_and_leaves_the_users_program():
    from autopar.rewrites.loss_scaling import loss_scaling_results

    seed = probed_mlp()
    before = str(seed.main)
    rewired = loss_scaling_results(seed.main)
    assert str(seed.main) == before
    ops = list(rewired.program.global_block().ops)
    for update in (op for op in ops if op.name() == "pd_op.adamw_"):
        made_by = update.operand_source(1).get_defining_op()  # the gradient
        assert made_by.name() == "builtin.split"
        assert made_by.operand_source(0).get_defining_op().name() == "pd_op.update_loss_scaling_"
    (update,) = [op for op in ops if op.name() == "pd_op.update_loss_scaling_"]
    members = update.operand_source(0).get_defining_op()
    assert {members.operand_source(i).get_defining_op().operand_source(0).get_defining_op().name() for i in range(4)} == {
        "pd_op.check_finite_and_unscale_"
    }
    assert rewired.rewired == 4 + 2 * 4  # update_loss_scaling_ reads 4 checked gradients; each adamw_ read moves twice


def test_a_pipeline_checks_each_stage_and_agrees_at_a_sync_point():
    mesh = ProcessMesh([0, 1], ["pp"])
    seed = probed_mlp(stages=mesh)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    for rank in mesh.ranks:
        (check,) = _ops(dist, rank, "pd_op.check_finite_and_unscale_")
        assert check.operand_source(0).get_defining_op().num_operands() == 2  # its stage's weight and bias
        transfers = [c for c in dist.comm_ops(rank) if c.kind in ("send", "recv")]
        assert all(c.dtype != "bool" and "grad" not in c.value for c in transfers), [str(c) for c in transfers]
        (sync,) = _max_reductions(dist, rank)
        assert sync.group == (0, 1) and sync.key.source == "sync", str(sync)
        role = dist.rank_plan(rank).pipeline
        syncs = [a for a in role.steps if a.kind is SYNC]
        assert len(syncs) == 1
        (update,) = _ops(dist, rank, "pd_op.update_loss_scaling_")
        ops = list(dist.rank_plan(rank).program.global_block().ops)
        position = {op.id(): i for i, op in enumerate(ops)}
        update_piece = next(i for i, piece in enumerate(role.pieces) if position[update.id()] in piece.ops)
        order = [a.piece for a in role.steps]
        assert order.index(syncs[0].piece) < order.index(update_piece)  # agreed before any stage updates


def test_pipeline_x_dp_agrees_within_each_stage_then_over_the_stages():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    seed = probed_mlp(stages=mesh)
    autopar.shard_tensor(seed.feeds["x"], mesh[0], ["dp", None])
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    groups = {rank: sorted(c.group for c in _max_reductions(dist, rank)) for rank in mesh.ranks}
    assert groups == {0: [(0, 1), (0, 2)], 1: [(0, 1), (1, 3)], 2: [(0, 2), (2, 3)], 3: [(1, 3), (2, 3)]}


def test_a_pipeline_stage_without_gradients_is_refused_by_name():
    """Stage 1 holds only the loss: it would check nothing and move no copy of the loss scale
    (which its forward reads), and never reach the SYNC the other stage waits in."""
    import paddle

    from autopar.testing.overflow import minimize_scaled

    paddle.enable_static()
    mesh = ProcessMesh([0, 1], ["pp"])
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x, label = paddle.static.data("x", [4, 8], "float32"), paddle.static.data("label", [4, 1], "int64")
        linear = paddle.nn.Linear(8, 4)
        opt = paddle.optimizer.AdamW(0.05, parameters=linear.parameters(), multi_precision=True)
        _, opt = paddle.amp.decorate(models=linear, optimizers=opt, level="O1", dtype="bfloat16")
        h = autopar.shard_op(linear, mesh[0])(x)
        loss = autopar.shard_op(lambda t: paddle.mean(paddle.nn.functional.cross_entropy(t, label)), mesh[1])(h)
        minimize_scaled(opt, loss)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=1))
    with pytest.raises(autopar.AutoparError, match=r"needs a gradient on every stage: the stage\(s\) on mesh\(pp=1\)\[1\] hold none"):
        autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
