"""PipelineRunner: a pipelined rank's step, walked as its schedule's actions (stage: runtime).

The rank's host plan is cut into phases (:class:`~autopar.schedule.Phase`: ``F0``, ``B1``, ...
per micro-batch, ``OPT`` once per step). A
step splits each global feed into the micro-batches, then follows the schedule: ``F`` / ``B``
of micro-batch ``k`` run that phase's jobs from micro-batch ``k``'s own copy of the host plan,
whose values passed between jobs have their own scope names (its activations stay in the
rank's scope from its forward to its backward, whatever runs in between); after a ``B`` the
gradients are kept per micro-batch; at ``OPT`` a small program adds them, in the rank's scope,
into micro-batch 0's (which the update reads), whatever order the backwards ran in (zero-bubble
defers weight gradients), and the update runs once. (Measured: running the same segments in one child scope
per micro-batch instead fails inside Paddle's cached interpreters on the second step.) The steps are the schedule's own actions in their order
(:meth:`PipelineRunner._steps`): a RECV action runs the recvs its phase starts with, a SEND
action the sends it ends with (p2p in the middle of a phase, where a cut inside a residual
block crosses twice, runs inside it); each is stamped with its micro-batch, and a recv takes the message of its own key (:mod:`autopar.runtime.p2p`), not the
next one on the link: the order of the messages need not be the same at both ends. Fetches add
up their micro-batches' pieces (a loss is a partial sum over them); values split over the
micro-batches are not fetched.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autopar.collective import Collective
from autopar.collective_kinds import kind_of
from autopar.errors import AutoparError
from autopar.feed_names import MICRO_BATCH_FEED, WHOLE_BATCH
from autopar.index_feeds import check_index_feed
from autopar.rank_plan import RankPlan, ValueKey
from autopar.runtime.host_plan import HostPlan, build_host_plan
from autopar.runtime.jobs import Segment
from autopar.runtime.rank_runner import _RUNNERS, RankRunner
from autopar.schedule import COMPUTE_KINDS, OPTIMIZER, RECV_F, RECV_KINDS, SEND_F, SEND_KINDS, UPDATE, B, F, I, Phase, W
from autopar.schedule_timeline import Span

Step = tuple[str, int, int]  # ("job", job, micro-batch), ("accumulate", stage, k), ("fetch", action, k),
# ("begin" / "end", action number, k): the timeline's spans


class PipelineRunner(RankRunner):
    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None, capture: bool = False) -> None:
        """``capture``: keep every fetch key's piece of each micro-batch (:meth:`captured`),
        values split over the micro-batches and the update's own included (``autopar.check``)."""
        super().__init__(plan, fetch_keys, scope)
        role = self.role = plan.pipeline
        self.capture = capture
        self.by_micro_batch: dict[ValueKey, dict[int, np.ndarray]] = {}
        for key in self.fetch_keys:
            if not capture and (key in role.split or key in self.fed):
                raise AutoparError(
                    f"fetching {plan.values.info(key).label} of a pipelined program: it is split over the micro-batches; "
                    "fetch values reduced over the batch (losses, metrics) or parameters"
                )
        exports = [position for key, position in self.exports.items() if key not in self.fed]  # (feeds: from the feed dict)
        self.hosts: list[HostPlan] = [self.host] + [
            build_host_plan(plan, exports, f"autopar.r{next(_RUNNERS)}.mb{k}") for k in range(1, role.micro_batches)
        ]
        self.jobs_of: dict[Phase, list[int]] = {}  # phase (F0, B2, OPT) -> job indices
        for index, label in enumerate(self.host.phases):
            self.jobs_of.setdefault(label, []).append(index)
        self.fetch_label = {k: role.phases[pos[0]] for k, pos in self.exports.items() if pos[0] >= 0}  # (>= 0: made here)
        if capture:  # parameters and states, read by name: as the step leaves them
            self.fetch_label |= {k: UPDATE for k in self.fetch_label if plan.values.info(k).kind in ("parameter", "state")}
        self.steps: list[Step] = self._steps()
        self.micro_feeds: list[dict[str, np.ndarray]] = []
        self.adders: dict[tuple[int, int], Any] = {}  # (micro-batch, stage) -> its gradient-adding program
        self.pieces: dict[ValueKey, list[np.ndarray]] = {}
        self.spans: list[Span] = []  # the last step's compute actions as they ran (start, end)
        self._began = self._waited = self._asked = 0.0

    def _steps(self) -> list[Step]:
        """The schedule's actions, in order, as the jobs they run: ``RECV_*`` the p2p recvs a
        phase starts with, ``F`` / ``B`` / ``I`` / ``W`` its compute (and any p2p in its
        middle: a cut inside a residual block crosses twice in one phase), ``SEND_*`` the sends
        it ends with, ``OPT`` the accumulation of every micro-batch's gradients and the update."""
        steps: list[Step] = []
        updated = False
        ends = {label: self._ends(jobs) for label, jobs in self.jobs_of.items()}
        # (phase, micro-batch, "in" (a recv) / "out" (a send)) a p2p action runs: only those edges leave the phase
        edges = {
            (self._p2p_phase(a), a.micro_batch, "in" if a.kind in RECV_KINDS else "out")
            for a in self.role.actions if a.kind in RECV_KINDS or a.kind in SEND_KINDS
        }  # fmt: skip
        for number, action in enumerate(self.role.actions):
            kind, k = action.kind, action.micro_batch
            if kind in COMPUTE_KINDS:
                label = Phase.of(action)
                leading, body, trailing = ends.get(label, ((), (), ()))
                body = (
                    (() if (label, k, "in") in edges else leading) + body + (() if (label, k, "out") in edges else trailing)
                )
                steps.append(("begin", number, k))
                steps += [("job", i, k) for i in body]
                steps.append(("fetch", number, k))
                steps.append(("end", number, k))
            elif kind in RECV_KINDS or kind in SEND_KINDS:
                leading, _, trailing = ends.get(self._p2p_phase(action), ((), (), ()))
                steps += [("job", i, k) for i in (leading if kind in RECV_KINDS else trailing)]
            elif kind is OPTIMIZER and not updated:  # one update for all the rank's stages
                updated = True
                steps.append(("begin", number, 0))
                stages = sorted({a.stage for a in self.role.actions if a.kind in (B, W)})
                steps += [("accumulate", stage, k) for stage in stages for k in range(1, self.role.micro_batches)]
                steps += [("job", i, 0) for i in self.jobs_of.get(UPDATE, [])]
                steps.append(("fetch", number, 0))
                steps.append(("end", number, 0))
        return steps

    def _ends(self, jobs: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """A phase's jobs as (the recvs it starts with, the rest, the sends it ends with)."""

        def receives(index: int) -> bool:
            job = self.host.jobs[index]
            return not isinstance(job, Segment) and kind_of(job.collective.kind).receives

        def sends(index: int) -> bool:
            job = self.host.jobs[index]
            return not isinstance(job, Segment) and kind_of(job.collective.kind).sends

        start, stop = 0, len(jobs)
        while start < stop and receives(jobs[start]):
            start += 1
        while stop > start and sends(jobs[stop - 1]):
            stop -= 1
        return tuple(jobs[:start]), tuple(jobs[start:stop]), tuple(jobs[stop:])

    def _p2p_phase(self, action: Any) -> Phase:
        """The phase whose edges a send / recv action runs: the forward's for ``*_F``, the
        backward's for ``*_B`` (zero-bubble: the input-gradient half's, or, on the first
        stage, which sends no input gradient, the weight-gradient half's)."""
        if action.kind in (SEND_F, RECV_F):
            return Phase(F, action.stage)
        phases = [Phase(kind, action.stage) for kind in (I, B, W)]
        return next((phase for phase in phases if phase in self.jobs_of), phases[1])

    # ---- feeds ------------------------------------------------------------------------
    def set_feeds(self, feed: Mapping[str, Any]) -> None:
        """Cut each global feed into the micro-batches, then each into this rank's piece; each
        micro-batch is also fed its number where the program reads it (``MICRO_BATCH_FEED``)."""
        if self.plan.learning_rate is not None:
            self.plan.learning_rate.write(self.scope, self.place)
        count = self.role.micro_batches
        feeds = self.plan.values.named("feed")
        micro: list[dict[str, Any]] = [{} for _ in range(count)]
        for name, array in feed.items():
            dim = self.role.feed_dims.get(name)
            array = np.asarray(array)
            check_index_feed(name, array, self.plan.values.index_uses.get(name, ()))  # (elements named in the whole batch)
            if name not in feeds or dim is None:
                for k in range(count):
                    micro[k][name] = array
                continue
            info = self.plan.values.info(feeds[name])
            rows = info.shape[dim] * count
            if array.ndim != len(info.shape) or array.shape[dim] != rows:
                declared = list(info.shape)
                declared[dim] = rows
                raise AutoparError(f"feed {name!r} has shape {list(array.shape)}, the program declares {declared}")
            for k, piece in enumerate(np.split(array, count, axis=dim)):
                micro[k][name] = piece
        for name in self.plan.program_feeds:  # a whole-batch copy of a feed (rewrites/whole_feeds.py): every micro-batch
            base = name.removesuffix(WHOLE_BATCH)
            if base != name and base in feed:
                for k in range(count):
                    micro[k][name] = np.asarray(feed[base])
        self.micro_feeds = [self.plan.local_feeds(m) for m in micro]
        if MICRO_BATCH_FEED in self.plan.program_feeds:  # its number (a training dropout picks its rows of the mask)
            for k, feeds in enumerate(self.micro_feeds):
                feeds[MICRO_BATCH_FEED] = np.array([k], dtype="int64")
        self.feeds = self.micro_feeds[-1]
        self.position = 0
        self.pieces, self.by_micro_batch = {}, {}
        self.spans, self._began = [], 0.0

    # ---- stepping ---------------------------------------------------------------------
    def _job(self) -> tuple[Any, int]:
        _, index, micro_batch = self.steps[self.position]
        return self.hosts[micro_batch].jobs[index], micro_batch

    def run_until_collective(self) -> Collective | None:

        while self.position < len(self.steps):
            what, index, micro_batch = self.steps[self.position]
            if what == "job":
                job, _ = self._job()
                if not isinstance(job, Segment):
                    self._asked = time.perf_counter()
                    return _stamped(job.collective, micro_batch)
                feeds = self.micro_feeds[micro_batch]
                self.run_program((micro_batch, index), job.program, {n: feeds[n] for n in job.feeds})
            elif what == "accumulate":  # every backward done: into micro-batch 0's names, which the update reads
                self.run_program(("add", micro_batch, index), self._adder(micro_batch, index), {})
            elif what == "begin":
                self._began, self._waited = time.perf_counter(), 0.0
            elif what == "end":  # time spent waiting on its collectives (a recv first of all) is idle, not work
                self.spans.append(Span(self.role.actions[index], self._began + self._waited, time.perf_counter()))
            elif what == "fetch":
                self._stash(index, micro_batch)
            self.position += 1
        return None

    def collectives(self) -> list[Collective]:
        """This rank's collectives of one step in the order it meets them, each stamped with its
        micro-batch: a message is matched to its recv by that key, not by its place on the link
        (a cut inside a residual block sends both ways within one backward)."""
        return [
            _stamped(self.hosts[k].jobs[index].collective, k)
            for what, index, k in self.steps
            if what == "job" and not isinstance(self.hosts[k].jobs[index], Segment)
        ]

    def _adder(self, micro_batch: int, stage: int) -> Any:
        """A program adding micro-batch ``micro_batch``'s values of ``stage`` that the update reads
        (gradients; a masked mean's sum and count, made in the forward) into micro-batch 0's in
        the scope (no copy through numpy); built on first use, when they exist."""
        import paddle

        found = self.adders.get((micro_batch, stage))
        if found is not None:
            return found
        first, this = self.hosts[0], self.hosts[micro_batch]
        program = paddle.static.Program()
        with paddle.static.program_guard(program):
            for j, total in enumerate(first.accumulated):
                phase = first.accumulated_phases[j]
                if phase.kind not in (F, B, I, W) or phase.stage != stage:  # (F: a masked mean's sum and count)
                    continue
                tensor = self.scope.find_var(total).get_tensor()
                shape, dtype = list(tensor.shape()), str(np.array(tensor).dtype)
                whole = paddle.static.data(total, shape, dtype)
                part = paddle.static.data(this.accumulated[j], shape, dtype)
                whole.persistable = part.persistable = True  # read from the scope, not fed
                paddle._pir_ops.set_persistable_value(paddle.add(whole, part), total)
        self.adders[(micro_batch, stage)] = program
        return program

    def _stash(self, number: int, micro_batch: int) -> None:
        action = self.role.actions[number]
        label = Phase.of(action)
        for key, found in self.fetch_label.items():
            if found != label:
                continue
            if key in self.fed:
                piece = self.micro_feeds[micro_batch][self.fed[key]]
            else:
                piece = self.read(self.hosts[micro_batch].names[self.exports[key]])
            self.pieces.setdefault(key, []).append(piece)
            if self.capture:
                self.by_micro_batch.setdefault(key, {})[micro_batch] = piece

    def captured(self) -> dict[ValueKey, dict[int, np.ndarray]]:
        """The last step's piece of each fetch key per micro-batch (one, numbered 0, for a value
        the update phase makes); empty unless built with ``capture``."""
        return self.by_micro_batch

    def collective_input(self) -> np.ndarray:
        job, micro_batch = self._job()
        if kind_of(job.collective.kind).receives:
            return np.zeros((0,), dtype="float32")  # a recv sends nothing
        if job.from_feed:
            return self.micro_feeds[micro_batch][job.input]
        return self.read(job.input)

    def finish_collective(self, output: np.ndarray | None) -> None:
        job, _ = self._job()
        self._waited += time.perf_counter() - self._asked
        if output is not None:
            self.write(job.output, output)
        self.position += 1

    # ---- results ---------------------------------------------------------------------
    def fetch_pieces(self) -> list[np.ndarray | None]:
        """Each fetch's piece on this rank over the whole step (None: another stage makes it)."""
        out: list[np.ndarray | None] = []
        for key in self.fetch_keys:
            pieces = self.pieces.get(key)
            if not pieces:
                out.append(None)
            elif key in self.role.summed:
                out.append(np.sum(np.stack(pieces), axis=0))
            else:
                out.append(pieces[-1])  # the same on every micro-batch
        return out


def _stamped(collective: Collective, micro_batch: int) -> Collective:
    """``collective`` of micro-batch ``micro_batch``: every micro-batch runs the same jobs, so
    both ends tell their messages apart by this stamp in the key."""
    return dataclasses.replace(collective, key=dataclasses.replace(collective.key, micro_batch=micro_batch))
