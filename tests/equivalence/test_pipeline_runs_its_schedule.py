"""The pipeline runner runs the rank plan's executable schedule, action by action, and knows
nothing else (Core 3.1): each RankAction runs its piece of the program (cut at compile) for its
micro-batch through one dispatch table keyed by the action's kind; SEND / RECV name their
transfers. An action list reordered validly runs in its new order and still equals serial; a
wrong order is refused by verification before anything runs (one rank's order by
``verify_rank`` when its runner is built, the ranks' transfers together by ``verify_links``
before a simulation, links in order); a recv takes the next message on its link and refuses
one of another key; a schedule the stage-level verifier rejects never reaches a runner
(compile refuses it)."""

import dataclasses

import numpy as np
import pytest

import autopar
from autopar.errors import ScheduleError
from autopar.pipeline_lowering import RECV, SEND, in_link_order, verify_links
from autopar.runtime.pipeline_runner import PipelineRunner
from autopar.runtime.simulator import fetched, run_step, simulate_plans, start_ranks
from autopar.schedule import B, F
from autopar.testing.pipeline_models import residual_cut_inside, staged_mlp
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds, run_serial

PP = autopar.ProcessMesh([0, 1], ["pp"])


def _compiled(schedule="FThenB", micro_batches=2, model=staged_mlp):
    seed = model(PP, optimizer="sgd") if model is staged_mlp else model(PP)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))
    return seed, autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)


def _with_steps(plan, steps):
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, steps=tuple(steps)))


def _run_recording(seed, plans, feeds):
    """One step per feed of every rank's runner, recording each action as its handler runs it;
    the losses and each rank's actions in the order they ran."""
    import paddle

    key = plans[0].values.key(seed.loss)
    runners = {rank: PipelineRunner(plan, [key]) for rank, plan in plans.items()}
    ran = {rank: [] for rank in plans}
    for rank, runner in runners.items():
        def recording(handler, rank=rank):
            def handle(action):
                found = handler(action)
                if found is None:  # (a handler returning a collective is called again once it is done)
                    ran[rank].append(action)
                return found

            return handle

        runner.handlers = {kind: recording(handler) for kind, handler in runner.handlers.items()}
    start = paddle.get_rng_state()
    start_ranks(runners)
    losses = []
    for feed in feeds:
        run_step(runners, feed)
        losses.append(fetched(plans[0].values, [key], runners)[0])
    paddle.set_rng_state(start)
    return losses, ran


def _assert_equals_serial(seed, losses, feeds):
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    for got, (want,) in zip(losses, serial.fetches):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_send_and_recv_actions_name_their_transfers():
    _, dist = _compiled()
    first, last = dist.rank_plan(0).pipeline, dist.rank_plan(1).pipeline
    assert [str(a) for a in last.actions][:2] == ["1RECV_F0", "1F0"]
    recv, forward = last.steps[:2]  # 1RECV_F0 runs the recv its phase starts with, then 1F0 the rest
    assert recv.kind is RECV and (recv.transfer.sender, recv.transfer.receiver, recv.transfer.key.micro_batch) == (0, 1, 0)
    assert forward.kind is F and (forward.stage, forward.micro_batch) == (1, 0)
    sends = [a for a in first.steps if a.kind is SEND]
    assert [a.transfer for a in sends] == [r.transfer for r in last.steps if r.kind is RECV]  # FThenB: in link order
    assert str(first.steps[1]) == f"SEND[{sends[0].transfer}]#{sends[0].piece}" and first.steps[0].kind is F


def test_the_runner_dispatches_on_the_action_kind_only():
    _, dist = _compiled()
    runner = PipelineRunner(dist.rank_plan(0), [])
    assert all(kind in runner.handlers for kind in {a.kind for a in runner.role.steps})
    assert not hasattr(runner, "steps") and not hasattr(runner, "jobs_of")  # (Core 3.0's string-tagged steps)


def _backward_of_micro_batch_1_first(plan):
    """Rank 1's steps with micro-batch 1's backward (and the send of its gradient) before
    micro-batch 0's: valid on its own."""
    steps = list(plan.pipeline.steps)
    backward = [a for a in steps if a.micro_batch == 0 and (a.kind is B or a.kind is SEND)]
    for action in backward:  # 1B0, SEND of its gradient: after micro-batch 1's
        steps.remove(action)
    at = max(i for i, a in enumerate(steps) if a.micro_batch == 1 and (a.kind is B or a.kind is SEND)) + 1
    steps[at:at] = backward
    return steps


def test_a_reordered_schedule_runs_in_its_order_and_equals_serial():
    """Rank 1 runs micro-batch 1's backward before micro-batch 0's (and sends its gradient
    first): valid, verified, run in that order once rank 0's recvs are put in the new link
    order (the links deliver in order)."""
    seed, dist = _compiled()
    plans = {rank: dist.rank_plan(rank) for rank in PP.ranks}
    steps = _backward_of_micro_batch_1_first(plans[1])
    plans[1] = _with_steps(plans[1], steps)
    with pytest.raises(ScheduleError, match="an in-order link would hand it the wrong tensor"):
        verify_links({rank: plan.pipeline.steps for rank, plan in plans.items()}, fifo=True)
    plans[0] = plans[0].in_link_order({1: steps})  # (as the compiler orders a plan: from its peers' steps)
    verify_links({rank: plan.pipeline.steps for rank, plan in plans.items()}, fifo=True)
    assert plans[0].pipeline.steps != dist.rank_plan(0).pipeline.steps
    feeds = random_feeds(seed.feeds, 2)
    losses, ran = _run_recording(seed, plans, feeds)
    assert ran[1] == list(steps) * len(feeds)
    assert ran[1] != list(dist.rank_plan(1).pipeline.steps) * len(feeds)
    _assert_equals_serial(seed, losses, feeds)


def test_a_recv_of_another_key_than_the_next_message_on_its_link_is_refused():
    """Rank 1 reordered alone: rank 0 still waits for micro-batch 0's gradient first, but the
    next message on its link is micro-batch 1's. The runtime checks the message it takes (it
    does not search for its key) and names both keys, the link and the RECV; a simulation
    refuses the lists before running (its links are verified in order)."""
    seed, dist = _compiled()
    plans = {rank: dist.rank_plan(rank) for rank in PP.ranks}
    plans[1] = _with_steps(plans[1], _backward_of_micro_batch_1_first(plans[1]))
    feeds = random_feeds(seed.feeds, 1)
    with pytest.raises(ScheduleError, match="link rank 1 -> rank 0: message 0 is .* mb1 1->0, but rank 0's recv 0 waits for .* mb0"):
        simulate_plans(plans, feeds, [seed.loss])
    with pytest.raises(
        autopar.AutoparError,
        match=r"rank 0: RECV\[.* mb0 1->0\] waits for the message of key .*mb0, but the next message on link rank 1 -> rank 0 has key .*mb1",
    ):
        _run_recording(seed, plans, feeds)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_rank_plans_receive_in_link_order_and_equal_serial(schedule):
    """A residual block cut inside crosses the boundary mid-phase: lowered alone, rank 1 would
    take rank 0's messages in another order than sent. The compiler builds each rank plan with
    its recvs in link order (from its peers' lowered lists), verified FIFO; the runners take
    each link's messages in that order (the next message, checked) and equal serial."""
    seed, dist = _compiled(schedule, model=residual_cut_inside)
    plans = {rank: dist.rank_plan(rank) for rank in PP.ranks}
    built = {rank: plan.pipeline.steps for rank, plan in plans.items()}
    verify_links(built, fifo=True)
    lowered = {rank: _with_steps(plan, ()).pipeline.steps for rank, plan in plans.items()}  # (no steps: lowered anew)
    with pytest.raises(ScheduleError, match="in-order link"):
        verify_links(lowered, fifo=True)
    assert built == in_link_order(lowered)
    assert built[1] != lowered[1] and sorted(map(str, built[1])) == sorted(map(str, lowered[1]))
    feeds = random_feeds(seed.feeds, 2, seed=5, classes=5)
    losses, ran = _run_recording(seed, plans, feeds)
    assert ran[1] == list(built[1]) * len(feeds)
    _assert_equals_serial(seed, losses, feeds)


def test_a_rank_plan_missing_a_peers_schedule_is_not_put_in_link_order():
    _, dist = _compiled(model=residual_cut_inside)
    with pytest.raises(ScheduleError, match=r"rank 1: the link order needs the schedules of ranks \[0\]"):
        dist.rank_plan(1).in_link_order({})


def test_a_wrong_order_on_one_rank_is_refused_before_its_runner_is_built():
    _, dist = _compiled()
    plan = dist.rank_plan(1)
    steps = list(plan.pipeline.steps)
    steps[0], steps[1] = steps[1], steps[0]  # 1F0 before the recv of its input
    with pytest.raises(ScheduleError, match=r"rank 1: 1F0#\d+ \(position 0\) runs before RECV\["):
        PipelineRunner(_with_steps(plan, steps), [])
    accumulate = next(i for i, a in enumerate(plan.pipeline.steps) if str(a) == "1ACC1")
    early = list(plan.pipeline.steps)
    early.insert(0, early.pop(accumulate))  # micro-batch 1's gradients added before its backward ran
    with pytest.raises(ScheduleError, match=r"1ACC1 \(position 0\) runs before"):
        PipelineRunner(_with_steps(plan, early), [])


def test_a_wrong_order_across_ranks_is_refused_before_anything_runs():
    """Rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation while
    rank 1 (FThenB) wants both activations first: each list alone is valid, together they
    deadlock; a transfer sent and never received is named too."""
    seed, dist = _compiled()
    plans = {rank: dist.rank_plan(rank) for rank in PP.ranks}
    steps = list(plans[0].pipeline.steps)
    second = [a for a in steps if a.micro_batch == 1 and (a.kind is F or a.kind is SEND)]
    for action in second:
        steps.remove(action)
    at = max(i for i, a in enumerate(steps) if a.micro_batch == 0 and a.kind is B) + 1
    steps[at:at] = second
    deadlocked = {0: _with_steps(plans[0], steps), 1: plans[1]}
    PipelineRunner(deadlocked[0], [])  # (valid on its own)
    feeds = random_feeds(seed.feeds, 1)
    with pytest.raises(ScheduleError, match=r"deadlock: no rank can progress; rank 0 waits at RECV\[.*rank 1 waits at RECV\["):
        simulate_plans(deadlocked, feeds, [seed.loss])
    unsent = [a for a in plans[0].pipeline.steps if a.kind is not SEND or a.micro_batch != 1]
    with pytest.raises(ScheduleError, match="rank 0 has no SEND of transfer"):
        simulate_plans({0: _with_steps(plans[0], unsent), 1: plans[1]}, feeds, [seed.loss])


def test_a_schedule_the_verifier_rejects_never_runs(monkeypatch):
    import autopar.schedule as schedules

    def backwards_first(name, num_ranks, micro_batches, virtual_stages=1):
        made = schedules.fthenb(num_ranks, micro_batches)
        return {rank: list(reversed(actions[:-1])) + actions[-1:] for rank, actions in made.items()}

    monkeypatch.setattr(schedules, "make_schedule", backwards_first)
    schedules.verified_schedule.cache_clear()  # (verified schedules are kept per arguments: make this one anew)
    try:
        with pytest.raises(ScheduleError):
            _compiled()
    finally:
        schedules.verified_schedule.cache_clear()


@pytest.mark.parametrize(("schedule", "micro_batches"), [("1F1B", 2), ("1F1B", 4), ("ZBH1", 2), ("ZBH1", 4)])
def test_a_cut_inside_a_residual_block_crosses_twice_in_a_phase(schedule, micro_batches):
    """p2p in the middle of a phase runs inside it; only a phase's edges are the actions'
    (zero-bubble: stage 0's second recv sits at the start of its W half, which no RECV action
    serves; it was taken out of the phase and never ran)."""
    seed = residual_cut_inside(PP)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))
    dist = autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)
    assert_simulation_equals_serial(seed, dist, classes=5)
