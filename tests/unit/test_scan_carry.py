"""cumsum along a split dim keeps the split (autopar/spmd/scan.py): each rank scans its piece
and adds the carry of the shards before it, from one all_gather of each shard's total
(passes/scan_carry.py). Forward and backward (cumsum_grad scans the other way), exclusive and
reverse scans, the dim split over one mesh dim or two: equal to serial, and what moves is one
all_gather of ``parts`` rows per scan, not the tensor."""

import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.models import SeedProgram, make_optimizer
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo.placements import annotate

M = autopar.ProcessMesh
ROWS, WIDTH = 8, 6


def _scanned(mesh, splits, exclusive=False, reverse=False, micro_batches=None, cluster=None):
    """``loss = mean(cumsum(x @ w, axis=0)²)``, x's rows split by ``splits`` (mesh dim -> 0)."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [ROWS, WIDTH], "float32")
        h = paddle.nn.Linear(WIDTH, WIDTH)(x)
        scan = paddle._C_ops.cumsum(h, 0, False, exclusive, reverse)
        loss = paddle.mean(paddle.square(scan))
        make_optimizer("sgd").minimize(loss)
    annotate(x, mesh, **splits)
    seed = SeedProgram(main, startup, {"x": x}, loss, {})
    strategy = autopar.Strategy(fuse_allreduce=False, cluster=cluster)
    if micro_batches:
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=1))
    return seed, autopar.compile(main, mesh, startup_program=startup, strategy=strategy)


CASES = {
    "dp2": (M([0, 1], ["dp"]), {"dp": 0}),
    "dp4": (M([0, 1, 2, 3], ["dp"]), {"dp": 0}),
    "dp x ep": (M([[0, 1], [2, 3]], ["dp", "ep"]), {"dp": 0, "ep": 0}),  # rows over both: shard index dp-major
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("exclusive", "reverse"), [(False, False), (True, False), (False, True)])
def test_a_scan_along_a_split_dim_equals_serial(name, exclusive, reverse):
    mesh, splits = CASES[name]
    seed, dist = _scanned(mesh, splits, exclusive, reverse)
    assert_simulation_equals_serial(seed, dist, steps=2)


@pytest.mark.parametrize("name", list(CASES))
def test_a_scan_moves_one_row_per_shard_each_way(name):
    """Forward (cumsum) and backward (cumsum_grad): each one all_gather of the shards' totals
    (``parts`` rows of the width), nothing gathers the scanned tensor."""
    mesh, splits = CASES[name]
    _, dist = _scanned(mesh, splits)
    parts = mesh.size
    for rank in mesh.ranks:
        carries = [c for c in dist.comm_ops(rank) if c.reason.startswith("scan carry")]
        assert len(carries) == 2 and all(c.kind.value == "all_gather" for c in carries), carries
        assert {c.shape for c in carries} == {(parts, WIDTH)} and {c.bytes for c in carries} == {parts * WIDTH * 4}
        others = [c for c in dist.comm_ops(rank) if c not in carries]
        assert all("gradient sync" in c.reason for c in others), [c.reason[:80] for c in others]


def test_the_first_shard_takes_part_in_the_gather_and_adds_nothing():
    """Rank 0's scan is its local scan (no add after it); rank 1 adds rank 0's total."""
    _, dist = _scanned(*CASES["dp2"])
    adds = {}
    for rank in (0, 1):
        ops = [op.name() for op in dist.rank_plan(rank).program.global_block().ops]
        at = ops.index("pd_op.cumsum")
        adds[rank] = "pd_op.add" in ops[at : ops.index("pd_op.square")]
        assert [c.kind.value for c in dist.comm_ops(rank) if c.reason.startswith("scan carry")] == ["all_gather"] * 2
    assert adds == {0: False, 1: True}


def test_a_scan_along_a_micro_batched_dim_is_refused_by_name():
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op\.cumsum scans dim 0 .* one micro-batch's scan"):
        _scanned(M([0, 1], ["dp"]), {"dp": 0}, micro_batches=2)


def test_a_pending_sum_passes_through_the_scan():
    """A row-parallel product (pending a sum over mp) scanned along its rows (split over dp): each
    rank carries its own term's totals over dp, and the sum over mp is made after the scan, where
    square needs it complete. Equal to serial."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = M([[0, 1], [2, 3]], ["dp", "mp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [ROWS, WIDTH], "float32")
        linear = paddle.nn.Linear(WIDTH, WIDTH, bias_attr=False)
        loss = paddle.mean(paddle.square(paddle.cumsum(linear(x), axis=0)))
        make_optimizer("sgd").minimize(loss)
    annotate(x, mesh, dp=0, mp=1)
    annotate(linear.weight, mesh, mp=0)
    dist = autopar.compile(main, mesh, startup_program=startup)
    moved = [
        (c.kind.value, c.group, c.reason.split(":")[0].split(" in ")[0])
        for c in dist.comm_ops(0)
        if "gradient sync" not in c.reason
    ]
    carry = ("all_gather", (0, 2), "scan carry")  # (over dp only: the pending sum over mp kept)
    assert moved == [carry, ("all_reduce", (0, 1), "row-parallel output"), carry]
    assert_simulation_equals_serial(SeedProgram(main, startup, {"x": x}, loss, {}), dist, steps=2)


def test_the_carry_is_priced_as_it_is_emitted():
    """The step's price counts each rank's carries (autopar/pricing.py): its per-micro-batch
    collectives are the ones it moves that are not gradient syncs, at the carries' planned
    seconds and sizes (h100-node: no CPU cores shared by the processes, whose stretch of the
    fixed costs the planned times leave out)."""
    from autopar.pricing import rank_times

    _, dist = _scanned(*CASES["dp4"], cluster="h100-node")
    (times,) = rank_times(dist.state, [0]).values()
    carries = [c for c in dist.comm_ops(0) if c.reason.startswith("scan carry")]
    assert times.per_micro_collectives == len(carries) == 2
    assert times.per_micro_comm == pytest.approx(sum(c.time for c in carries))
    assert times.per_micro_sent == sum(c.bytes for c in carries)  # (counted as the vocabulary rows' are: their size)
