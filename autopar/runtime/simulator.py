"""The simulator backend: every rank's host plan in one process, collectives in memory.

Ranks advance in lockstep: each runs its segments up to its next collective; a collective is
performed once every member of its group waits on it (the same :class:`CollectiveKey`). If no
waiting collective can complete, the plans deadlock — reported with each rank's pending job.
Deterministic and fast enough for hypothesis tests over meshes of 1..8 ranks. It reads only
RankPlans (``dist.rank_plan(rank)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.collective_kinds import kind_of, perform, point_to_point, posted, received
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh
from autopar.pieces import assemble
from autopar.pipeline_lowering import verify_links
from autopar.rank_plan import RankPlan, ValueTable
from autopar.runtime.p2p import Inbox, check_message
from autopar.runtime.paddle_log import quiet_paddle_logs
from autopar.runtime.rank_runner import RankRunner
from autopar.runtime.replicas import digest, first_mismatch, generator_state, use_generator_state
from autopar.runtime.wire import record


@dataclass
class SimulationResult:
    fetches: list[list[np.ndarray]]  # per step, one global array per fetch
    parameters: dict[str, np.ndarray]  # name -> full array after the last step


def simulate(
    dist: Any, feeds: Sequence[Mapping[str, Any]], fetch_list: Sequence[Any] = (), load_from: Any = None, save_to: Any = None
) -> SimulationResult:
    """Run ``len(feeds)`` steps of ``dist`` on all ranks in this process (startup first), each
    rank on the plan the Executor runs for this fetch list (fetches made whole inside the
    program where it can). ``load_from``: a checkpoint directory loaded after the start-up, before the first step (saved
    on any mesh); ``save_to``: where to save one after the last step (:mod:`autopar.checkpoint`)."""
    _check_arguments(dist, feeds, fetch_list)
    keys = tuple(dist.key(item) for item in fetch_list)
    plans = {rank: dist.rank_plan(rank, fetches=keys) for rank in dist.mesh.ranks}
    return simulate_plans(plans, feeds, fetch_list, load_from=load_from, save_to=save_to)


def _check_arguments(dist: Any, feeds: Any, fetch_list: Any) -> None:
    if not (callable(getattr(dist, "rank_plan", None)) and isinstance(getattr(dist, "mesh", None), ProcessMesh)):
        raise AutoparError(f"simulate needs the DistributedProgram autopar.compile returned, got {type(dist).__name__}")
    if isinstance(feeds, Mapping):
        raise AutoparError("feeds must be a list of feed dicts, one per step; got one dict (pass [feed] for one step)")
    if isinstance(feeds, (str, bytes)) or not isinstance(feeds, Sequence):
        raise AutoparError(f"feeds must be a list of feed dicts, one per step; got {type(feeds).__name__}")
    for step, feed in enumerate(feeds):
        if not isinstance(feed, Mapping):
            raise AutoparError(f"feeds[{step}] must be a dict of feed name -> global array, got {type(feed).__name__}")
    if isinstance(fetch_list, (str, bytes)) or not isinstance(fetch_list, Sequence):
        raise AutoparError(f"fetch_list must be a list of Values or names, got {type(fetch_list).__name__}")


def simulate_plans(
    plans: Mapping[int, RankPlan], feeds: Sequence[Mapping[str, Any]], fetch_list: Sequence[Any] = (),
    load_from: Any = None, save_to: Any = None,
) -> SimulationResult:  # fmt: skip
    quiet_paddle_logs()
    values = next(iter(plans.values())).values
    keys = [values.key(item) for item in fetch_list]
    for key in keys:  # (before any step: a value that could only come back permuted is refused)
        values.info(key).check_fetchable()
    pipelined = {rank: plan.pipeline.steps for rank, plan in plans.items() if plan.pipeline is not None}
    if pipelined:  # every rank's executable schedule checked together before any runs, links in order
        verify_links(pipelined, fifo=True)
    runners = {rank: runner_for(plan, keys) for rank, plan in plans.items()}
    start_ranks(runners)
    if load_from is not None:
        from autopar.checkpoint import load_ranks

        load_ranks(load_from, plans, runners)
    fetches = []
    for feed in feeds:
        run_step(runners, feed)
        fetches.append(fetched(values, keys, runners))
    if save_to is not None:
        from autopar.checkpoint import save_ranks

        save_ranks(save_to, plans, runners)
    return SimulationResult(fetches, parameters(values, runners))


def runner_for(plan: RankPlan, keys: Sequence[Any], capture: bool = False) -> RankRunner:
    """The runner of a rank plan: a pipelined one walks its schedule (``capture``: keeping each
    key's piece per micro-batch, :meth:`PipelineRunner.captured`)."""
    if plan.pipeline is not None:
        from autopar.runtime.pipeline_runner import PipelineRunner

        return PipelineRunner(plan, keys, capture=capture)
    return RankRunner(plan, keys)


def start_ranks(runners: Mapping[int, RankRunner]) -> None:
    """Every rank's start-up, each drawing from the same generator state (the current one)."""
    start = generator_state()
    for runner in runners.values():
        use_generator_state(start)
        runner.run_startup()


def _point_to_point(runners: Mapping[int, RankRunner], pending: dict, mailbox: dict) -> bool:
    """Sends deposit their message on their link and go on (buffered, as the schedule's
    verifier assumes); a recv completes once a message is on its link, and takes the next one,
    which must be its own (:func:`autopar.runtime.p2p.check_message`): the host backend's rule
    (:class:`autopar.runtime.p2p.Inbox`, one per receiving rank). Whether any rank moved."""
    moved = False
    for rank in sorted(pending):
        job = pending[rank]
        while job is not None and point_to_point(job.kind):
            sender, receiver = job.group
            inbox = mailbox.setdefault(receiver, Inbox())
            if kind_of(job.kind).sends:
                inbox.put(sender, job.key, runners[rank].collective_input(), ordered=True)
                runners[rank].finish_collective(None)
            elif inbox.arrived(sender):
                tag, message = inbox.next(sender, timeout=0)
                check_message(job, tag)
                runners[rank].finish_collective(message)
            else:
                break
            job = pending[rank] = runners[rank].run_until_collective()
            moved = True
    return moved


def run_step(runners: Mapping[int, RankRunner], feed: Mapping[str, Any]) -> None:
    """One step of every rank on the global ``feed``, collectives performed in memory."""
    for runner in runners.values():
        runner.set_feeds(feed)
    pending = {rank: runner.run_until_collective() for rank, runner in runners.items()}
    mailbox: dict[int, Inbox] = {}  # receiving rank -> its messages
    while any(job is not None for job in pending.values()):
        if _point_to_point(runners, pending, mailbox):
            continue
        ready = None
        for rank in sorted(r for r, job in pending.items() if job is not None):
            job = pending[rank]
            if point_to_point(job.kind):
                continue
            if all(pending.get(member) is not None and pending[member].key == job.key for member in job.group):
                ready = job
                break
        if ready is None:
            stuck = "; ".join(f"rank {r}: {job.kind} over {list(job.group)} ({job.key})" for r, job in sorted(pending.items()) if job)
            raise AutoparError(f"the rank plans deadlock: {stuck}")
        inputs = {r: runners[r].collective_input() for r in ready.group}
        messages = {r: posted(ready, inputs[r], r) for r in ready.group}  # what each member puts on the wire
        for r in ready.group:
            record(ready, messages[r], r)
        if any(messages[r] is not inputs[r] for r in ready.group):  # a packed wire form (the uneven all_to_all)
            outputs = {r: received(ready, messages, inputs[r], r) for r in ready.group}
        else:  # (computed once for the group: an all_reduce's sum is not redone per member)
            outputs = perform(ready, inputs)
        for r in ready.group:
            runners[r].finish_collective(outputs.get(r))
            pending[r] = runners[r].run_until_collective()


def fetched(values: ValueTable, keys: Sequence[Any], runners: Mapping[int, RankRunner]) -> list[np.ndarray]:
    """The step's fetches as global arrays: each rank's whole copy where its program made them
    whole (the copies must agree, NaN equal to NaN: a diverged run returns its NaN, as the
    serial run does), else assembled from every rank's piece; in the serial program's order
    (a value carrying the sequence in zig-zag order is put back: ``ValueInfo.in_serial_order``)."""
    pieces = {rank: runner.fetch_pieces() for rank, runner in runners.items()}
    out = []
    for i, key in enumerate(keys):
        info = values.info(key)
        holders = [r for r in info.produced.mesh.ranks if runners[r].whole]
        if not holders:
            out.append(info.in_serial_order(gather(values, key, {r: got[i] for r, got in pieces.items()})))
            continue
        first = pieces[holders[0]][i]
        for rank in holders[1:]:
            if not np.array_equal(pieces[rank][i], first, equal_nan=True):  # (a diverged run's NaN loss is the same on every rank)
                raise AutoparError(f"simulate: fetched {info.label} differs between ranks {holders[0]} and {rank}")
        out.append(info.in_serial_order(first))
    return out


def gather(values: ValueTable, key: Any, pieces: Mapping[int, np.ndarray | None]) -> np.ndarray:
    """A serial value's global array from every rank's piece (as its producer makes it). A
    whole value that only some ranks of its mesh make in a pipeline (a state each stage keeps
    a copy of, as the loss scale: None where a stage's runner did not make it) is any made
    copy, checked equal to the others."""
    info = values.info(key)
    made = {r: p for r, p in pieces.items() if p is not None and r in info.produced.mesh.ranks}
    if len(made) < len(info.produced.mesh.ranks):
        if not made or info.produced.sharded_mesh_dims() or info.produced.partial:
            raise AutoparError(f"simulate: no rank made its piece of the fetched {info.label} ({info.produced})")
        first_rank, first = next(iter(made.items()))
        for rank, piece in made.items():
            if not np.array_equal(piece, first, equal_nan=True):
                raise AutoparError(f"simulate: fetched {info.label} differs between ranks {first_rank} and {rank}")
        return first
    return assemble(pieces, info.produced, info.shape, info.dtype)


def parameters(values: ValueTable, runners: Mapping[int, RankRunner]) -> dict[str, np.ndarray]:
    """Every parameter as a full array; first checks that replicated copies agree (parameters
    and optimizer states), instead of silently keeping one rank's copy."""
    digests = {rank: {n: digest(runner.read(n)) for n in runner.plan.copies()} for rank, runner in runners.items()}
    mismatch = first_mismatch(values, digests)
    if mismatch:
        raise AutoparError(f"simulate: {mismatch}")
    out = {}
    for name, key in values.named("parameter").items():
        info = values.info(key)
        pieces = {rank: runner.parameter_piece(name) for rank, runner in runners.items() if rank in info.placement.mesh.ranks}
        out[name] = assemble(pieces, info.placement, info.shape)
    return out
