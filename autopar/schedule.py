"""Pipeline schedules as data (stage: pipeline scheduling).

A schedule is, per rank, the ordered list of :class:`Action` values the rank runs in one training
step (``2F0``: stage 2's forward of micro-batch 0). Data, not a loop inside a runtime, so that each
schedule is built, printed and *verified* before anything runs, for every rank in one process
(model: PyTorch's ``torch/distributed/pipelining/schedules.py``). Three pure steps: a generator
(:func:`make_schedule` by name) emits compute-only actions per rank; :func:`add_send_recv`, the
one lowering all schedules share, adds the sends and recvs; :func:`verify` checks the result
(complete, in dependency order, matched on every link, no deadlock by :func:`replay`, the one
simulator, which also times schedules for :mod:`autopar.schedule_timeline`).

Placement: ``num_ranks * virtual_stages`` stages, stage ``s`` on rank ``s % num_ranks`` (Megatron's
looping placement; one stage per rank without virtual stages).

Communication semantics (what :func:`verify` and :func:`replay` assume): each ordered pair of
ranks is one FIFO *link*, the k-th recv on a link takes the k-th send; a send is buffered (it
returns at once, like PyTorch's ``isend``); a recv blocks until its send is issued. A rank
runs these actions lowered onto its program (:mod:`autopar.pipeline_lowering`: the transfers
the program really makes, each named, verified again for all ranks together). Runtimes keep
the FIFO links these actions assume: a program whose stage boundary is crossed several times
per phase is lowered with its recvs put in link order (``in_link_order``, at compile, when
each rank plan is built), and a recv takes the next message on its link, checked to be its own
transfer (:mod:`autopar.runtime.p2p`, the simulator; NCCL's send / recv are in order too).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from types import MappingProxyType

from autopar.errors import ScheduleError

Schedule = dict[int, list["Action"]]
Link = tuple[int, int]  # (sending rank, receiving rank)


class ActionKind(str, Enum):
    """What an action does; the value is its text in ``str(action)``."""

    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients
    I = "I"  # noqa: E741  backward for the input gradient only (zero-bubble)
    W = "W"  # backward for the weight gradient only (zero-bubble)
    SEND_F = "SEND_F"  # send this stage's activation to the next stage
    RECV_F = "RECV_F"  # receive the previous stage's activation
    SEND_B = "SEND_B"  # send this stage's input gradient to the previous stage
    RECV_B = "RECV_B"  # receive the next stage's input gradient
    OPTIMIZER = "OPT"  # the stage's optimizer step, once per training step
    # executable only (a rank's lowered schedule, autopar.pipeline_lowering.RankAction): each
    # names what it moves or touches, never a stage-level abstraction
    SEND = "SEND"  # one transfer's sending half (its value, micro-batch and peer named)
    RECV = "RECV"  # ... and its receiving half
    ACCUMULATE = "ACC"  # add a micro-batch's gradients of a stage into micro-batch 0's
    REDUCE_GRAD = "REDUCE_GRAD"  # a gradient bucket's reduction (data-parallel sync, ZeRO scatter)
    UNSHARD = "UNSHARD"  # a ZeRO-3 gather of sharded parameters before their use
    RESHARD = "RESHARD"  # dropping the gathered copy again
    SYNC = "SYNC"  # a step-wide agreement of every rank (found_inf)

    def __str__(self) -> str:
        return self.value


F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
OPTIMIZER = ActionKind.OPTIMIZER
COMPUTE_KINDS = frozenset({F, B, I, W})
INPUT_GRAD_KINDS = frozenset({B, I})  # the backwards whose input gradient goes to the previous stage
SEND_KINDS = frozenset({SEND_F, SEND_B})
RECV_KINDS = frozenset({RECV_F, RECV_B})
_PAIR_KIND = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}
SCHEDULE_KINDS = COMPUTE_KINDS | SEND_KINDS | RECV_KINDS | {OPTIMIZER}  # what an abstract schedule's Action may do

class Phase(str):
    """What a rank runs for one compute action of its schedule: ``F0`` (stage 0's forward of a
    micro-batch), ``B1``, ``I1`` / ``W1`` (zero-bubble's halves), ``OPT`` (the update, once per
    step). Every op of a pipelined rank program has one. A str (printed, compared, a dict key),
    built from and read through its ``kind`` and ``stage``, never parsed."""

    kind: ActionKind
    stage: int | None

    def __new__(cls, kind: ActionKind, stage: int | None = None) -> Phase:
        if not isinstance(kind, ActionKind) or kind not in COMPUTE_KINDS | {OPTIMIZER}:
            raise ScheduleError(f"a phase is a compute action kind or OPT, got {kind!r}")
        if (kind is OPTIMIZER) != (stage is None) or (stage is not None and not _is_index(stage)):
            raise ScheduleError(f"a {kind.name} phase {'has no' if kind is OPTIMIZER else 'needs a'} stage, got {stage!r}")
        self = super().__new__(cls, kind.value if stage is None else f"{kind.value}{stage}")
        self.kind, self.stage = kind, stage
        return self

    def __reduce__(self) -> tuple[type, tuple[ActionKind, int | None]]:
        return Phase, (self.kind, self.stage)

    @classmethod
    def of(cls, action: Action) -> Phase:
        """The phase a compute or optimizer action runs."""
        return cls(action.kind, None if action.kind is OPTIMIZER else action.stage)

_ACTION_TEXT = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|OPT|F|B|I|W)(\d*)")


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of one rank: ``stage`` does ``kind`` on ``micro_batch`` (None only for OPTIMIZER).

    Prints ``2F0``, ``1SEND_F3``, ``0OPT``; :meth:`parse` inverts ``str``. Send / recv actions
    carry the *local* stage: ``1SEND_F3`` (rank of stage 1) pairs with ``2RECV_F3`` (rank of stage 2).
    """

    stage: int
    kind: ActionKind
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if not _is_index(self.stage):
            raise ScheduleError(f"Action stage must be an int >= 0, got {self.stage!r}")
        if not isinstance(self.kind, ActionKind) or self.kind not in SCHEDULE_KINDS:
            raise ScheduleError(f"Action kind must be an ActionKind of a schedule ({', '.join(sorted(k.value for k in SCHEDULE_KINDS))}), got {self.kind!r}")
        if self.kind is OPTIMIZER and self.micro_batch is not None:
            raise ScheduleError(f"the optimizer runs once per step, not per micro-batch; got {self.micro_batch!r}")
        if self.kind is not OPTIMIZER and not _is_index(self.micro_batch):
            raise ScheduleError(f"a {self.kind.name} action needs a micro_batch int >= 0, got {self.micro_batch!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.micro_batch is None else self.micro_batch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """Invert ``str``: ``"2F0"``, ``"1SEND_F3"``, ``"0OPT"``."""
        match = _ACTION_TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}; expected <stage><kind>[<micro_batch>], e.g. 2F0")
        stage, kind, micro_batch = match.groups()
        return Action(int(stage), ActionKind(kind), int(micro_batch) if micro_batch else None)


UPDATE = Phase(OPTIMIZER)  # the optimizer's phase, once per step


def stage_to_rank(stage: int, num_ranks: int) -> int:
    """The rank holding ``stage`` (looping placement)."""
    return stage % num_ranks


# ---- generators: compute-only actions per rank ---------------------------------------------


def _check_request(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> None:
    for what, value in (("num_ranks", num_ranks), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if not _is_index(value) or value < 1:
            raise ScheduleError(f"{name}: {what} must be an int >= 1, got {value!r}")


def _optimizers(rank: int, num_ranks: int, num_stages: int) -> list[Action]:
    return [Action(stage, OPTIMIZER) for stage in range(rank, num_stages, num_ranks)]


def fthenb(num_ranks: int, micro_batches: int) -> Schedule:
    """GPipe: every forward, then every backward (peak stash: all ``micro_batches``)."""
    _check_request("FThenB", num_ranks, micro_batches)
    return {
        rank: [Action(rank, kind, mb) for kind in (F, B) for mb in range(micro_batches)]
        + _optimizers(rank, num_ranks, num_ranks)
        for rank in range(num_ranks)
    }


def _one_f_one_b_order(num_ranks: int, micro_batches: int, rank: int, backward: ActionKind) -> list[Action]:
    """Warm-up forwards, then one forward / one backward, then the cool-down backwards."""
    warmup = min(num_ranks - rank - 1, micro_batches)
    actions = [Action(rank, F, mb) for mb in range(warmup)]
    for mb in range(micro_batches - warmup):
        actions += [Action(rank, F, warmup + mb), Action(rank, backward, mb)]
    return actions + [Action(rank, backward, mb) for mb in range(micro_batches - warmup, micro_batches)]


def one_f_one_b(num_ranks: int, micro_batches: int) -> Schedule:
    """1F1B: rank r runs ``min(p - r - 1, m)`` warm-up forwards, then alternates (peak stash p - r)."""
    _check_request("1F1B", num_ranks, micro_batches)
    return {
        rank: _one_f_one_b_order(num_ranks, micro_batches, rank, B) + _optimizers(rank, num_ranks, num_ranks)
        for rank in range(num_ranks)
    }


def zb_h1(num_ranks: int, micro_batches: int) -> Schedule:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B's order with each backward split into I and W.

    The I's keep 1F1B's places (the input gradient is the critical path); rank r defers the W's of
    its first r micro-batches to the end, where they fill the cool-down bubble. At most p
    micro-batches are in flight (F done, W not) on any rank and the stash (F done, I not) never
    exceeds 1F1B's: the same peak memory. With equal F, I, W times the bubble is
    ``(p - 1) / (3m + p - 1)`` for m >= p, a third of 1F1B's bubble time.
    """
    _check_request("ZBH1", num_ranks, micro_batches)
    schedule = {}
    for rank in range(num_ranks):
        deferred = min(rank, micro_batches)
        actions = []
        for action in _one_f_one_b_order(num_ranks, micro_batches, rank, I):
            actions.append(action)
            if action.kind is I and action.micro_batch >= deferred:
                actions.append(Action(rank, W, action.micro_batch))
        actions += [Action(rank, W, mb) for mb in range(deferred)]
        schedule[rank] = actions + _optimizers(rank, num_ranks, num_ranks)
    return schedule


def interleaved_1f1b(num_ranks: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds ``virtual_stages`` stages (model chunks).

    Micro-batches run in groups of ``num_ranks`` through one chunk after another; rank r runs
    ``2 (p - r - 1) + (v - 1) p`` warm-up forwards, then one forward / one backward (the backward
    visits the chunks in reverse). The bubble shrinks about v times against 1F1B's.
    """
    name = "Interleaved1F1B"
    _check_request(name, num_ranks, micro_batches, virtual_stages)
    if virtual_stages < 2:
        raise ScheduleError(f"{name} needs virtual_stages >= 2 (with 1 it is 1F1B), got {virtual_stages}")
    if micro_batches % num_ranks:
        raise ScheduleError(
            f"{name} needs micro_batches to be a multiple of num_ranks (Megatron's constraint: micro-batches "
            f"go through the stages in groups of num_ranks), got micro_batches={micro_batches}, num_ranks={num_ranks}"
        )
    total = micro_batches * virtual_stages
    group = num_ranks * virtual_stages

    def step(rank: int, k: int, kind: ActionKind) -> Action:
        chunk = (k % group) // num_ranks
        chunk = chunk if kind is F else virtual_stages - 1 - chunk
        return Action(chunk * num_ranks + rank, kind, (k // group) * num_ranks + k % num_ranks)

    schedule = {}
    for rank in range(num_ranks):
        warmup = min(2 * (num_ranks - rank - 1) + (virtual_stages - 1) * num_ranks, total)
        actions = [step(rank, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [step(rank, warmup + k, F), step(rank, k, B)]
        actions += [step(rank, k, B) for k in range(total - warmup, total)]
        schedule[rank] = actions + _optimizers(rank, num_ranks, num_ranks * virtual_stages)
    return schedule


SCHEDULES: Mapping[str, Callable[..., Schedule]] = {
    "FThenB": fthenb,
    "1F1B": one_f_one_b,
    "Interleaved1F1B": interleaved_1f1b,
    "ZBH1": zb_h1,
}


def make_schedule(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The compute-only schedule ``name`` (one of :data:`SCHEDULES`) for ``num_ranks`` ranks."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    if name == "Interleaved1F1B":
        return interleaved_1f1b(num_ranks, micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank: virtual_stages must be 1, got {virtual_stages!r}")
    return SCHEDULES[name](num_ranks, micro_batches)


def build_schedule(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """:func:`make_schedule`, lowered by :func:`add_send_recv` and checked by :func:`verify`."""
    num_stages = num_ranks * virtual_stages
    schedule = add_send_recv(make_schedule(name, num_ranks, micro_batches, virtual_stages), num_stages)
    verify(schedule, num_stages, micro_batches)
    return schedule


@lru_cache(maxsize=64)
def verified_schedule(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> Mapping[int, tuple[Action, ...]]:
    """:func:`build_schedule`, read-only, built once per arguments: a strategy search compiles
    many candidates with one pipeline shape (a 64-rank schedule of 512 micro-batches takes
    seconds to lower and verify)."""
    built = build_schedule(name, num_ranks, micro_batches, virtual_stages)
    return MappingProxyType({rank: tuple(actions) for rank, actions in built.items()})


# ---- lowering: add send / recv -----------------------------------------------------------


def _peer_stage(action: Action) -> int:
    """The stage at the other end of a send or recv."""
    return action.stage + 1 if action.kind in (SEND_F, RECV_B) else action.stage - 1


def _pair(action: Action) -> Action:
    """The other half of a send or recv: ``1SEND_F3`` <-> ``2RECV_F3``, ``2SEND_B3`` <-> ``1RECV_B3``."""
    return Action(_peer_stage(action), _PAIR_KIND[action.kind], action.micro_batch)


def _crosses_ranks(transfer: Action, num_stages: int, num_ranks: int) -> bool:
    peer = _peer_stage(transfer)
    return 0 <= peer < num_stages and stage_to_rank(peer, num_ranks) != stage_to_rank(transfer.stage, num_ranks)


def _transfer(action: Action, sending: bool, num_stages: int, num_ranks: int) -> Action | None:
    """The send after (``sending``) or the recv before a compute action, if its peer is another rank."""
    if action.kind is F:
        kind = SEND_F if sending else RECV_F
    elif action.kind in INPUT_GRAD_KINDS:
        kind = SEND_B if sending else RECV_B
    else:
        return None
    transfer = Action(action.stage, kind, action.micro_batch)
    return transfer if _crosses_ranks(transfer, num_stages, num_ranks) else None


def _link(send: Action, num_ranks: int) -> Link:
    return stage_to_rank(send.stage, num_ranks), stage_to_rank(_peer_stage(send), num_ranks)


def add_send_recv(schedule: Mapping[int, list[Action]], num_stages: int) -> Schedule:
    """Lower a compute-only schedule: add every cross-rank send and recv.

    A send goes right after the action producing its tensor (F: the activation; B or I: the input
    gradient; W never communicates), a recv right before the action consuming it. One exception
    keeps each link FIFO: if a rank consumes messages of one link in another order than they were
    sent, the recv of an earlier-sent message moves up to just before the later one's. That costs no
    waiting: by the time the later message is sent, the earlier one was.
    """
    num_ranks = len(schedule)
    with_sends: Schedule = {}
    for rank, actions in schedule.items():
        with_sends[rank] = []
        for action in actions:
            if action.kind not in COMPUTE_KINDS | {OPTIMIZER}:
                raise ScheduleError(f"rank {rank}: {action} in a compute-only schedule (add_send_recv adds transfers)")
            send = _transfer(action, True, num_stages, num_ranks)
            with_sends[rank] += [action] if send is None else [action, send]
    link_order: dict[Link, list[Action]] = defaultdict(list)
    for rank in sorted(with_sends):
        for send in (a for a in with_sends[rank] if a.kind in SEND_KINDS):
            link_order[_link(send, num_ranks)].append(send)
    position = {send: index for sends in link_order.values() for index, send in enumerate(sends)}
    received: dict[int, Counter[Link]] = defaultdict(Counter)  # per rank and link: messages taken

    def recvs_before(rank: int, action: Action) -> list[Action]:
        recv = _transfer(action, False, num_stages, num_ranks)
        if recv is None or _pair(recv) not in position:  # never sent: verify names it
            return [] if recv is None else [recv]
        link, taken = _link(_pair(recv), num_ranks), received[rank]
        recvs = [_pair(send) for send in link_order[link][taken[link] : position[_pair(recv)] + 1]]
        taken[link] += len(recvs)
        return recvs

    return {
        rank: [a for action in acts for a in (*recvs_before(rank, action), action)] for rank, acts in with_sends.items()
    }


# ---- verification --------------------------------------------------------------------------


def verify(schedule: Mapping[int, list[Action]], num_stages: int, micro_batches: int) -> None:
    """Check a lowered schedule before anything runs; raise :class:`ScheduleError` naming the fault.

    Checks, in order: every action valid and on its stage's rank; every (stage, micro_batch) has
    one F and one B (or one I and one W), every stage one OPTIMIZER; each send has its recv and
    each link carries them in one order; on each rank, data before use (F after its input is
    delivered, B / I after F and after the next stage's gradient is delivered, W after I, sends
    after their producer, OPTIMIZER after the stage's last weight gradient); no deadlock.
    """
    num_ranks = _check_layout(schedule, num_stages, micro_batches)
    _check_complete(schedule, num_stages, micro_batches)
    _check_links(schedule, num_ranks)
    for rank in range(num_ranks):
        _check_rank_order(rank, schedule[rank], num_stages, micro_batches)
    replay(schedule)


def _check_layout(schedule: Mapping[int, list[Action]], num_stages: int, micro_batches: int) -> int:
    num_ranks = len(schedule)
    if num_ranks < 1 or sorted(schedule) != list(range(num_ranks)):
        raise ScheduleError(f"a schedule maps ranks 0..p-1 to action lists, got ranks {sorted(schedule)}")
    if not _is_index(num_stages) or num_stages % num_ranks or not num_stages:
        raise ScheduleError(f"num_stages must be a positive multiple of the {num_ranks} ranks, got {num_stages!r}")
    for rank, actions in schedule.items():
        for action in actions:
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank}: {action!r} is not an Action")
            if action.stage >= num_stages or stage_to_rank(action.stage, num_ranks) != rank:
                raise ScheduleError(f"rank {rank}: {action} belongs to no stage of this rank")
            if action.micro_batch is not None and action.micro_batch >= micro_batches:
                raise ScheduleError(f"rank {rank}: {action} names a micro-batch beyond the {micro_batches} of the step")
            if action.kind in _PAIR_KIND and not _crosses_ranks(action, num_stages, num_ranks):
                raise ScheduleError(f"rank {rank}: {action} has no stage on another rank to talk to")
    return num_ranks


def _check_complete(schedule: Mapping[int, list[Action]], num_stages: int, micro_batches: int) -> None:
    num_ranks = len(schedule)
    seen = Counter(action for actions in schedule.values() for action in actions)
    for action, count in seen.items():
        if count > 1:
            raise ScheduleError(f"rank {action.stage % num_ranks}: {action} is duplicated ({count} times)")
    for stage in range(num_stages):
        rank = stage_to_rank(stage, num_ranks)
        for mb in range(micro_batches):
            f, b, i, w = (Action(stage, kind, mb) for kind in (F, B, I, W))
            if f not in seen:
                raise ScheduleError(f"rank {rank}: forward {f} is missing")
            if b in seen and (i in seen or w in seen):
                raise ScheduleError(f"rank {rank}: {b} and a split backward ({i} / {w}) both present")
            if b not in seen and not (i in seen and w in seen):
                raise ScheduleError(f"rank {rank}: backward {b} (or {i} and {w}) is missing")
        if Action(stage, OPTIMIZER) not in seen:
            raise ScheduleError(f"rank {rank}: optimizer {Action(stage, OPTIMIZER)} is missing")


def _check_links(schedule: Mapping[int, list[Action]], num_ranks: int) -> None:
    sent: dict[Link, list[Action]] = defaultdict(list)
    received: dict[Link, list[Action]] = defaultdict(list)  # as the sends they take
    for rank in sorted(schedule):
        for action in schedule[rank]:
            if action.kind in SEND_KINDS:
                sent[_link(action, num_ranks)].append(action)
            elif action.kind in RECV_KINDS:
                received[_link(_pair(action), num_ranks)].append(_pair(action))
    for link in sorted(sent.keys() | received.keys()):
        sends, recvs = sent[link], received[link]
        unreceived, unsent = set(sends) - set(recvs), set(recvs) - set(sends)
        for send in sends:
            if send in unreceived:
                raise ScheduleError(f"rank {link[0]}: {send} has no matching recv {_pair(send)} on rank {link[1]}")
        for send in recvs:
            if send in unsent:
                raise ScheduleError(f"rank {link[1]}: {_pair(send)} has no matching send {send} on rank {link[0]}")
        for index, (send, taken) in enumerate(zip(sends, recvs)):
            if send != taken:
                raise ScheduleError(
                    f"link rank {link[0]} -> rank {link[1]}: sends and recvs in different orders: message {index} is "
                    f"{send}, but rank {link[1]}'s recv {index} is {_pair(taken)} (a FIFO link would hand it the wrong tensor)"
                )


def _unmet(action: Action, done: set[Action], num_stages: int, micro_batches: int) -> str | None:
    """Why ``action`` cannot run yet on a rank that has run ``done``, or None."""
    stage, mb = action.stage, action.micro_batch
    if action.kind is F and stage > 0 and not {Action(stage, RECV_F, mb), Action(stage - 1, F, mb)} & done:
        return f"before stage {stage - 1}'s activation of micro-batch {mb} is delivered"
    if action.kind in INPUT_GRAD_KINDS:
        if Action(stage, F, mb) not in done:
            return f"before its forward {Action(stage, F, mb)}"
        got = {Action(stage, RECV_B, mb), Action(stage + 1, B, mb), Action(stage + 1, I, mb)} & done
        if stage < num_stages - 1 and not got:
            return f"before stage {stage + 1}'s input gradient of micro-batch {mb} is delivered"
    if action.kind is W and Action(stage, I, mb) not in done:
        return f"before its input-gradient backward {Action(stage, I, mb)}"
    if action.kind in SEND_KINDS:
        producers = [Action(stage, F, mb)] if action.kind is SEND_F else [Action(stage, B, mb), Action(stage, I, mb)]
        if not done & set(producers):
            return f"before {' / '.join(map(str, producers))} produced what it sends"
    if action.kind is OPTIMIZER:
        for m in range(micro_batches):
            if not {Action(stage, B, m), Action(stage, W, m)} & done:
                return f"before stage {stage}'s weight gradient of micro-batch {m} is done"
    return None


def _check_rank_order(rank: int, actions: list[Action], num_stages: int, micro_batches: int) -> None:
    done: set[Action] = set()
    for index, action in enumerate(actions):
        reason = _unmet(action, done, num_stages, micro_batches)
        if reason is not None:
            raise ScheduleError(f"rank {rank}: {action} (position {index}) runs {reason}")
        done.add(action)


# ---- replay: the one simulator -----------------------------------------------------------


def replay(
    schedule: Mapping[int, Sequence[Action]], durations: Mapping[ActionKind, float] | Callable[[Action], float] | None = None
) -> dict[int, list[tuple[float, float]]]:
    """Run every rank's list in order; per rank the (start, end) of each action.

    An action starts when its rank's previous one ends; a recv also not before the send it pairs
    with ends (sends are buffered and never wait). ``durations`` per kind, 0 for kinds not given,
    or per action (a callable: each stage its own times, as the pricing gives them). Raises
    :class:`ScheduleError` listing where each rank is stuck if no rank can progress (deadlock).
    """
    duration = durations if callable(durations) else (lambda action, times=durations or {}: times.get(action.kind, 0.0))
    times: dict[int, list[tuple[float, float]]] = {rank: [] for rank in schedule}
    clock = dict.fromkeys(schedule, 0.0)
    send_end: dict[Action, float] = {}
    waiting: dict[Action, int] = {}  # a send not made yet -> the rank whose recv waits for it
    ready = deque(schedule)  # (each rank runs until a recv blocks it, and again once its send is made: linear)
    while ready:
        rank = ready.popleft()
        actions, spans = schedule[rank], times[rank]
        while len(spans) < len(actions):
            action = actions[len(spans)]
            start = clock[rank]
            if action.kind in RECV_KINDS:
                send = _pair(action)
                if send not in send_end:
                    waiting[send] = rank
                    break
                start = max(start, send_end[send])
            clock[rank] = start + duration(action)
            spans.append((start, clock[rank]))
            if action.kind in SEND_KINDS:
                send_end[action] = clock[rank]
                if action in waiting:
                    ready.append(waiting.pop(action))
    stuck = []
    for rank, actions in schedule.items():
        if len(times[rank]) < len(actions):
            action, send = actions[len(times[rank])], _pair(actions[len(times[rank])])
            where = f"{action} (position {len(times[rank])})"
            stuck.append(f"rank {rank} is stuck at {where}, waiting for {send} from rank {send.stage % len(schedule)}")
    if stuck:
        raise ScheduleError("deadlock: no rank can progress; " + "; ".join(stuck))
    return times
