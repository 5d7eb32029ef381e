"""A candidate's price from the compile state alone (autopar/pricing.py) agrees with the
cost report built from the rank programs: communication and memory exactly where no pipeline
runs, compute within the rank programs' own extra ops,
a fixed cost per op and one program run; a pipeline pays its bubble and its per-micro-batch collectives once per
micro-batch."""

import warnings

import pytest

import autopar
from autopar.pricing import price
from autopar.testing.models import annotate_megatron, gpt_block_program


def _gpt(names, strategy):
    seed = gpt_block_program(batch=8, seq=16, hidden=64, heads=4, vocab=128, layers=4, optimizer="adamw", seed=1, layer_calls=True)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], names)
    annotate_megatron(seed, mesh)
    if "dp" in names:
        autopar.shard_tensor(next(iter(seed.feeds.values())), mesh, ["dp", None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(seed.main, mesh, seed.startup, strategy)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_price_agrees_with_the_cost_report_of_the_rank_programs(zero):
    """``dist.cost`` is the same pricing asked for every rank: its step is the price's; its
    bytes and memory are the rank programs' (each rank's collectives); the compute priced from
    the placements is the rank programs' own rooflines, read off their ops, within the ops
    compile adds, a fixed cost per op and one program run."""
    from autopar.inspect.cost_report import program_compute

    dist = _gpt(["dp", "mp"], autopar.Strategy(zero_stage=zero))
    priced, report = price(dist.state), dist.cost
    device = dist.state.cluster.device
    assert report.step_time == pytest.approx(priced.step, rel=1e-9)
    assert priced.communication == pytest.approx(max(r.comm_time for r in report.ranks), rel=1e-9)
    assert priced.memory == max(report.peak_memory.values())
    assert priced.sent == max(report.comm_bytes.values())
    for r in report.ranks:
        assert r.comm_bytes == sum(c.bytes for c in dist.comm_ops(r.rank))
        assert r.collectives == len(dist.comm_ops(r.rank))
    compute = max(program_compute(dist.rank_plan(r.rank).program, dist.state.cluster) for r in report.ranks)
    launches = len(dist.rank_plan(0).program.global_block().ops) * device.op_seconds + device.segment_seconds
    shared = device.shared_by(4)  # (the rank programs' rooflines are one process alone)
    assert 0.5 * compute < priced.compute <= shared * (compute + launches)  # (rank programs add slices, concats, copies)
    assert priced.bubble == 0.0 and priced.step == priced.compute + priced.communication


def test_a_pipeline_pays_its_bubble_and_each_micro_batch():
    one = price(_gpt(["pp", "mp"], autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))).state)
    four = price(_gpt(["pp", "mp"], autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, stages=2))).state)
    assert one.bubble > 0 and four.bubble < one.bubble  # smaller micro-batches, shorter fill and drain
    assert four.communication > one.communication  # the same bytes in more, smaller collectives (latency)
    zb = _gpt(["pp", "mp"], autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2, schedule="ZBH1")))
    device = zb.state.cluster.device
    zero_bubble, segment = price(zb.state), device.segment_seconds * device.shared_by(min(4, zb.state.cluster.devices_per_node))
    assert zero_bubble.bubble < one.bubble
    assert zero_bubble.compute == pytest.approx(one.compute + 2 * segment)  # the same ops; a weight-gradient phase per micro-batch


def test_a_zero_bucket_under_a_pipeline_is_paid_by_its_own_stage_only():
    from autopar.passes.pipeline_split import find_stages
    from autopar.pricing import _bucket_ranks

    seed = gpt_block_program(batch=8, seq=16, hidden=64, heads=4, vocab=128, layers=4, optimizer="adamw", seed=1, layer_calls=True)
    strategy = autopar.Strategy(zero_stage=2, pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = autopar.price_plan(seed.main, (2, 1, 2), strategy, seed.startup, cluster="h100-node").compile().state
    stages = [set(mesh.ranks) for mesh in find_stages(state)[0]]
    assert len(state.zero_buckets) >= 2
    for bucket in state.zero_buckets:  # (a ZeroBucket has no mesh: its members' reshards say where it runs)
        assert set(_bucket_ranks(bucket, {planned.index: planned for planned in state.reshards})) in stages


@pytest.mark.parametrize("ranks, sizes", [(2, (16, 32, 16, 10)), (3, (16, 33, 16, 10))], ids=["even", "uneven"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pricing_counts_the_ops_compile_adds(zero, ranks, sizes):
    """Each op compile adds around the collectives costs its launch on a host; pricing counts
    them without building a rank program: its count equals what the rank programs hold beyond
    the serial program, less the partition's rescaling of the mean over the split batch (two
    scales, four ops). Without it a ZeRO plan, ~10 ops per parameter more, priced as plain dp."""
    from autopar.pricing import added_ops
    from autopar.testing.models import simple_net

    seed = simple_net(batch=9, sizes=sizes, optimizer="adam")
    mesh = autopar.ProcessMesh(list(range(ranks)), ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=zero))
    for rank in mesh.ranks:
        added = len(dist.rank_program(rank).global_block().ops) - len(seed.main.global_block().ops)
        assert sum(added_ops(dist.state, rank)) == added - 4, rank


def test_the_count_holds_beside_tensor_and_sequence_parallelism():
    """dp x mp (gradients zeroed on all but one tensor rank before their bucket), with and
    without SP and ZeRO: what the count leaves out is the partition's rescaling alone, the same
    on every rank under every strategy."""
    from autopar.pricing import added_ops

    left_out = set()
    for zero in (0, 2):
        for sp in (False, True):
            seed = gpt_block_program(batch=4, seq=8, hidden=16, heads=2, vocab=24, layers=2, optimizer="momentum", seed=1)
            mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
            autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
            annotate_megatron(seed, mesh)
            strategy = autopar.Strategy(zero_stage=zero, sequence_parallel=sp)
            dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
            serial = len(seed.main.global_block().ops)
            left_out |= {len(dist.rank_program(r).global_block().ops) - serial - sum(added_ops(dist.state, r)) for r in mesh.ranks}
    assert len(left_out) == 1 and 0 <= left_out.pop() <= 8
