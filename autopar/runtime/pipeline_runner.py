"""PipelineRunner: a pipelined rank's step, walked as its executable schedule (stage: runtime).

The rank plan carries the schedule already lowered onto its program
(:attr:`~autopar.rank_plan.PipelineRole.steps`, :mod:`autopar.pipeline_lowering`): the
program cut into pieces, and :class:`~autopar.pipeline_lowering.RankAction` values each running
one piece for one micro-batch — compute (``F`` / ``B`` / ``I`` / ``W`` / ``OPT``), ``SEND`` /
``RECV`` naming their transfer, bucket collectives, ``SYNC`` (a step-wide agreement of the
stages, dynamic loss scaling's found_inf: its collective runs like a bucket's), ``ACCUMULATE``. The runner checks the list
(:func:`~autopar.pipeline_lowering.verify_rank`) and walks it through one dispatch table keyed by
the action's kind; it derives nothing from the schedule itself.

A step splits each global feed into the micro-batches. A piece of micro-batch ``k`` runs its
jobs from micro-batch ``k``'s own copy of the host plan, whose values passed between jobs have
their own scope names (its activations stay in the rank's scope from its forward to its
backward, whatever runs in between). ``ACCUMULATE`` adds a micro-batch's gradients of a stage,
in the rank's scope, into micro-batch 0's (which the update reads), whatever order the backwards
ran in (zero-bubble defers weight gradients); the update runs once. A low-precision value (an O1
weight gradient before its cast to fp32, an O2 gradient) is summed in float32, as Megatron's and
Paddle's ``main_grad``: the runner keeps each one's float32 running sum over the step and writes
it back rounded once to the value's dtype (:class:`Float32Sums`), what the serial program's one
rounding of the whole batch's gradient is closest to (a bf16 sum would round every micro-batch's
partial sum again; this CPU build has no float16 ``add`` at all). (Measured: running the same
segments in one child scope per micro-batch instead fails inside Paddle's cached interpreters on
the second step.) Each transfer's collective is stamped with its micro-batch; the host backend's
recv takes the next message on its link and checks it carries that key
(:mod:`autopar.runtime.p2p`: the rank plan's recvs are in link order). Fetches add up their
micro-batches' pieces (a loss is a partial sum over them); values split over the micro-batches
are not fetched.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autopar.collective import Collective
from autopar.collective_kinds import kind_of
from autopar.errors import AutoparError
from autopar.feed_names import MICRO_BATCH_FEED, with_whole_batch_copies
from autopar.index_feeds import check_index_feed
from autopar.low_precision import STORAGE, is_low, narrow, widen
from autopar.pipeline_lowering import ACCUMULATE, PIECE_KINDS, RankAction, verify_rank
from autopar.rank_plan import RankPlan, ValueKey
from autopar.runtime.host_plan import HostPlan, build_host_plan
from autopar.runtime.jobs import Segment
from autopar.runtime.rank_runner import _RUNNERS, RankRunner
from autopar.schedule import COMPUTE_KINDS, OPTIMIZER, UPDATE, Action, ActionKind, B, F, I, W
from autopar.schedule_timeline import Span


class PipelineRunner(RankRunner):
    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None, capture: bool = False) -> None:
        """``capture``: keep every fetch key's piece of each micro-batch (:meth:`captured`),
        values split over the micro-batches and the update's own included (``autopar.check``)."""
        role = plan.pipeline
        verify_rank(plan.rank, role.pieces, role.steps, role.micro_batches)  # before anything is built or runs
        super().__init__(plan, fetch_keys, scope)
        self.role = role
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
        piece_of = {op: index for index, piece in enumerate(role.pieces) for op in piece.ops}
        self.fetched_by: dict[int, list[ValueKey]] = {}  # piece -> the fetch keys it makes (read once it ran)
        for key, position in self.exports.items():
            if position[0] >= 0:  # (>= 0: made here)
                self.fetched_by.setdefault(piece_of[position[0]], []).append(key)
        if capture:  # parameters and states, read by name: as the step leaves them, after the update's last piece
            last = max(i for i, piece in enumerate(role.pieces) if piece.phase == UPDATE)
            kept = [k for keys in self.fetched_by.values() for k in keys if plan.values.info(k).kind in ("parameter", "state")]
            self.fetched_by = {piece: [k for k in keys if k not in kept] for piece, keys in self.fetched_by.items()}
            self.fetched_by.setdefault(last, []).extend(kept)
        self.handlers: dict[ActionKind, Callable[[RankAction], Collective | None]] = {
            kind: self._run_piece for kind in PIECE_KINDS
        } | {ACCUMULATE: self._accumulate}
        self.micro_feeds: list[dict[str, np.ndarray]] = []
        self.adders: dict[tuple[int, int], Any] = {}  # (micro-batch, stage) -> its gradient-adding program (fp32 and wider)
        self.low_sums = Float32Sums()  # the step's float32 sums of low-precision accumulated values
        self.pieces: dict[ValueKey, list[np.ndarray]] = {}
        self.spans: list[Span] = []  # the last step's compute actions as they ran (start, end)
        self.job = 0  # the next job of the current action's piece
        self._began = self._waited = self._asked = 0.0

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
        copies = with_whole_batch_copies(feed, self.plan.program_feeds)  # a feed's whole-batch copy (rewrites/whole_feeds.py)
        for k in range(count):  # every micro-batch reads the whole batch's array
            micro[k].update({name: np.asarray(array) for name, array in copies.items() if feed.get(name) is not array})
        self.micro_feeds = [self.plan.local_feeds(m) for m in micro]
        if MICRO_BATCH_FEED in self.plan.program_feeds:  # its number (a training dropout picks its rows of the mask)
            for k, feeds in enumerate(self.micro_feeds):
                feeds[MICRO_BATCH_FEED] = np.array([k], dtype="int64")
        self.feeds = self.micro_feeds[-1]
        self.position = self.job = 0
        self.pieces, self.by_micro_batch = {}, {}
        self.low_sums = Float32Sums()
        self.spans, self._began = [], 0.0

    # ---- stepping ---------------------------------------------------------------------
    def _jobs(self, action: RankAction) -> tuple[int, ...]:
        return self.hosts[action.micro_batch].jobs_of.get(action.piece, ())

    def _job(self) -> tuple[Any, int]:
        action = self.role.steps[self.position]
        return self.hosts[action.micro_batch].jobs[self._jobs(action)[self.job]], action.micro_batch

    def run_until_collective(self) -> Collective | None:
        """Walk the actions from where the last collective left off: each by its kind's handler,
        which returns the collective the driver performs next, or None once the action is done."""
        steps = self.role.steps
        while self.position < len(steps):
            found = self.handlers[steps[self.position].kind](steps[self.position])
            if found is not None:
                self._asked = time.perf_counter()
                return found
            self.position, self.job = self.position + 1, 0
        return None

    def _run_piece(self, action: RankAction) -> Collective | None:
        """Run the action's piece for its micro-batch from job ``self.job`` on, up to its next
        collective; at its end, stash the fetches it made and close its span (compute only)."""
        jobs, host, k = self._jobs(action), self.hosts[action.micro_batch], action.micro_batch
        if self.job == 0:
            self._began, self._waited = time.perf_counter(), 0.0
        while self.job < len(jobs):
            job = host.jobs[jobs[self.job]]
            if not isinstance(job, Segment):
                return _stamped(job.collective, k)
            feeds = self.micro_feeds[k]
            self.run_program((k, jobs[self.job]), job.program, {n: feeds[n] for n in job.feeds})
            self.job += 1
        self._stash(action)
        if action.kind in COMPUTE_KINDS or action.kind is OPTIMIZER:  # time waiting on its collectives is idle, not work
            stage = action.stage if action.stage is not None else self.role.stage
            done = Action(stage, action.kind, None if action.kind is OPTIMIZER else k)
            start = self._began + self._waited
            if self.spans and self.spans[-1].action == done:  # one phase cut at its transfers: one span
                start = self.spans.pop().start
            self.spans.append(Span(done, start, time.perf_counter()))
        return None

    def _accumulate(self, action: RankAction) -> None:
        """Micro-batch ``k``'s values of a stage that the update reads, added into micro-batch 0's:
        float32 (and wider) ones by a Paddle add in the scope, low-precision ones in float32
        (:class:`Float32Sums`), micro-batch 0's copy rewritten as the rounded running sum."""
        k, stage = action.micro_batch, action.stage
        adder = self._adder(k, stage)
        if adder is not None:
            self.run_program(("add", k, stage), adder, {})
        for j in self._low_precision_accumulated(stage):
            total, part = self.hosts[0].accumulated[j], self.hosts[k].accumulated[j]
            dtype = _dtype_of(self.scope.find_var(total).get_tensor())
            self.write(total, self.low_sums.add(total, self.read(total), self.read(part), dtype))

    def _accumulated_of(self, stage: int) -> list[int]:
        """Indices into the host plans' ``accumulated`` of ``stage``'s values (F: a masked mean's
        sum and count; B / I / W: gradients)."""
        first = self.hosts[0]
        return [
            j for j, phase in enumerate(first.accumulated_phases) if phase.kind in (F, B, I, W) and phase.stage == stage
        ]  # fmt: skip

    def _low_precision_accumulated(self, stage: int) -> list[int]:
        """Those of :meth:`_accumulated_of` held in bfloat16 / float16 (micro-batch 0's copy, made
        by the time any ACCUMULATE of the stage runs)."""
        first = self.hosts[0]
        return [j for j in self._accumulated_of(stage) if is_low(_dtype_of(self.scope.find_var(first.accumulated[j]).get_tensor()))]

    def collectives(self) -> list[Collective]:
        """This rank's collectives of one step in the order it meets them, each stamped with its
        micro-batch (a recv checks the message it takes carries that key)."""
        return [
            _stamped(self.hosts[a.micro_batch].jobs[index].collective, a.micro_batch)
            for a in self.role.steps if a.piece is not None
            for index in self._jobs(a) if not isinstance(self.hosts[a.micro_batch].jobs[index], Segment)
        ]  # fmt: skip

    def _adder(self, micro_batch: int, stage: int) -> Any:
        """A program adding micro-batch ``micro_batch``'s values of ``stage`` that the update reads
        (gradients; a masked mean's sum and count, made in the forward) into micro-batch 0's in
        the scope (no copy through numpy); built on first use, when they exist. Low-precision
        values are not in it (summed in float32 by :meth:`_accumulate`); None when none is left."""
        import paddle

        if (micro_batch, stage) in self.adders:
            return self.adders[(micro_batch, stage)]
        first, this = self.hosts[0], self.hosts[micro_batch]
        low = set(self._low_precision_accumulated(stage))
        wide = [j for j in self._accumulated_of(stage) if j not in low]
        if not wide:
            self.adders[(micro_batch, stage)] = None
            return None
        program = paddle.static.Program()
        with paddle.static.program_guard(program):
            for j in wide:
                total = first.accumulated[j]
                tensor = self.scope.find_var(total).get_tensor()
                shape, dtype = list(tensor.shape()), str(np.array(tensor).dtype)
                whole = paddle.static.data(total, shape, dtype)
                part = paddle.static.data(this.accumulated[j], shape, dtype)
                whole.persistable = part.persistable = True  # read from the scope, not fed
                paddle._pir_ops.set_persistable_value(paddle.add(whole, part), total)
        self.adders[(micro_batch, stage)] = program
        return program

    def _stash(self, action: RankAction) -> None:
        for key in self.fetched_by.get(action.piece, ()):
            k = action.micro_batch
            piece = self.micro_feeds[k][self.fed[key]] if key in self.fed else self.read(self.hosts[k].names[self.exports[key]])
            self.pieces.setdefault(key, []).append(piece)
            if self.capture:
                self.by_micro_batch.setdefault(key, {})[k] = piece

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
        self.job += 1

    # ---- results ---------------------------------------------------------------------
    def fetch_pieces(self) -> list[np.ndarray | None]:
        """Each fetch's piece on this rank over the whole step (None: another stage makes it)."""
        out: list[np.ndarray | None] = []
        for key in self.fetch_keys:
            pieces = self.pieces.get(key)
            if not pieces:
                out.append(None)
            elif key in self.role.summed:
                out.append(sum_over_micro_batches(pieces, self.plan.values.info(key).dtype))
            else:
                out.append(pieces[-1])  # the same on every micro-batch
        return out


class Float32Sums:
    """One step's float32 running sums of low-precision values accumulated over micro-batches,
    by scope name. :meth:`add` widens both operands exactly, adds in float32 and returns the sum
    rounded once to the value's dtype (round to nearest even: :func:`autopar.low_precision.narrow`)
    for micro-batch 0's copy; the next :meth:`add` continues from the float32 sum, not from that
    rounding, so the update reads the whole step's sum rounded once. (A copy that is no longer
    the one last returned — written meanwhile — starts a new sum from it.)"""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (float32 sum, its rounding handed out)

    def add(self, name: str, total: np.ndarray, part: np.ndarray, dtype: str) -> np.ndarray:
        """``total`` (micro-batch 0's copy of ``name``, held as ``dtype`` is) plus ``part``,
        rounded to ``dtype``; the float32 sum is kept for the next micro-batch."""
        if total.dtype != STORAGE[dtype] or part.dtype != STORAGE[dtype]:
            raise AutoparError(f"accumulating {name!r} ({dtype}): held as {total.dtype} and {part.dtype}, expected {STORAGE[dtype]}")
        running, handed = self.sums.get(name, (None, None))
        if running is None or not np.array_equal(handed.view(np.uint8), total.view(np.uint8)):  # (bits: NaN too)
            running = widen(total, dtype)
        running = running + widen(part, dtype)
        rounded = narrow(running, dtype)
        self.sums[name] = (running, rounded)
        return rounded


def sum_over_micro_batches(pieces: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    """A fetched value's micro-batch pieces (a loss, a gradient) summed: a low-precision one
    (bfloat16 held as its uint16 bits, which are no numbers to add) in float32, rounded once to
    ``dtype`` as the update's accumulated gradients are."""
    if not is_low(dtype):
        return np.sum(np.stack(pieces), axis=0)
    dtype = str(dtype).removeprefix("paddle.")
    return narrow(np.sum(np.stack([widen(np.asarray(p), dtype) for p in pieces]), axis=0), dtype)


def _dtype_of(tensor: Any) -> str:
    """A scope tensor's dtype name (``"bfloat16"``; numpy shows its bits as uint16)."""
    return str(tensor._dtype()).removeprefix("paddle.")


def _stamped(collective: Collective, micro_batch: int) -> Collective:
    """``collective`` of micro-batch ``micro_batch``: every micro-batch runs the same jobs, so
    both ends tell their messages apart by this stamp in the key."""
    return dataclasses.replace(collective, key=dataclasses.replace(collective.key, micro_batch=micro_batch))
