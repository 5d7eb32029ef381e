"""The executable schedule's values and one rank's verification (autopar/pipeline_lowering.py),
on a one-stage program of three pieces: its forward (ops 0-1), its backward (op 2) and the
update (op 3). Every fault names the action and why it may not run there."""

import pytest

from autopar.collective import CollectiveKey
from autopar.errors import ScheduleError
from autopar.pipeline_lowering import (
    ACCUMULATE,
    RECV,
    SEND,
    Piece,
    RankAction,
    Transfer,
    cut,
    link_ordered,
    lower,
    peers,
    verify_links,
    verify_rank,
)
from autopar.schedule import OPTIMIZER, UPDATE, Action, B, F, Phase

PIECES = (Piece(Phase(F, 0), (0, 1), F), Piece(Phase(B, 0), (2,), B), Piece(UPDATE, (3,), OPTIMIZER))


def _f(k):
    return RankAction(F, k, 0, 0)


def _b(k):
    return RankAction(B, k, 0, 1)


ACC = RankAction(ACCUMULATE, 1, 0)
OPT = RankAction(OPTIMIZER, 0, piece=2)


def test_cut_and_lower_a_schedule_without_transfers():
    phases = (Phase(F, 0), Phase(F, 0), Phase(B, 0), UPDATE)
    assert cut(phases, (), frozenset()) == PIECES
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1), Action(0, OPTIMIZER)]
    lowered = lower(actions, PIECES, 2)
    assert lowered == (_f(0), _f(1), _b(0), _b(1), ACC, OPT)
    assert [str(a) for a in lowered] == ["0F0#0", "0F1#0", "0B0#1", "0B1#1", "0ACC1", "OPT#2"]
    verify_rank(0, PIECES, lowered, 2)


def test_a_run_of_sources_joins_its_phases_compute():
    assert cut((Phase(F, 0),) * 3, (), frozenset({0, 2}))[0] == Piece(Phase(F, 0), (0, 1, 2), F)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RankAction(F, 0, 0), "a piece is run by the compute and collective kinds only"),
        (lambda: RankAction(SEND, 0, piece=1), "SEND and RECV, and only they, name their transfer"),
        (lambda: RankAction(F, 0, None, 0), "compute and ACCUMULATE name their stage"),
        (lambda: RankAction(ACCUMULATE, 1, 0, piece=0), "a piece is run by the compute and collective kinds only"),
        (lambda: RankAction("F", 0, 0, 0), "a rank action's kind is one of"),
        (lambda: Piece(Phase(F, 0), (0,), SEND), "a SEND piece needs collective"),
        (
            lambda: RankAction(SEND, 1, piece=1, transfer=Transfer(CollectiveKey("reshard", 3, 0, 0), 0, 1)),
            "SEND of micro-batch 1 names a transfer of another",
        ),
    ],
)
def test_bad_actions_are_refused(make, message):
    with pytest.raises(ScheduleError, match=message):
        make()


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        ((_f(0), _f(1), _b(0), _b(0), ACC, OPT), r"0B0#1 \(position 3\) runs its piece a second time"),
        ((_f(0), _f(1), _b(0), ACC, OPT), r"piece 1 of B0 never runs for micro-batch 1"),
        ((_f(0), _b(0), _b(1), _f(1), ACC, OPT), r"0B1#1 \(position 2\) runs before F0 of micro-batch 1 is done"),
        ((_f(0), _f(1), ACC, _b(0), _b(1), OPT), r"0ACC1 \(position 2\) runs before B0 of micro-batch 1 is done"),
        ((_f(0), _f(1), _b(0), _b(1), OPT, ACC), r"0ACC1 \(position 5\) runs after the update started"),
        ((_f(0), _f(1), _b(0), _b(1), OPT), r"stage 0's gradients of micro-batch 1 are never accumulated"),
        ((_f(0), _f(1), _b(0), _b(1), ACC, RankAction(OPTIMIZER, 1, piece=2)), "once per step"),
        ((_f(0), _f(1), _b(0), RankAction(F, 1, 0, 1), ACC, OPT), r"runs a B piece of B0"),
        ((_f(0), _f(2), _b(0), _b(1), ACC, OPT), "beyond the 2 of the step"),
    ],
)
def test_one_ranks_wrong_order_is_named(actions, message):
    with pytest.raises(ScheduleError, match=message):
        verify_rank(0, PIECES, actions, 2)


def _transfer(index, k, sender=0, receiver=1):
    return Transfer(CollectiveKey("reshard", index, 0, k), sender, receiver)


def _send(index, k):
    return RankAction(SEND, k, piece=0, transfer=_transfer(index, k))


def _recv(index, k):
    return RankAction(RECV, k, piece=1, transfer=_transfer(index, k))


def test_a_ranks_recvs_are_put_in_the_order_its_peer_sends():
    """Rank 0 sends micro-batch 1's value before micro-batch 0's second; rank 1, lowered alone,
    waits for micro-batch 0's second first: put in link order from its peer's list, its links
    checked in order. Only rank 1's recvs move (a peer's list is read for its sends)."""
    sender = (_send(3, 0), _send(3, 1), _send(4, 0), _send(4, 1))
    receiver = (_recv(3, 0), _recv(4, 0), _recv(3, 1), _recv(4, 1))
    assert peers(receiver) == (0, 1)
    with pytest.raises(ScheduleError, match="in-order link"):
        verify_links({0: sender, 1: receiver}, fifo=True)
    ordered = link_ordered(1, {0: sender, 1: receiver})
    assert ordered == (_recv(3, 0), _recv(3, 1), _recv(4, 0), _recv(4, 1))
    verify_links({0: sender, 1: ordered}, fifo=True)


def test_a_link_whose_ends_disagree_is_refused_when_a_rank_is_put_in_link_order():
    sender = (_send(3, 0), _send(3, 1))
    with pytest.raises(ScheduleError, match=r"rank 1 has no RECV of transfer reshard3.0.mb1 mb1 0->1"):
        link_ordered(1, {0: sender, 1: (_recv(3, 0),)})
    with pytest.raises(ScheduleError, match=r"rank 1: the link order needs the schedules of ranks \[0\]"):
        link_ordered(1, {1: (_recv(3, 0),)})
