"""One pricing (issue 36 items 14 and 7): ``dist.cost`` and ``price_plan`` price a step the same
way — every micro-batch of an accumulating or pipelined step, its bubble, each micro-batch's
collectives — and where collectives run inside the program beside the compute (NCCL, no host
segment), a gradient sync that the rest of the backward can cover is not exposed."""

import importlib
import warnings
from types import SimpleNamespace

import pytest

import autopar
from autopar.pricing import _hidden, _Sync, rank_times
from autopar.testing.models import gpt_block_program

ZOO = ("gpt2", "llama", "bert", "vit", "mixer")
STEPS = {  # (dp, mp, pp), strategy
    "plain": ((2, 1, 1), autopar.Strategy()),
    "accumulated": ((2, 1, 1), autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, stages=1))),
    "pipelined": ((1, 1, 2), autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=4, stages=2))),
}


@pytest.mark.parametrize("cluster", ["cpu-shm", "h100-node"])
@pytest.mark.parametrize("model", ZOO)
def test_dist_cost_and_price_plan_agree_on_the_zoo(model, cluster):
    seed = importlib.import_module(f"autopar.testing.zoo.{model}").build(batch=8)
    costs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (shape, strategy) in STEPS.items():
            plan = autopar.price_plan(seed.main, shape, strategy, seed.startup, cluster=cluster)
            costs[name] = plan.compile().cost
            assert costs[name].step_time == pytest.approx(plan.price.step, rel=0.10), name
    # every micro-batch priced (it was one: accumulating 8 showed 663 us against 3.28 ms whole)
    assert costs["accumulated"].step_time > costs["plain"].step_time
    plain, accumulated = (min(r.compute_time for r in costs[n].ranks) for n in ("plain", "accumulated"))
    assert accumulated > plain  # the same rows in four runs, each op's fixed cost four times
    pipelined = costs["pipelined"]
    # (the bubble is the schedule's replay: where the first stage is the slow one, as bert's embedding makes it on
    # h100, the second waits but the first never does, and the step has no bubble)
    assert pipelined.bubble >= 0 and pipelined.step_time > max(r.compute_time for r in pipelined.ranks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        two = autopar.price_plan(seed.main, (1, 1, 2), autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2)),
                                 seed.startup, cluster=cluster).compile().cost  # fmt: skip
    for r2, r4 in zip(two.ranks, pipelined.ranks):  # each micro-batch's sends and recvs: the same bytes in more of them
        assert r4.collectives > r2.collectives and r4.comm_bytes == r2.comm_bytes


def _sync(time: float, made_by: int) -> _Sync:
    bucket = SimpleNamespace(time=time, members=(), src=SimpleNamespace(mesh=SimpleNamespace(ranks=(0, 1))))
    return _Sync((made_by,), bucket=bucket)


@pytest.mark.parametrize(
    "syncs, hidden",
    [
        (
            [(3.0, 1), (3.0, 2), (1.0, 3)],
            6.0,
        ),  # made at 2 and 5: 3 s each behind the backward; the last, made at 10, not
        ([(7.0, 1), (2.0, 2), (1.0, 3)], 8.0),  # the second waits for the first (one link): 9-11, 1 s behind
        ([(9.0, 3)], 0.0),  # one bucket holding the last gradient made: nothing hides it
        ([(20.0, 1)], 8.0),  # longer than the backward left: the rest is exposed
    ],
)
def test_a_gradient_sync_hides_behind_the_backward_left_after_it(syncs, hidden):
    """Gradients made 2, 5 and 10 s into a 10 s backward (ops 1, 2, 3)."""
    state = SimpleNamespace(reshards=[])
    ready = {1: 2.0, 2: 5.0, 3: 10.0}
    assert _hidden(state, [_sync(t, op) for t, op in syncs], 0, ready, 10.0) == pytest.approx(hidden)
    assert _hidden(state, [_sync(t, op) for t, op in syncs], 5, ready, 10.0) == 0.0  # (rank 5 takes no part)


def _deep_narrow():
    return gpt_block_program(
        batch=16, seq=64, hidden=256, heads=4, vocab=512, layers=8, optimizer="adam", seed=1, layer_calls=True
    )


def test_dp_gradient_buckets_overlap_the_backward_where_the_program_runs_collectives():
    """dp=16 on h100-node (NCCL: collectives in the program): 1 MiB buckets, the later layers'
    made first, run behind the rest of the backward; what the step exposes is the rest. The
    bucket of the first layers' gradients is made at the end of the backward: never hidden, so
    one bucket of every gradient (the default 32 MiB here) hides nothing. On the CPU profiles
    the host runs each collective between program segments: nothing overlaps."""
    seed = _deep_narrow()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buckets = autopar.price_plan(
            seed.main, (16, 1, 1), autopar.Strategy(allreduce_bucket_mb=1.0), seed.startup, cluster="h100-node"
        )
        one = autopar.price_plan(seed.main, (16, 1, 1), autopar.Strategy(), seed.startup, cluster="h100-node")
        host = autopar.price_plan(
            seed.main, (16, 1, 1), autopar.Strategy(allreduce_bucket_mb=1.0), seed.startup, cluster="cpu-shm"
        )
    state = buckets.compile().state
    (times,) = rank_times(state, [0]).values()
    assert len(state.buckets) > 4 and times.hidden > 0 and buckets.price.hidden == pytest.approx(times.hidden)
    assert buckets.price.communication == pytest.approx(times.communication - times.hidden)  # priced below exposed
    assert buckets.price.step == pytest.approx(times.compute + times.communication - times.hidden)
    last = max(state.buckets, key=lambda b: max(state.reshards[m].need.value[0] for m in b.members))
    assert times.hidden <= min(times.backward, times.once_comm - last.time)  # the last bucket shows
    assert one.price.hidden == 0.0 and len(one.compile().state.buckets) == 1
    assert host.price.hidden == 0.0
    assert buckets.compile().cost.step_time == pytest.approx(buckets.price.step, rel=1e-9)


def test_a_collective_among_processes_sharing_cores_pays_its_fixed_costs_stretched():
    """cpu-shm (2 cores): with 4 processes each collective's program segment and message-step
    latencies take twice as long (a waiting member's peer, and its own wake-up, queue for a core
    the others hold); its bytes keep their fitted rate. 2 processes, or a GPU, pay nothing more."""
    from autopar.cost_model import load_cluster
    from autopar.cost_model.comm import coefficients, shared_cores_time

    shm, h100 = load_cluster("cpu-shm"), load_cluster("h100-node")
    fixed = (
        shm.device.segment_seconds + coefficients("all_reduce", 2, 0.0)[0] * shm.link_for((0, 1), "all_reduce").latency
    )
    assert shared_cores_time("all_reduce", (0, 1), shm, 4) == pytest.approx(fixed)
    assert (
        shared_cores_time("all_reduce", (0, 1), shm, 2) == 0.0 and shared_cores_time("all_reduce", (0,), shm, 4) == 0.0
    )
    assert shared_cores_time("all_reduce", (0, 1), h100, 8) == 0.0
    # the step prices it for every collective a rank takes part in (the vocabulary-parallel head's all_reduces included)
    seed = _deep_narrow()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {
            shape: autopar.price_plan(seed.main, shape, autopar.Strategy(), seed.startup, cluster="cpu-shm")
            for shape in ((4, 1, 1), (2, 2, 1))
        }
    stretched = {}
    for shape, plan in plans.items():
        dist = plan.compile()
        alone = sum(c.time for c in dist.comm_ops(0))
        stretched[shape] = sum(shared_cores_time(c.kind.value, c.group, shm, 4) for c in dist.comm_ops(0))
        assert plan.price.communication == pytest.approx(alone + stretched[shape])  # (rank 0: every rank alike here)
        assert stretched[shape] >= len(dist.comm_ops(0)) * shm.device.segment_seconds
