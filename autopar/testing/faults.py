"""Fault injection: a DistributedProgram whose rank plans carry a deliberate bug, so that a test
can show ``autopar.check`` names the op where the first wrong value appears. Each fault is an
edit of the frozen :class:`~autopar.rank_plan.RankPlan` values the runtime reads (the compiled
program itself is left alone)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from autopar.collective import Collective
from autopar.distributed_program import DistributedProgram
from autopar.learning_rate import LearningRateSchedule
from autopar.rank_plan import RankPlan
from autopar.schedule import Phase

Edit = Callable[[RankPlan], RankPlan]
Match = Callable[[Collective], bool]


class FaultyProgram(DistributedProgram):
    """``dist`` (a DistributedProgram, shared) whose host rank plans pass through ``edit``."""

    def __init__(self, dist: DistributedProgram, edit: Edit) -> None:  # (not super().__init__: it shares dist's state)
        self.__dict__.update(dist.__dict__)
        self._correct, self._edit, self._faulty = dist, edit, {}

    def rank_plan(self, rank: int, backend: str = "host", after: str | None = None, fetches: Any = ()) -> RankPlan:
        if backend != "host" or after is not None:
            raise ValueError("a FaultyProgram runs its host rank plans as they are")
        key = (rank, tuple(fetches))
        if key not in self._faulty:
            self._faulty[key] = self._edit(self._correct.rank_plan(rank, fetches=fetches))
        return self._faulty[key]


def _collectives(plan: RankPlan, change: Callable[[Collective], Collective]) -> RankPlan:
    return dataclasses.replace(plan, collectives=tuple((change(c), position) for c, position in plan.collectives))


def collective_removed(match: Match) -> Edit:
    """The matching collectives do nothing: each member keeps its own input (a group of one)."""
    return lambda plan: _collectives(plan, lambda c: dataclasses.replace(c, group=(plan.rank,)) if match(c) else c)


def wrong_reduce(match: Match, reduce: str = "max") -> Edit:
    """The matching collectives reduce with ``reduce`` instead of their own op."""
    return lambda plan: _collectives(plan, lambda c: dataclasses.replace(c, reduce=reduce) if match(c) else c)


def wrong_piece(match: Match) -> Edit:
    """The matching collectives take their pieces in a rotated group order: a reduce_scatter
    hands each rank its neighbour's slice, an all_gather concatenates them out of order."""
    return lambda plan: _collectives(plan, lambda c: dataclasses.replace(c, group=c.group[1:] + c.group[:1]) if match(c) else c)


def run_in_phase(match: Match, phase: Callable[[RankPlan, int], Phase]) -> Edit:
    """Pipelines: the ops carrying the matching collectives run in another phase, ``phase(plan,
    position)`` (e.g. a gradient's send back in its backward, once per micro-batch)."""

    def edit(plan: RankPlan) -> RankPlan:
        phases = list(plan.pipeline.phases)
        for collective, position in plan.collectives:
            if match(collective):
                phases[position] = phase(plan, position)
        return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, phases=tuple(phases)))

    return edit


def not_updated_on(rank: int) -> Edit:
    """Rank ``rank`` trains at a learning rate of 0 (the optimizer's rate variable, written
    before each step): its replicas are never updated."""

    def edit(plan: RankPlan) -> RankPlan:
        if plan.rank != rank:
            return plan
        rates = [name for name in plan.scope_reads if name.startswith("learning_rate")]
        if len(rates) != 1:
            raise ValueError(f"rank {rank} reads {len(rates)} learning-rate variables: {rates}")
        return dataclasses.replace(plan, learning_rate=LearningRateSchedule(lambda: 0.0, rates[0]))

    return edit
