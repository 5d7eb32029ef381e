"""The per-rank contract: rank plans built lazily from planned values, the runtime reading
nothing else, a declared and printable pass pipeline, and the Strategy refusing what no pass
implements."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import paddle
import pytest

import autopar
from autopar.collective import Collective, CollectiveKind
from autopar.errors import AutoparError, NativeUnsupported
from autopar.rewrites import Rewrite
from autopar.testing.models import simple_net

RUNTIME = Path(autopar.__file__).parent / "runtime"
COMPILER_MODULES = ("autopar.passes", "autopar.propagation", "autopar.compile", "autopar.graph",
                    "autopar.distributed_program", "autopar.spmd", "autopar.cost_model")  # fmt: skip


def _compile(mesh, dp="dp", mp=None, **strategy):
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, [dp, None])
    if mp:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, mp])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, [mp, None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))


def test_runtime_imports_no_compiler_module():
    offenders = []
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(COMPILER_MODULES)]
    assert not offenders, offenders


def test_rank_plans_are_built_lazily_one_rank_at_a_time():
    built = []
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                           callback=lambda p, state, rp: built.append((p.name, None if rp is None else rp.rank)))  # fmt: skip
    assert all(rank is None for _, rank in built), "compile built a rank program"
    plan = dist.rank_plan(3)
    assert {rank for _, rank in built if rank is not None} == {3}
    assert dist.rank_plan(3) is plan  # cached
    assert plan.rank == 3 and plan.backend == "host" and plan.stages[-1] == "lowered"


def test_plan_jobs_alternate_compute_and_collective_values():
    _, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]))
    plan = dist.rank_plan(0)
    collectives = [job for job in plan.jobs if isinstance(job, Collective)]
    assert collectives == [c for c, _ in plan.collectives] == dist.comm_ops(0)
    (fused,) = collectives  # SimpleNet dp: one bucket of six gradients
    assert fused.kind is CollectiveKind.ALL_REDUCE and fused.group == (0, 1) and fused.key.source == "bucket"
    assert dist.rank_plan(1).collectives[0][0].key == fused.key  # the same key on every member


def test_every_rank_computes_the_same_ring_for_a_group():
    _, dist = _compile(autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), mp="mp", fuse_allreduce=False)
    rings: dict = {}
    for rank in range(4):
        for group, ring in dist.rank_plan(rank).rings.items():
            assert rings.setdefault(group, ring) == ring
    assert len(set(rings.values())) == len(rings)  # distinct groups, distinct rings


def test_passes_are_declared_and_printable():
    _, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]), allreduce_bucket_mb=1.0)
    text = str(dist.passes)
    assert dist.passes.names() == [
        "partition", "reshard_planning", "reshard_emission", "site_fusion", "allreduce_fusion", "op_lowering",
        "fetch_replication", "backend_lowering",
    ]
    assert "allreduce_fusion(bucket_bytes=1048576)" in text
    _, unfused = _compile(autopar.ProcessMesh([0, 1], ["dp"]), fuse_allreduce=False)
    assert "allreduce_fusion" not in unfused.passes.names()


def test_rank_program_after_a_named_pass(tmp_path):
    _, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]))
    after_partition = dist.rank_plan(0, after="partition")
    assert after_partition.collectives == () and after_partition.stages == ("propagated", "partitioned")
    # the six gradient all-reduces were planned into one bucket: the fusion pass emits them
    assert dist.rank_plan(0, after="reshard_emission").collectives == ()
    assert len(dist.rank_plan(0, after="allreduce_fusion").collectives) == 1
    _, unfused = _compile(autopar.ProcessMesh([0, 1], ["dp"]), fuse_allreduce=False)
    result = unfused.dump_diff(tmp_path, ranks=[0], svg=False, after="reshard_emission")
    text = result.diffs[0].read_text()
    assert result.diffs[0].name == "rank0.after-reshard_emission.diff" and "after reshard_emission" in text
    assert text.count("= all_reduce(") == 6
    with pytest.raises(AutoparError, match="no pass named 'fusion'"):
        dist.rank_plan(0, after="fusion")


def test_native_form_is_lowered_and_host_form_is_not():
    _, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]), fuse_allreduce=False)
    assert dist.collectives_span_world
    assert dist.rank_plan(0, "auto").backend == "native"
    _, dp_mp = _compile(autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), mp="mp")
    assert not dp_mp.collectives_span_world and dp_mp.rank_plan(0, "auto").backend == "host"
    with pytest.raises(AutoparError, match="unknown backend"):
        dist.rank_plan(0, "nccl")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"recompute": ("sofmax",)}, "Strategy.recompute: 'sofmax' match\\(es\\) no forward op type or layer path"),
        ({"sequence_parallel": True}, "Strategy.sequence_parallel=True"),
        ({"pipeline": autopar.PipelineConfig(micro_batches=2)}, "Strategy.pipeline: the program has no stages"),
        ({"extra": {"overlap": True}}, "Strategy.extra: no pass reads the options \\['overlap'\\]"),
    ],
)
def test_unimplemented_strategy_fields_are_refused_by_name(fields, match):
    with pytest.raises(AutoparError, match=match):
        _compile(autopar.ProcessMesh([0, 1], ["dp"]), **fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"zero_stage": "1"}, "zero_stage must be 0, 1, 2 or 3"),
        ({"zero_stage": True}, "zero_stage must be 0, 1, 2 or 3"),
        ({"recompute": 1}, "recompute must be False, True, or a tuple of op types / layer paths"),
        ({"allreduce_bucket_mb": float("nan")}, "allreduce_bucket_mb must be a finite number"),
        ({"allreduce_bucket_mb": "32"}, "allreduce_bucket_mb must be a number"),
        ({"pipeline": {"micro_batches": 2}}, "pipeline must be an autopar.PipelineConfig"),
        ({"cluster": 3}, "cluster must be a cluster profile"),
    ],
)
def test_strategy_fields_are_type_checked(fields, match):
    with pytest.raises(AutoparError, match=match):
        autopar.Strategy(**fields)
    with pytest.raises(AutoparError, match="micro_batches must be an int"):
        autopar.PipelineConfig(micro_batches=2.0)


def test_compile_refuses_a_strategy_that_is_not_one():
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    with pytest.raises(AutoparError, match="strategy must be an autopar.Strategy, got dict"):
        autopar.compile(seed.main, autopar.ProcessMesh([0, 1]), strategy={"zero_stage": 1})


def test_feed_slicing_and_checks_come_from_the_plan():
    seed, dist = _compile(autopar.ProcessMesh([0, 1], ["dp"]))
    plan = dist.rank_plan(1)
    x = np.arange(8 * 16, dtype="float32").reshape(8, 16)
    np.testing.assert_array_equal(plan.local_feeds({"x": x})["x"], x[4:])
    with pytest.raises(AutoparError, match="'y' is not a feed"):
        plan.local_feeds({"y": x})
    with pytest.raises(AutoparError, match="feed 'x' has shape \\[4, 16\\]"):
        plan.local_feeds({"x": x[:4]})


def test_shard_tensor_takes_autopar_placements():
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    autopar.shard_tensor(seed.feeds["x"], mesh, [autopar.Shard(0), autopar.Replicate()])
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [autopar.Replicate(), autopar.Shard(1)])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert str(dist.dist_attr("x")) == "[S(0),R]"
    assert str(dist.dist_attr(seed.layers["linear1"].weight)) == "[R,S(1)]"


@dataclasses.dataclass(frozen=True)
class _ShardBatch(Rewrite):
    """A stand-in for a strategy rewrite (sequence parallelism) that asks for a placement."""

    dims: tuple = (0, -1)
    name = "shard_batch"

    def apply(self, work):
        key = work.graph.by_name["x"]
        return work.reported(self, "", made=work.annotated(self, {key: autopar.DistAttr(work.mesh, list(self.dims))}))


def _analysed(seed, mesh, *rewrites):
    from autopar.analysis import _op_meshes, _user_placements
    from autopar.cost_model.cluster import default_cluster
    from autopar.graph import ProgramGraph
    from autopar.rewrites import Analysed, apply_all

    graph = ProgramGraph(seed.main)
    start = Analysed(seed.main, graph, mesh, default_cluster().fitted(mesh.ranks), _user_placements(seed.main, graph, mesh),
                     _op_meshes(seed.main, graph, mesh))  # fmt: skip
    work = apply_all(rewrites, start)
    return work.graph, work.propagate()


def test_strategy_annotations_rank_between_user_and_rules():
    from autopar.propagation import Priority

    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    graph, propagation = _analysed(seed, mesh, _ShardBatch())
    x = graph.by_name["x"]
    assert str(propagation.dist(x)) == "[S(0)]" and propagation.states[x].priority is Priority.STRATEGY
    assert str(propagation.dist(graph.key_of(seed.values["linear1"]))) == "[S(0)]"  # rules follow it
    autopar.shard_tensor(seed.feeds["x"], mesh, [None, None])  # the user's own annotation wins
    graph, propagation = _analysed(seed, mesh, _ShardBatch())
    assert str(propagation.dist(x)) == "[R]" and propagation.states[x].priority is Priority.USER


def test_two_rewrites_placing_one_value_differently_are_refused():
    class _Replicate(_ShardBatch):
        name = "replicate_batch"

    seed = simple_net(batch=8, sizes=(16, 32, 16, 10))
    with pytest.raises(AutoparError, match="rewrites 'shard_batch' and 'replicate_batch' place x differently"):
        _analysed(seed, autopar.ProcessMesh([0, 1]), _ShardBatch(), _Replicate((-1, -1)))


def test_unknown_strategy_fields_are_named():
    with pytest.raises(AutoparError, match="Strategy has no field\\(s\\) \\['zero'\\]; its fields are \\['pipeline'"):
        autopar.Strategy(zero=1)
    with pytest.raises(AutoparError, match="PipelineConfig\\(micro_batches, schedule, stages\\)"):
        autopar.PipelineConfig(2, "1F1B", 3, 4)


def test_auto_picks_host_where_the_native_program_cannot_gather():
    """Batch 5 on dp=2 with an accuracy: the label is gathered unevenly (3 + 2 rows). The native
    plan is refused naming the op that needs it; 'auto' (the default) picks host instead of
    failing — it picked native because every collective spans the world. (The accuracy is kept
    for fetching: nothing reads it.)"""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [5, 10], "float32")
        y = paddle.static.data("y", [5, 1], "int64")
        logits = paddle.nn.Linear(10, 7)(x)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        autopar.keep(paddle.static.accuracy(paddle.nn.functional.softmax(logits), y))
        paddle.optimizer.SGD(0.1).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    assert dist.collectives_span_world
    with pytest.raises(NativeUnsupported, match=r"uneven pieces \[S\(0\)\] \(shape \[5, 1\]; gathered for accuracy: pd_op.accuracy#"):
        dist.rank_plan(0, "native")
    assert dist.rank_plan(0, "auto").backend == "host"
