"""RankRunner: one rank's scope, executor and host plan (shared by the simulator and Executor).

Built from the rank's :class:`~autopar.rank_plan.RankPlan` only. Feeds arrive as *global*
arrays and are sliced by the plan; fetches leave as this rank's local pieces (the caller
assembles them). Collectives are not run here: the runner stops at each one and lets its
driver (simulator or process-group executor) perform it, on numpy arrays
(:meth:`RankRunner.collective_input` / :meth:`~RankRunner.finish_collective`) or in place on
the scope's tensors (:meth:`RankRunner.scope_collective`: no copy through numpy).

Each segment runs through a :class:`~autopar.runtime.prepared.PreparedProgram` (its interpreter
built once).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from autopar.collective import Collective
from autopar.errors import AutoparError
from autopar.rank_plan import RankPlan, ValueKey
from autopar.runtime.device import current_device
from autopar.runtime.host_plan import HostPlan, build_host_plan, is_feed
from autopar.runtime.jobs import CollectiveCall, ScopeCall, Segment
from autopar.runtime.prepared import PreparedProgram

_RUNNERS = itertools.count()


class RankRunner:
    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None) -> None:
        import paddle

        self.plan = plan
        self.rank = plan.rank
        self.fetch_keys = list(fetch_keys)
        self.whole, positions = plan.fetch_sites(tuple(self.fetch_keys))
        self.exports = dict(zip(self.fetch_keys, positions))
        # a fetched feed is read from the feed dict (a feed variable cannot be exported by a segment)
        ops = list(plan.program.global_block().ops)
        self.fed = {k: str(ops[p].attrs()["name"]) for k, (p, _) in self.exports.items() if is_feed(ops[p])}
        prefix = f"autopar.r{next(_RUNNERS)}"  # runners of one rank share its scope, not their transients
        self.host: HostPlan = build_host_plan(plan, [pos for k, pos in self.exports.items() if k not in self.fed], prefix)
        self.scope = scope if scope is not None else paddle.static.Scope()
        self.device = current_device()
        self.place = self.device.place
        self.executor = paddle.static.Executor(self.place)  # start-up only (steps: self.prepared)
        self.prepared: dict[Hashable, PreparedProgram] = {}  # job -> its program's interpreter (run_program)
        self.position = 0
        self.feeds: dict[str, np.ndarray] = {}

    # ---- start-up and feeds ----------------------------------------------------------
    def run_startup(self) -> None:
        self.plan.run_startup(self.scope, self.executor)

    def set_feeds(self, feed: Mapping[str, Any]) -> None:
        """Slice each global feed to this rank's piece; check the global shape first. (The
        start of a step: the learning rate of a scheduled program is written here too.)"""
        self.feeds = self.plan.local_feeds(feed)
        if self.plan.learning_rate is not None:
            self.plan.learning_rate.write(self.scope, self.place)
        self.position = 0

    # ---- stepping ---------------------------------------------------------------------
    def run_until_collective(self) -> Collective | None:
        """Run segments until the next collective (returned) or the end (None)."""
        jobs = self.host.jobs
        while self.position < len(jobs) and isinstance(jobs[self.position], Segment):
            segment = jobs[self.position]
            missing = [n for n in segment.feeds if n not in self.feeds]
            if missing:
                raise AutoparError(f"rank {self.rank}: no feed given for {missing}")
            self.run_program(self.position, segment.program, {n: self.feeds[n] for n in segment.feeds})
            self.position += 1
        return jobs[self.position].collective if self.position < len(jobs) else None

    def run_program(self, key: Hashable, program: Any, feeds: Mapping[str, np.ndarray]) -> None:
        """Run ``program`` on the rank's scope through its interpreter, built on the first run
        and kept under ``key`` (a job's index)."""
        prepared = self.prepared.get(key)
        if prepared is None:
            prepared = self.prepared[key] = PreparedProgram(program, self.scope, self.place, in_order=self.device.ops_in_order)
        prepared.run(feeds)

    def collective_input(self) -> np.ndarray:
        """This rank's input to the collective it stopped at."""
        job = self.host.jobs[self.position]
        if job.from_feed:
            if job.input not in self.feeds:
                raise AutoparError(f"rank {self.rank}: no feed given for {job.input!r}")
            return self.feeds[job.input]
        return self.read(job.input)

    def scope_collective(self) -> ScopeCall | None:
        """The collective this runner stopped at with its scope tensors, for a communicator
        performing it in place (then call ``finish_collective(None)``); None when its input is a
        feed (not in the scope)."""
        job: CollectiveCall = self.host.jobs[self.position]
        if job.from_feed:
            return None
        source = self.scope.find_var(job.input)
        if source is None:
            raise AutoparError(f"rank {self.rank}: scope has no variable {job.input!r}")
        return ScopeCall(job.collective, source.get_tensor(), self.scope.var(job.output).get_tensor())

    def read(self, name: str) -> np.ndarray:
        var = self.scope.find_var(name)
        if var is None:
            raise AutoparError(f"rank {self.rank}: scope has no variable {name!r}")
        return np.array(var.get_tensor())

    def write(self, name: str, array: np.ndarray) -> None:

        self.scope.var(name).get_tensor().set(np.require(array, requirements="C"), self.place)  # keeps 0-d arrays 0-d

    def finish_collective(self, output: np.ndarray | None) -> None:
        job = self.host.jobs[self.position]
        if output is not None:
            self.write(job.output, output)
        self.position += 1

    # ---- results ---------------------------------------------------------------------
    def fetch_pieces(self) -> list[np.ndarray]:
        return [self.feeds[self.fed[k]] if k in self.fed else self.read(self.host.names[self.exports[k]]) for k in self.fetch_keys]

    def parameter_piece(self, name: str) -> np.ndarray:
        return self.read(name)
