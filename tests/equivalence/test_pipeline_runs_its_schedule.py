"""The pipeline runner runs the verified schedule, action by action (Core 3.0): a RECV action
runs the recvs its phase starts with, a SEND action the sends it ends with, each compute
action its phase's jobs, OPT the accumulation and the update. A schedule reordered (validly)
runs in its new order and still equals serial; a schedule the verifier rejects never reaches a
runner (compile refuses it)."""

import dataclasses

import pytest

import autopar
from autopar.errors import ScheduleError
from autopar.runtime.pipeline_runner import PipelineRunner
from autopar.runtime.simulator import simulate_plans
from autopar.schedule import Action, ActionKind, verify
from autopar.testing.pipeline_models import residual_cut_inside, staged_mlp
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds, run_serial

PP = autopar.ProcessMesh([0, 1], ["pp"])


def _compiled(schedule="FThenB", micro_batches=2):
    seed = staged_mlp(PP, optimizer="sgd")
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))
    return seed, autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)


def _send_jobs(runner):
    return [i for i, step in enumerate(runner.steps) if step[0] == "job" and _kind(runner, step) == "send"]


def _kind(runner, step):
    job = runner.hosts[step[2]].jobs[step[1]]
    return job.collective.kind.value if hasattr(job, "collective") else "segment"


def test_send_and_recv_actions_run_the_p2p():
    _, dist = _compiled()
    first, last = PipelineRunner(dist.rank_plan(0), []), PipelineRunner(dist.rank_plan(1), [])
    assert [str(a) for a in last.role.actions][:2] == ["1RECV_F0", "1F0"]
    assert _kind(last, last.steps[0]) == "recv" and last.steps[1][0] == "begin"  # the recv runs before F's span
    spans = [i for i, step in enumerate(first.steps) if step[0] == "end"]
    assert _send_jobs(first)[0] == spans[0] + 1  # 0F0's span closes, then 0SEND_F0


def test_a_reordered_schedule_runs_in_its_order_and_equals_serial():
    seed, dist = _compiled()
    plans = {rank: dist.rank_plan(rank) for rank in PP.ranks}
    role = plans[0].pipeline
    actions = list(role.actions)  # 0F0 0SEND_F0 0F1 0SEND_F1 ...: send micro-batch 0's activation after F1 instead
    send = actions.pop(actions.index(Action(0, ActionKind.SEND_F, 0)))
    actions.insert(actions.index(Action(0, ActionKind.F, 1)) + 1, send)
    verify({0: actions, 1: list(plans[1].pipeline.actions)}, num_stages=2, micro_batches=2)
    plans[0] = dataclasses.replace(plans[0], pipeline=dataclasses.replace(role, actions=tuple(actions)))
    before, after = PipelineRunner(dist.rank_plan(0), []), PipelineRunner(plans[0], [])
    assert _send_jobs(before) != _send_jobs(after)
    f1_end = [i for i, step in enumerate(after.steps) if step[0] == "end"][1]
    assert _send_jobs(after)[:2] == [f1_end + 1, f1_end + 2]  # both sends now follow F1
    feeds = random_feeds(seed.feeds, 2)
    import paddle

    start = paddle.get_rng_state()
    result = simulate_plans(plans, feeds, [seed.loss])
    paddle.set_rng_state(start)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    for got, want in zip(result.fetches, serial.fetches):
        assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))


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
