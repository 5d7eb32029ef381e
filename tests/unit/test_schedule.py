"""Pipeline schedules as data: Action values, the generators, the send/recv lowering, the verifier
and the timeline simulator (autopar/schedule.py, autopar/schedule_timeline.py).

Schedules are written and compared in their text form, one rank per line: ``0F0 0SEND_F0 ...``.
"""

import dataclasses
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.errors import AutoparError
from autopar.schedule import (
    SCHEDULE_KINDS,
    SCHEDULES,
    Action,
    ActionKind,
    ScheduleError,
    add_send_recv,
    build_schedule,
    make_schedule,
    verify,
)
from autopar.schedule_timeline import render_svg, simulate_timeline

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
RANKS = (1, 2, 3, 4)
MICRO_BATCHES = (1, 2, 3, 4, 5, 8)


def schedule_of(*rows: str) -> dict[int, list[Action]]:
    """One rank per row: ``"0F0 0SEND_F0 0OPT"``."""
    return {rank: [Action.parse(word) for word in row.split()] for rank, row in enumerate(rows)}


def text_of(schedule: dict[int, list[Action]]) -> list[str]:
    return [" ".join(map(str, schedule[rank])) for rank in sorted(schedule)]


def count(schedule: dict[int, list[Action]], kind: ActionKind) -> int:
    return sum(action.kind is kind for actions in schedule.values() for action in actions)


# ---- Action ------------------------------------------------------------------------------


def test_action_prints_compactly_and_parses_back():
    assert str(Action(2, F, 0)) == "2F0"
    assert str(Action(1, ActionKind.SEND_F, 3)) == "1SEND_F3"
    assert str(Action(0, ActionKind.OPTIMIZER)) == "0OPT"
    assert repr([Action(0, I, 1), Action(0, W, 1)]) == "[0I1, 0W1]"
    assert Action.parse(" 12RECV_B7 ") == Action(12, ActionKind.RECV_B, 7)


@given(
    st.integers(0, 40),
    st.sampled_from(sorted(SCHEDULE_KINDS)),
    st.integers(0, 64),
)
def test_action_str_parse_round_trip(stage, kind, micro_batch):
    action = Action(stage, kind, None if kind is ActionKind.OPTIMIZER else micro_batch)
    assert Action.parse(str(action)) == action
    assert hash(Action.parse(str(action))) == hash(action)


def test_action_is_a_frozen_value():
    action = Action(1, B, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.stage = 3
    assert dataclasses.replace(action, kind=I) == Action(1, I, 2)
    assert len({Action(1, B, 2), Action.parse("1B2")}) == 1


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Action(-1, F, 0), "stage must be an int >= 0"),
        (lambda: Action(True, F, 0), "stage must be an int >= 0"),
        (lambda: Action(0, "F", 0), "kind must be an ActionKind"),
        (lambda: Action(0, F), "needs a micro_batch"),
        (lambda: Action(0, ActionKind.OPTIMIZER, 1), "once per step"),
        (lambda: Action.parse("F0"), "cannot parse action 'F0'"),
        (lambda: Action.parse("0X1"), "cannot parse action '0X1'"),
        (lambda: Action.parse("0F"), "needs a micro_batch"),
        (lambda: Action.parse("0OPT1"), "once per step"),
    ],
)
def test_bad_actions_are_refused(make, message):
    with pytest.raises(AutoparError, match=message):
        make()


# ---- generators --------------------------------------------------------------------------


def allowed_requests():
    for name in SCHEDULES:
        for num_ranks in RANKS:
            for micro_batches in MICRO_BATCHES:
                if name != "Interleaved1F1B":
                    yield name, num_ranks, micro_batches, 1
                elif micro_batches % num_ranks == 0:
                    yield from ((name, num_ranks, micro_batches, v) for v in (2, 3))


@pytest.mark.parametrize("name, num_ranks, micro_batches, virtual_stages", list(allowed_requests()))
def test_every_schedule_lowers_and_verifies(name, num_ranks, micro_batches, virtual_stages):
    schedule = build_schedule(name, num_ranks, micro_batches, virtual_stages)
    num_stages = num_ranks * virtual_stages
    # every stage boundary crosses ranks when there are several ranks: one send + one recv each way
    boundaries = micro_batches * (num_stages - 1) if num_ranks > 1 else 0
    for kind in (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B):
        assert count(schedule, kind) == boundaries, kind
    assert count(schedule, ActionKind.OPTIMIZER) == num_stages
    assert count(schedule, F) == micro_batches * num_stages
    for actions in schedule.values():  # the optimizer closes every rank's step
        assert {a.kind for a in actions[-virtual_stages:]} == {ActionKind.OPTIMIZER}
    timeline = simulate_timeline(schedule)
    sends = {span.action: span for spans in timeline.spans for span in spans}
    for spans in timeline.spans:  # a recv never ends before its send
        for span in spans:
            if span.action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                peer = span.action.stage + (-1 if span.action.kind is ActionKind.RECV_F else 1)
                kind = ActionKind.SEND_F if span.action.kind is ActionKind.RECV_F else ActionKind.SEND_B
                assert span.end >= sends[Action(peer, kind, span.action.micro_batch)].end


def test_one_f_one_b_lowered_on_two_ranks():
    assert text_of(build_schedule("1F1B", 2, 3)) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2 0OPT",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1OPT",
    ]


def test_fthenb_runs_every_forward_first():
    assert text_of(make_schedule("FThenB", 2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2 0OPT", "1F0 1F1 1F2 1B0 1B1 1B2 1OPT"]


def test_one_f_one_b_with_fewer_micro_batches_than_ranks():
    # rank r warms up with min(p - r - 1, m) forwards: with m=1 of p=3 every rank runs F then B
    assert text_of(make_schedule("1F1B", 3, 1)) == ["0F0 0B0 0OPT", "1F0 1B0 1OPT", "2F0 2B0 2OPT"]


def test_zb_h1_defers_the_first_weight_gradients():
    # 1F1B's order with B split into I and W; rank r defers the W of its first r micro-batches
    assert text_of(make_schedule("ZBH1", 3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3 0OPT",
        "1F0 1F1 1I0 1F2 1I1 1W1 1F3 1I2 1W2 1I3 1W3 1W0 1OPT",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W2 2F3 2I3 2W3 2W0 2W1 2OPT",
    ]


def test_interleaved_runs_chunks_in_groups_of_num_ranks():
    # stages 0, 2 on rank 0 and 1, 3 on rank 1; micro-batches go through chunk 0, then chunk 1
    assert text_of(make_schedule("Interleaved1F1B", 2, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 0OPT 2OPT",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 1OPT 3OPT",
    ]


@pytest.mark.parametrize(
    "request_, message",
    [
        (
            ("Interleaved1F1B", 2, 3, 2),
            "needs micro_batches to be a multiple of num_ranks .*micro_batches=3, num_ranks=2",
        ),
        (("Interleaved1F1B", 2, 4, 1), r"needs virtual_stages >= 2 \(with 1 it is 1F1B\), got 1"),
        (("1F1B", 2, 0), "1F1B: micro_batches must be an int >= 1, got 0"),
        (("ZBH1", 0, 4), "ZBH1: num_ranks must be an int >= 1, got 0"),
        (("FThenB", 2, 2.0), "FThenB: micro_batches must be an int >= 1, got 2.0"),
        (("1F1B", 2, 4, 2), "1F1B runs one stage per rank: virtual_stages must be 1, got 2"),
        (("GPipe", 2, 4), "unknown pipeline schedule 'GPipe'; known schedules: FThenB, 1F1B, Interleaved1F1B, ZBH1"),
    ],
)
def test_requests_that_cannot_be_built(request_, message):
    with pytest.raises(AutoparError, match=message):
        make_schedule(*request_)


# ---- lowering ----------------------------------------------------------------------------


def test_lowering_keeps_a_link_fifo_when_a_rank_consumes_out_of_order():
    # rank 1 needs micro-batch 1 first; the recv of micro-batch 0, sent first, moves up before it
    compute = schedule_of("0F0 0F1 0B0 0B1 0OPT", "1F1 1F0 1B0 1B1 1OPT")
    lowered = add_send_recv(compute, 2)
    assert text_of(lowered) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0OPT",
        "1RECV_F0 1RECV_F1 1F1 1F0 1B0 1SEND_B0 1B1 1SEND_B1 1OPT",
    ]
    verify(lowered, 2, 2)


def test_stages_on_one_rank_exchange_nothing():
    compute = make_schedule("Interleaved1F1B", 1, 2, 3)
    assert add_send_recv(compute, 3) == compute
    verify(compute, 3, 2)


def test_lowering_takes_compute_only_schedules():
    with pytest.raises(ScheduleError, match="rank 0: 0SEND_F0 in a compute-only schedule"):
        add_send_recv(build_schedule("1F1B", 2, 2), 2)


# ---- verify ------------------------------------------------------------------------------

GOOD = (
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0OPT",
    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT",
)


def test_the_hand_written_schedule_is_good():
    assert text_of(build_schedule("1F1B", 2, 2)) == list(GOOD)
    verify(schedule_of(*GOOD), 2, 2)


@pytest.mark.parametrize(
    "rank0, rank1, message",
    [
        (  # a recv dropped
            GOOD[0],
            "1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1OPT",
            "rank 0: 0SEND_F1 has no matching recv 1RECV_F1 on rank 1",
        ),
        (  # a send dropped
            "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1 0OPT",
            GOOD[1],
            "rank 1: 1RECV_F1 has no matching send 0SEND_F1 on rank 0",
        ),
        (  # the two activations received in the other order than sent
            GOOD[0],
            "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1OPT",
            "link rank 0 -> rank 1: sends and recvs in different orders: message 0 is 0SEND_F0, "
            "but rank 1's recv 0 is 1RECV_F1",
        ),
        (  # backward before forward
            GOOD[0],
            "1RECV_F0 1B0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT",
            r"rank 1: 1B0 \(position 1\) runs before its forward 1F0",
        ),
        (  # backward before the next stage's gradient arrived
            "0F0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B0 0RECV_B1 0B1 0OPT",
            GOOD[1],
            r"rank 0: 0B0 \(position 4\) runs before stage 1's input gradient of micro-batch 0 is delivered",
        ),
        (  # forward before its input arrived
            GOOD[0],
            "1F0 1RECV_F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT",
            r"rank 1: 1F0 \(position 0\) runs before stage 0's activation of micro-batch 0 is delivered",
        ),
        (  # a send before the tensor it sends exists
            "0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0OPT",
            GOOD[1],
            r"rank 0: 0SEND_F0 \(position 0\) runs before 0F0 produced what it sends",
        ),
        (  # the optimizer before the last gradient
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0OPT 0RECV_B1 0B1",
            GOOD[1],
            r"rank 0: 0OPT \(position 6\) runs before stage 0's weight gradient of micro-batch 1 is done",
        ),
        (  # a forward missing
            GOOD[0],
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1B1 1SEND_B1 1OPT",
            "rank 1: forward 1F1 is missing",
        ),
        (  # a forward twice
            GOOD[0],
            "1RECV_F0 1F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT",
            r"rank 1: 1F0 is duplicated \(2 times\)",
        ),
        (  # a backward missing
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0OPT",
            GOOD[1],
            r"rank 0: backward 0B1 \(or 0I1 and 0W1\) is missing",
        ),
        (  # an optimizer missing
            GOOD[0],
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
            "rank 1: optimizer 1OPT is missing",
        ),
        (  # a stage on the wrong rank
            GOOD[0] + " 1F2",
            GOOD[1],
            "rank 0: 1F2 belongs to no stage of this rank",
        ),
        (  # a micro-batch the step does not have
            GOOD[0] + " 0F7",
            GOOD[1],
            "rank 0: 0F7 names a micro-batch beyond the 2 of the step",
        ),
        (  # each rank waits for the other: rank 0 wants micro-batch 0's gradient before it sends
            # micro-batch 1's activation, rank 1 wants that activation before its first backward
            "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1 0OPT",
            "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1OPT",
            r"deadlock: no rank can progress; rank 0 is stuck at 0RECV_B0 \(position 2\), waiting for 1SEND_B0 "
            r"from rank 1; rank 1 is stuck at 1RECV_F1 \(position 2\), waiting for 0SEND_F1 from rank 0",
        ),
    ],
)
def test_verify_names_what_is_wrong(rank0, rank1, message):
    with pytest.raises(ScheduleError, match=message):
        verify(schedule_of(rank0, rank1), 2, 2)


@pytest.mark.parametrize(
    "rows, num_stages, message",
    [
        (("0F0 0W0 0I0 0OPT",), 1, r"rank 0: 0W0 \(position 1\) runs before its input-gradient backward 0I0"),
        (("0F0 0I0 0OPT",), 1, r"rank 0: backward 0B0 \(or 0I0 and 0W0\) is missing"),
        (("0F0 0B0 0I0 0W0 0OPT",), 1, "rank 0: 0B0 and a split backward"),
        # two stages on one rank: the gradient of stage 1 is local, but must come first
        (("0F0 1F0 0B0 1B0 0OPT 1OPT",), 2, "rank 0: 0B0 .* before stage 1's input gradient of micro-batch 0"),
        (("1F0 0F0 1B0 0B0 0OPT 1OPT",), 2, "rank 0: 1F0 .* before stage 0's activation of micro-batch 0"),
        (("0F0 0B0 0OPT", "1F0 1B0 1OPT"), 3, "num_stages must be a positive multiple of the 2 ranks, got 3"),
        (({},), 1, r"a schedule maps ranks 0..p-1 to action lists, got ranks \[\]"),
        (("0F0 0SEND_F0 0B0 0OPT",), 1, "rank 0: 0SEND_F0 has no stage on another rank to talk to"),
    ],
)
def test_verify_small_cases(rows, num_stages, message):
    schedule = {} if rows == ({},) else schedule_of(*rows)
    with pytest.raises(ScheduleError, match=message):
        verify(schedule, num_stages, 1)


# ---- timeline ----------------------------------------------------------------------------


def test_timeline_spans_of_1f1b_on_two_ranks():
    timeline = simulate_timeline(build_schedule("1F1B", 2, 2), durations={B: 1.0})
    assert [" ".join(map(str, spans)) for spans in timeline.spans] == [
        "0F0@[0, 1) 0SEND_F0@[1, 1) 0F1@[1, 2) 0SEND_F1@[2, 2) 0RECV_B0@[3, 3) 0B0@[3, 4) "
        "0RECV_B1@[5, 5) 0B1@[5, 6) 0OPT@[6, 6)",
        "1RECV_F0@[1, 1) 1F0@[1, 2) 1B0@[2, 3) 1SEND_B0@[3, 3) 1RECV_F1@[3, 3) 1F1@[3, 4) "
        "1B1@[4, 5) 1SEND_B1@[5, 5) 1OPT@[5, 5)",
    ]
    assert timeline.makespan == 6.0
    assert timeline.bubble_fraction == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1)


@pytest.mark.parametrize("num_ranks", (2, 3, 4))
@pytest.mark.parametrize("micro_batches", (4, 5, 8))
def test_1f1b_bubble_matches_the_formula(num_ranks, micro_batches):
    formula = (num_ranks - 1) / (micro_batches + num_ranks - 1)
    for durations in ({F: 1.0, B: 1.0}, None):  # equal F / B times, and B = 2 F
        timeline = simulate_timeline(build_schedule("1F1B", num_ranks, micro_batches), durations)
        assert timeline.bubble_fraction == pytest.approx(formula, rel=0.05)


@pytest.mark.parametrize("num_ranks", (1, 2, 3, 4))
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_peak_stash_fthenb_holds_every_micro_batch_1f1b_num_ranks(num_ranks, micro_batches):
    stage_bytes = dict.fromkeys(range(num_ranks), 1000)
    fthenb = simulate_timeline(build_schedule("FThenB", num_ranks, micro_batches), activation_bytes=stage_bytes)
    one_f_one_b = simulate_timeline(build_schedule("1F1B", num_ranks, micro_batches), activation_bytes=stage_bytes)
    assert fthenb.peak_stash == (micro_batches,) * num_ranks
    assert one_f_one_b.peak_stash[0] == min(num_ranks, micro_batches)
    assert one_f_one_b.peak_stash == tuple(min(num_ranks - rank, micro_batches) for rank in range(num_ranks))
    assert fthenb.peak_activation_bytes[0] == 1000 * micro_batches
    assert one_f_one_b.peak_activation_bytes[0] == 1000 * min(num_ranks, micro_batches)


@pytest.mark.parametrize("num_ranks", (2, 3, 4))
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_zb_h1_has_less_bubble_and_no_more_stash_than_1f1b(num_ranks, micro_batches):
    zb = simulate_timeline(build_schedule("ZBH1", num_ranks, micro_batches))
    one_f_one_b = simulate_timeline(build_schedule("1F1B", num_ranks, micro_batches))
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert all(z <= o for z, o in zip(zb.peak_stash, one_f_one_b.peak_stash))
    for actions in make_schedule("ZBH1", num_ranks, micro_batches).values():  # in flight: F done, W not yet
        in_flight = [sum((a.kind is F) - (a.kind is W) for a in actions[: i + 1]) for i in range(len(actions))]
        assert max(in_flight) <= min(num_ranks, micro_batches)
    if micro_batches >= num_ranks:  # Qi et al.: with equal F, I, W times the bubble is (p - 1) / (3m + p - 1)
        formula = (num_ranks - 1) / (3 * micro_batches + num_ranks - 1)
        assert zb.bubble_fraction == pytest.approx(formula, rel=0.05)


@pytest.mark.parametrize("num_ranks", (2, 3, 4))
@pytest.mark.parametrize("virtual_stages", (2, 3))
def test_interleaving_shrinks_the_bubble(num_ranks, virtual_stages):
    for micro_batches in (num_ranks, 2 * num_ranks):
        interleaved = build_schedule("Interleaved1F1B", num_ranks, micro_batches, virtual_stages)
        # each of the v stages of a rank does 1/v of its work
        durations = {F: 1.0 / virtual_stages, B: 2.0 / virtual_stages}
        bubble = simulate_timeline(interleaved, durations).bubble_fraction
        assert bubble < simulate_timeline(build_schedule("1F1B", num_ranks, micro_batches)).bubble_fraction


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"durations": {F: -1.0}}, "durations map ActionKind to a finite time >= 0"),
        ({"durations": {"F": 1.0}}, "durations map ActionKind to a finite time >= 0"),
        ({"activation_bytes": {0: 10}}, r"activation_bytes gives no bytes for stages \[1\]"),
    ],
)
def test_timeline_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        simulate_timeline(build_schedule("1F1B", 2, 2), **kwargs)


def test_svg_parses_and_names_every_rank():
    timeline = simulate_timeline(build_schedule("Interleaved1F1B", 4, 4, 2))
    root = ET.fromstring(render_svg(timeline, title="Interleaved1F1B p=4 m=4 <v=2>"))
    texts = [element.text for element in root.iter("{http://www.w3.org/2000/svg}text")]
    assert all(f"rank {rank}" in texts for rank in range(4))
    title = root.find("{http://www.w3.org/2000/svg}title").text
    assert title.startswith("Interleaved1F1B p=4 m=4 <v=2>: 4 ranks") and f"{timeline.bubble_fraction:.1%}" in title
    boxes = [rect for rect in root.iter("{http://www.w3.org/2000/svg}rect") if rect.find("{*}title") is not None]
    assert len(boxes) == 4 * 2 * 4 * 2  # per rank: 2 stages x 4 micro-batches x (F, B)
    assert "F3" in texts and "B0" in texts


def test_verified_schedule_is_built_once_and_read_only():
    """A search compiles many candidates of one pipeline shape: the lowered, verified schedule is
    made once and shared, so no compile may change it."""
    from autopar.schedule import verified_schedule

    first = verified_schedule("ZBH1", 4, 8)
    assert first is verified_schedule("ZBH1", 4, 8)
    assert {rank: list(actions) for rank, actions in first.items()} == build_schedule("ZBH1", 4, 8)
    with pytest.raises(TypeError):
        first[0] = ()
    assert isinstance(first[0], tuple)


def test_a_measured_first_stage_without_input_gradient_spans_releases_its_stash_at_w():
    """A zero-bubble first stage makes no input gradient: its I runs nothing and the runner records
    no span for it, so the measured timeline releases each micro-batch at its W (as 1F1B's B)."""
    from autopar.schedule_timeline import Span, measured_timeline

    actions = [a for a in make_schedule("ZBH1", 2, 8)[0] if a.kind in (F, W)]  # rank 0 as it runs
    spans = {0: [Span(a, i, i + 0.5) for i, a in enumerate(actions)]}
    assert measured_timeline(spans).peak_stash == (2,)
