"""A pipelined rank's executable schedule: the verified schedule lowered onto its program
(stage: stage-split per rank -> executable schedule; built with the RankPlan, before any runner).

:mod:`autopar.schedule` plans the step in stage-level actions (``1F0``, ``1RECV_F0``, ``0OPT``)
for the whole pipeline. A rank's program knows more: which ops each phase holds, and where its
transfers sit (a cut inside a residual block crosses the stage boundary in the middle of a
backward). :func:`lower` joins the two, once, at compile time:

- the program is cut into :class:`Piece` values: a phase's ops between its transfers, and each
  transfer or gradient bucket op on its own;
- the schedule becomes a tuple of :class:`RankAction` values, each running one piece for one
  micro-batch: compute (``F`` / ``B`` / ``I`` / ``W`` / ``OPT``), ``SEND`` / ``RECV`` naming their
  :class:`Transfer` (value, micro-batch, sender, receiver), ``REDUCE_GRAD`` / ``UNSHARD`` for
  gradient buckets, ``SYNC`` for a step-wide agreement of every stage (dynamic loss scaling's
  found_inf, all-reduced over the stages in the update phase), and ``ACCUMULATE`` (micro-batch ``k``'s gradients of a stage added into
  micro-batch 0's, which the update reads). A RECV action of the schedule runs the recvs its
  phase starts with, a SEND action the sends it ends with; a transfer in the middle of a phase
  runs where it sits.

:func:`verify_rank` checks one rank's list (every piece once per micro-batch, a phase's pieces
in program order, forward before backward before the weight half, each accumulation after its
backward, the update last); :func:`verify_links` checks all ranks' lists together (every send
received once; no deadlock when sends are buffered and a recv waits for its transfer; with
``fifo``, each link's recvs in its sends' order). The runner walks the list and re-derives
nothing (:mod:`autopar.runtime.pipeline_runner`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.collective import Collective, CollectiveKey
from autopar.collective_kinds import kind_of
from autopar.errors import ScheduleError
from autopar.schedule import (
    COMPUTE_KINDS,
    OPTIMIZER,
    RECV_F,
    RECV_KINDS,
    SEND_F,
    SEND_KINDS,
    UPDATE,
    Action,
    ActionKind,
    B,
    F,
    I,
    Phase,
    W,
)

SEND, RECV = ActionKind.SEND, ActionKind.RECV
ACCUMULATE, REDUCE_GRAD, UNSHARD = ActionKind.ACCUMULATE, ActionKind.REDUCE_GRAD, ActionKind.UNSHARD
RESHARD, SYNC = ActionKind.RESHARD, ActionKind.SYNC
Link = tuple[int, int]  # (sending rank, receiving rank)
TRANSFER_KINDS = frozenset({SEND, RECV})
COLLECTIVE_KINDS = TRANSFER_KINDS | {REDUCE_GRAD, UNSHARD, RESHARD, SYNC}  # a piece of one collective op
PIECE_KINDS = COMPUTE_KINDS | {OPTIMIZER} | COLLECTIVE_KINDS  # the kinds that run a piece
SYNC_SOURCE = "sync"  # the key source of a step-wide agreement (passes/pipeline_split.py: found_inf)


@dataclass(frozen=True, slots=True)
class Piece:
    """Ops of the rank program one action runs (positions, program order), cut at compile time:
    a phase's compute between its transfers, or (``collective``) one transfer or bucket op."""

    phase: Phase
    ops: tuple[int, ...]
    kind: ActionKind  # the phase's kind for compute, else the collective's action kind
    collective: Collective | None = None

    def __post_init__(self) -> None:
        if (self.collective is None) != (self.kind not in COLLECTIVE_KINDS):
            raise ScheduleError(f"a {self.kind.name} piece {'needs' if self.collective is None else 'has no'} collective")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message of one step: the collective's key (stamped with the micro-batch) from
    ``sender`` to ``receiver``; ``value`` labels the serial value it moves."""

    key: CollectiveKey
    sender: int
    receiver: int
    value: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.value or self.key} mb{self.key.micro_batch} {self.sender}->{self.receiver}"


@dataclass(frozen=True, slots=True, repr=False)
class RankAction:
    """One step of a rank's executable schedule: ``kind`` runs piece ``piece`` for ``micro_batch``
    (0 for the once-per-step update); ``ACCUMULATE`` runs no piece but adds ``stage``'s
    gradients of ``micro_batch`` into micro-batch 0's. Prints ``1F0#3``, ``SEND[%4 mb1 0->1]#5``,
    ``1ACC2``, ``OPT#9``."""

    kind: ActionKind
    micro_batch: int
    stage: int | None = None
    piece: int | None = None
    transfer: Transfer | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind) or self.kind not in PIECE_KINDS | {ACCUMULATE}:
            raise ScheduleError(f"a rank action's kind is one of {sorted(k.name for k in PIECE_KINDS | {ACCUMULATE})}, got {self.kind!r}")
        if (self.kind in PIECE_KINDS) != (self.piece is not None):
            raise ScheduleError(f"{self.kind.name}: a piece is run by the compute and collective kinds only, got piece={self.piece!r}")
        if (self.kind in TRANSFER_KINDS) != (self.transfer is not None):
            raise ScheduleError(f"{self.kind.name}: SEND and RECV, and only they, name their transfer")
        if self.transfer is not None and self.transfer.key.micro_batch != self.micro_batch:
            raise ScheduleError(f"{self.kind.name} of micro-batch {self.micro_batch} names a transfer of another: {self.transfer}")
        if (self.kind in COMPUTE_KINDS | {ACCUMULATE}) != (self.stage is not None):
            raise ScheduleError(f"{self.kind.name}: compute and ACCUMULATE name their stage, others do not; got stage={self.stage!r}")

    def __str__(self) -> str:
        piece = "" if self.piece is None else f"#{self.piece}"
        if self.transfer is not None:
            return f"{self.kind.value}[{self.transfer}]{piece}"
        if self.stage is None:
            return f"{self.kind.value}{piece}"
        return f"{self.stage}{self.kind.value}{self.micro_batch}{piece}"

    __repr__ = __str__

    def at(self, position: int) -> str:
        return f"{self} (position {position})"


# ---- lowering ------------------------------------------------------------------------------


def _collective_kind(collective: Collective) -> ActionKind | None:
    """The action a collective op of a phase is, when it is one of its own: a transfer, a
    gradient bucket (a reduction, or ZeRO's gather), or a step-wide agreement (SYNC); None: it
    runs inside the compute."""
    kind = kind_of(collective.kind)
    if kind.sends:
        return SEND
    if kind.receives:
        return RECV
    if collective.key.source == "bucket":
        return UNSHARD if kind.gathers else REDUCE_GRAD
    if collective.key.source == SYNC_SOURCE:
        return SYNC
    return None


def cut(phases: Sequence[Phase], collectives: Sequence[tuple[Collective, int]], free: frozenset[int]) -> tuple[Piece, ...]:
    """Each phase's ops as pieces in program order, cut at its transfers and buckets. ``free``:
    positions of ops every program piece re-makes or re-reads (parameters, feeds, constants);
    a run of those alone joins the next compute piece of its phase (else the previous)."""
    comm_at = {position: collective for collective, position in collectives}
    ops_of: dict[Phase, list[int]] = {}
    for position, phase in enumerate(phases):
        ops_of.setdefault(phase, []).append(position)
    ops_of.setdefault(UPDATE, [])
    pieces: list[Piece] = []
    for phase, ops in ops_of.items():
        runs: list[tuple[list[int], Collective | None]] = [([], None)]
        for position in ops:
            collective = comm_at.get(position)
            if collective is not None and _collective_kind(collective) is not None:
                runs += [([position], collective), ([], None)]
            else:
                runs[-1][0].append(position)
        runs = _join_free(runs, free)
        pieces += [
            Piece(phase, tuple(members), phase.kind if c is None else _collective_kind(c), c) for members, c in runs
        ]  # fmt: skip
    return tuple(pieces)


def _join_free(runs: list[tuple[list[int], Collective | None]], free: frozenset[int]) -> list[tuple[list[int], Collective | None]]:
    """Compute runs that are empty or hold only ``free`` ops join their phase's next compute run
    (else the previous one); a phase of no compute at all keeps one (possibly empty) run."""
    compute = [i for i, (members, c) in enumerate(runs) if c is None]
    real = [i for i in compute if any(p not in free for p in runs[i][0])]
    if not real:  # no compute of its own: keep what ops there are (none: one empty run, if no collective either)
        real = [i for i in compute if runs[i][0]] or ([] if len(compute) < len(runs) else compute[:1])
        return [run for i, run in enumerate(runs) if run[1] is not None or i in real]
    for i in compute:
        if i in real:
            continue
        target = next((j for j in real if j > i), real[-1])
        runs[target] = (sorted(runs[target][0] + runs[i][0]), None)
    return [run for i, run in enumerate(runs) if run[1] is not None or i in real]


def lower(actions: Sequence[Action], pieces: Sequence[Piece], micro_batches: int) -> tuple[RankAction, ...]:
    """The rank's verified schedule ``actions`` as actions running ``pieces`` (see the module
    docstring): a RECV action runs the recvs its phase starts with, a SEND action the sends it
    ends with, a compute action the rest of its phase; the first OPT action the accumulations
    and the update (once for all the rank's stages)."""
    elements: dict[Phase, list[int]] = defaultdict(list)
    for index, piece in enumerate(pieces):
        elements[piece.phase].append(index)

    def transfer_phase(action: Action) -> Phase:
        """The phase whose edges a stage-level send / recv runs: the forward's for ``*_F``, the
        backward's for ``*_B`` (zero-bubble: the input-gradient half's, or, on the first stage,
        which sends no input gradient, the weight-gradient half's)."""
        if action.kind in (SEND_F, RECV_F):
            return Phase(F, action.stage)
        candidates = [Phase(kind, action.stage) for kind in (I, B, W)]
        return next((phase for phase in candidates if phase in elements), candidates[1])

    def ends(phase: Phase) -> tuple[list[int], list[int], list[int]]:
        members = elements.get(phase, [])
        start, stop = 0, len(members)
        while start < stop and pieces[members[start]].kind is RECV:
            start += 1
        while stop > start and pieces[members[stop - 1]].kind is SEND:
            stop -= 1
        return members[:start], members[start:stop], members[stop:]

    edges = {
        (transfer_phase(a), a.micro_batch, a.kind in RECV_KINDS) for a in actions if a.kind in SEND_KINDS | RECV_KINDS
    }  # fmt: skip
    out: list[RankAction] = []
    updated = False
    for action in actions:
        k = action.micro_batch
        if action.kind in COMPUTE_KINDS:
            phase = Phase.of(action)
            leading, body, trailing = ends(phase)
            run = ([] if (phase, k, True) in edges else leading) + body + ([] if (phase, k, False) in edges else trailing)
            out += [_action(pieces, i, k) for i in run]
        elif action.kind in RECV_KINDS:
            out += [_action(pieces, i, k) for i in ends(transfer_phase(action))[0]]
        elif action.kind in SEND_KINDS:
            out += [_action(pieces, i, k) for i in ends(transfer_phase(action))[2]]
        elif action.kind is OPTIMIZER and not updated:
            updated = True
            stages = sorted({a.stage for a in actions if a.kind in (B, W)})
            out += [RankAction(ACCUMULATE, m, stage) for stage in stages for m in range(1, micro_batches)]
            out += [_action(pieces, i, 0) for i in elements[UPDATE]]
    return tuple(out)


def _action(pieces: Sequence[Piece], index: int, micro_batch: int) -> RankAction:
    piece = pieces[index]
    collective = piece.collective
    if piece.kind in TRANSFER_KINDS:
        key = dataclasses.replace(collective.key, micro_batch=micro_batch)
        sender, receiver = collective.group
        return RankAction(piece.kind, micro_batch, piece=index, transfer=Transfer(key, sender, receiver, collective.value))
    stage = piece.phase.stage if piece.kind in COMPUTE_KINDS else None
    return RankAction(piece.kind, micro_batch, stage, index)


# ---- verification --------------------------------------------------------------------------


def verify_rank(rank: int, pieces: Sequence[Piece], actions: Sequence[RankAction], micro_batches: int) -> None:
    """Check one rank's executable schedule before it runs; raise :class:`ScheduleError` naming
    the action: each piece run once per micro-batch (the update's once), a phase's pieces in
    program order (a recv, which reads nothing, may run earlier), ``F`` before ``B`` / ``I``
    before ``W`` of one micro-batch, each
    ``ACCUMULATE`` after its micro-batch's backward of the stage, the update after everything
    else."""
    where: dict[tuple[int, int], int] = {}  # (piece, micro-batch) -> position
    for position, action in enumerate(actions):
        _check_action(rank, pieces, action, position, micro_batches)
        if action.piece is not None:
            if (action.piece, action.micro_batch) in where:
                raise ScheduleError(f"rank {rank}: {action.at(position)} runs its piece a second time for micro-batch {action.micro_batch}")
            where[(action.piece, action.micro_batch)] = position
    phases_run = {pieces[p].phase for p, _ in where} | {UPDATE}  # (a phase of another stage's ops may never run here)
    ran_phases = {(phase, k) for phase in phases_run for k in (range(micro_batches) if phase != UPDATE else (0,))}
    members_of: dict[Phase, list[int]] = defaultdict(list)
    for i, piece in enumerate(pieces):
        members_of[piece.phase].append(i)
    for phase, k in sorted(ran_phases, key=str):
        members = members_of[phase]
        missing = [i for i in members if (i, k) not in where]
        if missing:
            raise ScheduleError(f"rank {rank}: piece {missing[0]} of {phase} never runs for micro-batch {k}")
        for n, later in enumerate(members):  # (a recv reads nothing: it may run before the pieces preceding it)
            for earlier in members[:n]:
                if pieces[later].kind is not RECV and where[(later, k)] < where[(earlier, k)]:
                    after, before = where[(later, k)], where[(earlier, k)]
                    raise ScheduleError(f"rank {rank}: {actions[after].at(after)} runs before {actions[before]}, which comes first in {phase}")
    span: dict[tuple[Phase, int], tuple[int, int]] = {}  # (phase, micro-batch) -> its first and last position (recvs aside)
    for (piece, k), position in where.items():
        if pieces[piece].kind is not RECV:
            first, last = span.get((pieces[piece].phase, k), (position, position))
            span[(pieces[piece].phase, k)] = (min(first, position), max(last, position))
    for (phase, k), (first, _) in span.items():
        for earlier in _needs(phase):
            if (earlier, k) in span and span[(earlier, k)][1] > first:
                raise ScheduleError(f"rank {rank}: {actions[first].at(first)} runs before {earlier} of micro-batch {k} is done")
    _check_update(rank, pieces, actions, span, micro_batches)


def _check_action(rank: int, pieces: Sequence[Piece], action: RankAction, position: int, micro_batches: int) -> None:
    if not isinstance(action, RankAction):
        raise ScheduleError(f"rank {rank}: {action!r} (position {position}) is not a RankAction")
    if not 0 <= action.micro_batch < micro_batches:
        raise ScheduleError(f"rank {rank}: {action.at(position)} names a micro-batch beyond the {micro_batches} of the step")
    if action.piece is None:
        return
    if not 0 <= action.piece < len(pieces):
        raise ScheduleError(f"rank {rank}: {action.at(position)} names no piece of the program ({len(pieces)} pieces)")
    piece = pieces[action.piece]
    if piece.kind is not action.kind:
        raise ScheduleError(f"rank {rank}: {action.at(position)} runs a {piece.kind.name} piece of {piece.phase}")
    if piece.phase == UPDATE and action.micro_batch:
        raise ScheduleError(f"rank {rank}: {action.at(position)} runs a piece of the update, once per step (micro-batch 0)")


def _needs(phase: Phase) -> tuple[Phase, ...]:
    """The phases of the same stage and micro-batch that must be done before ``phase`` starts."""
    if phase.kind in (B, I):
        return (Phase(F, phase.stage),)
    if phase.kind is W:
        return Phase(F, phase.stage), Phase(I, phase.stage)
    return ()


def _check_update(
    rank: int, pieces: Sequence[Piece], actions: Sequence[RankAction], span: Mapping[tuple[Phase, int], tuple[int, int]], micro_batches: int
) -> None:
    """Each ACCUMULATE once, after its stage's phases of its micro-batch; the update after all."""
    update = [p for p, a in enumerate(actions) if a.piece is not None and pieces[a.piece].phase == UPDATE]
    first_update = update[0] if update else len(actions)
    seen: set[tuple[int, int]] = set()
    done: dict[tuple[int | None, int], tuple[int, Phase]] = {}  # (stage, micro-batch) -> its last piece's position
    for (phase, k), (_, last) in span.items():
        if (phase.stage, k) not in done or done[(phase.stage, k)][0] < last:
            done[(phase.stage, k)] = (last, phase)
    for position, action in enumerate(actions):
        if position > first_update and (action.piece is None or pieces[action.piece].phase != UPDATE):
            raise ScheduleError(f"rank {rank}: {action.at(position)} runs after the update started ({actions[first_update]})")
        if action.kind is not ACCUMULATE:
            continue
        if action.micro_batch == 0 or (action.stage, action.micro_batch) in seen:
            raise ScheduleError(f"rank {rank}: {action.at(position)}: each stage adds micro-batches 1.. once into micro-batch 0's")
        seen.add((action.stage, action.micro_batch))
        last, phase = done.get((action.stage, action.micro_batch), (-1, None))
        if last > position:
            raise ScheduleError(f"rank {rank}: {action.at(position)} runs before {phase} of micro-batch {action.micro_batch} is done")
    backward = {phase.stage for phase, _ in span if phase.kind in (B, I, W)}
    for stage in sorted(backward):
        for k in range(1, micro_batches):
            if (stage, k) not in seen:
                raise ScheduleError(f"rank {rank}: stage {stage}'s gradients of micro-batch {k} are never accumulated (ACCUMULATE)")


def verify_links(schedules: Mapping[int, Sequence[RankAction]], fifo: bool = False) -> None:
    """Check every rank's executable schedule together before any runs: each SEND has its one
    RECV on the receiver and the other way round; replayed with buffered sends and recvs that
    wait for their transfer, every rank gets to its end (no deadlock); ``fifo`` (a backend whose
    links deliver in order: NCCL's send / recv), each link's recvs come in its sends' order."""
    sent, received = _links(schedules)
    for link in sorted(sent.keys() | received.keys()):
        _check_link(link, sent[link], received[link], fifo)
    _replay_transfers(schedules)


def _links(schedules: Mapping[int, Sequence[RankAction]]) -> tuple[dict[Link, list[Transfer]], dict[Link, list[Transfer]]]:
    """Each link's transfers in the order its sender sends them, and in the order its receiver
    receives them (checking each transfer is its rank's half)."""
    sent: dict[Link, list[Transfer]] = defaultdict(list)
    received: dict[Link, list[Transfer]] = defaultdict(list)
    for rank in sorted(schedules):
        for action in schedules[rank]:
            transfer = action.transfer
            if transfer is None:
                continue
            if rank != (transfer.sender if action.kind is SEND else transfer.receiver):
                raise ScheduleError(f"rank {rank}: {action} is not this rank's half of its transfer")
            (sent if action.kind is SEND else received)[(transfer.sender, transfer.receiver)].append(transfer)
    return sent, received


def _check_link(link: Link, sends: Sequence[Transfer], recvs: Sequence[Transfer], fifo: bool) -> None:
    for transfer in set(sends) ^ set(recvs):
        rank, half = (link[1], "RECV") if transfer in set(sends) else (link[0], "SEND")
        raise ScheduleError(f"rank {rank} has no {half} of transfer {transfer}")
    for transfer in {t for t in sends if sends.count(t) > 1} | {t for t in recvs if recvs.count(t) > 1}:
        raise ScheduleError(f"transfer {transfer} is made more than once on link rank {link[0]} -> rank {link[1]}")
    if fifo and list(sends) != list(recvs):
        index = next(i for i, (s, r) in enumerate(zip(sends, recvs)) if s != r)
        raise ScheduleError(
            f"link rank {link[0]} -> rank {link[1]}: message {index} is {sends[index]}, but rank {link[1]}'s recv {index} "
            f"waits for {recvs[index]} (an in-order link would hand it the wrong tensor)"
        )


def peers(actions: Sequence[RankAction]) -> tuple[int, ...]:
    """The ranks at the other end of a rank's transfers (its own rank included when it sends
    to itself: two virtual stages on one rank)."""
    ends = {rank for a in actions if a.transfer is not None for rank in (a.transfer.sender, a.transfer.receiver)}
    return tuple(sorted(ends))


def link_ordered(rank: int, schedules: Mapping[int, Sequence[RankAction]]) -> tuple[RankAction, ...]:
    """``rank``'s executable schedule with its recvs in the order its links carry the messages
    (:func:`in_link_order`), from its own list and those of the ranks it exchanges with
    (``schedules``: at least :func:`peers`; a peer's list may be link-ordered already or not:
    only its sends are read, which ordering never moves). Then ``rank``'s links are checked:
    every transfer made once at both ends, its incoming links in order (``fifo``); the other
    ends check theirs when their plans are built, and all ranks together (deadlock included)
    are checked by :func:`verify_links` before a simulation."""
    needed = set(peers(schedules[rank])) | {rank}
    missing = sorted(needed - set(schedules))
    if missing:
        raise ScheduleError(f"rank {rank}: the link order needs the schedules of ranks {missing}, which it exchanges with")
    ordered = in_link_order({r: schedules[r] for r in needed})[rank]
    sent, received = _links({r: ordered if r == rank else schedules[r] for r in needed})
    for link in sorted(sent.keys() | received.keys()):
        if rank in link:
            _check_link(link, sent[link], received[link], fifo=link[1] == rank)
    return ordered


def in_link_order(schedules: Mapping[int, Sequence[RankAction]]) -> dict[int, tuple[RankAction, ...]]:
    """Every rank's schedule with its recvs in the order their links carry the messages (the
    order the senders send them), as a backend whose links deliver in order needs (NCCL): where a
    rank would take a link's messages in another order, the recv of an earlier-sent message moves
    up to just before the later one's. A recv reads nothing, and by the time the later message
    is sent the earlier one was: that costs no waiting (the rule of
    :func:`autopar.schedule.add_send_recv`, applied to the transfers a program really makes)."""
    link_order: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for rank in sorted(schedules):
        for action in schedules[rank]:
            if action.kind is SEND:
                link_order[(action.transfer.sender, action.transfer.receiver)].append(action.transfer)
    out: dict[int, tuple[RankAction, ...]] = {}
    for rank, actions in schedules.items():
        recv_of = {a.transfer: a for a in actions if a.kind is RECV}
        taken: dict[tuple[int, int], int] = defaultdict(int)
        placed: set[Transfer] = set()
        ordered: list[RankAction] = []
        for action in actions:
            if action.kind is RECV:
                if action.transfer in placed:
                    continue
                link = (action.transfer.sender, action.transfer.receiver)
                sends = link_order[link]
                stop = sends.index(action.transfer) + 1 if action.transfer in sends else taken[link]
                for transfer in sends[taken[link] : stop]:
                    if transfer in recv_of and transfer not in placed:
                        ordered.append(recv_of[transfer])
                        placed.add(transfer)
                taken[link] = max(taken[link], stop)
                if action.transfer not in placed:  # (never sent: verify_links names it)
                    ordered.append(action)
                    placed.add(action.transfer)
                continue
            ordered.append(action)
        out[rank] = tuple(ordered)
    return out


def _replay_transfers(schedules: Mapping[int, Sequence[RankAction]]) -> None:
    done = dict.fromkeys(schedules, 0)
    delivered: set[Transfer] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in schedules.items():
            while done[rank] < len(actions):
                action = actions[done[rank]]
                if action.kind is RECV and action.transfer not in delivered:
                    break
                if action.kind is SEND:
                    delivered.add(action.transfer)
                done[rank] += 1
                progressed = True
    stuck = [f"rank {rank} waits at {actions[done[rank]].at(done[rank])}" for rank, actions in schedules.items() if done[rank] < len(actions)]
    if stuck:
        raise ScheduleError("deadlock: no rank can progress; " + "; ".join(stuck))
