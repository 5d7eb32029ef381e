"""RankRunner: one rank's scope, executor and host plan (shared by the simulator and Executor).

Feeds arrive as *global* arrays and are sliced by the feeds' placements; fetches leave as
this rank's local pieces (the caller assembles them). Collectives are not run here: the
runner stops at each one and lets its driver (simulator or process-group executor) do it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.runtime.host_plan import HostPlan, build_host_plan
from autopar.runtime.jobs import CollectiveJob, Segment


def local_feeds(dist: Any, rank: int, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Each global feed sliced to ``rank``'s piece (the global shape is checked first)."""
    local = {}
    for name, array in feed.items():
        key = dist.key(name)
        value = dist.graph.values[key]
        array = np.asarray(array)
        if tuple(array.shape) != value.shape:
            raise AutoparError(f"feed {name!r} has shape {list(array.shape)}, the program declares {list(value.shape)}")
        local[name] = np.ascontiguousarray(array[dist.propagation.dist(key).local_slices(value.shape, rank)])
    return local


class RankRunner:
    def __init__(self, dist: Any, rank: int, fetch_keys: Sequence[ValueKey]) -> None:
        import paddle

        self.dist = dist
        self.rank = rank
        self.rank_program = dist.state.ranks[rank]
        self.fetch_keys = list(fetch_keys)
        ops = list(self.rank_program.program.global_block().ops)
        position = {op.id(): i for i, op in enumerate(ops)}
        self.exports = {}
        for key in self.fetch_keys:
            value = self.rank_program.current(key)
            self.exports[key] = (position[value.get_defining_op().id()], value.index())
        self.plan: HostPlan = build_host_plan(self.rank_program.program, self.rank_program.comm_ops, list(self.exports.values()))
        self.scope = paddle.static.Scope()
        self.executor = paddle.static.Executor(paddle.CPUPlace())
        self.position = 0
        self.feeds: dict[str, np.ndarray] = {}

    # ---- start-up and feeds ----------------------------------------------------------
    def run_startup(self) -> None:
        import paddle

        with paddle.static.scope_guard(self.scope):
            self.executor.run(self.dist.rank_startup_program(self.rank))

    def set_feeds(self, feed: Mapping[str, Any]) -> None:
        """Slice each global feed to this rank's piece; check the global shape first."""
        self.feeds = local_feeds(self.dist, self.rank, feed)
        self.position = 0

    # ---- stepping ---------------------------------------------------------------------
    def run_until_collective(self) -> CollectiveJob | None:
        """Run segments until the next collective (returned) or the end (None)."""
        import paddle

        jobs = self.plan.jobs
        while self.position < len(jobs) and isinstance(jobs[self.position], Segment):
            segment = jobs[self.position]
            missing = [n for n in segment.feeds if n not in self.feeds]
            if missing:
                raise AutoparError(f"rank {self.rank}: no feed given for {missing}")
            with paddle.static.scope_guard(self.scope):
                self.executor.run(segment.program, feed={n: self.feeds[n] for n in segment.feeds}, fetch_list=[])
            self.position += 1
        return jobs[self.position] if self.position < len(jobs) else None

    def step_key(self) -> tuple[int, int]:
        return self.plan.step_keys[self.position]

    def read(self, name: str) -> np.ndarray:
        var = self.scope.find_var(name)
        if var is None:
            raise AutoparError(f"rank {self.rank}: scope has no variable {name!r}")
        return np.array(var.get_tensor())

    def write(self, name: str, array: np.ndarray) -> None:
        import paddle

        self.scope.var(name).get_tensor().set(np.ascontiguousarray(array), paddle.CPUPlace())

    def finish_collective(self, output: np.ndarray | None) -> None:
        job = self.plan.jobs[self.position]
        if output is not None:
            self.write(job.output, output)
        self.position += 1

    # ---- results ---------------------------------------------------------------------
    def fetch_pieces(self) -> list[np.ndarray]:
        return [self.read(self.plan.names[self.exports[key]]) for key in self.fetch_keys]

    def parameter_piece(self, name: str) -> np.ndarray:
        return self.read(name)
