"""The candidates a search tries for a program on ``world`` devices (stage: strategy search).

A candidate is a mesh shape — data x tensor x pipeline parallelism, any factorisation of the
world, tensor parallelism innermost so that it stays inside a node — and a Strategy: the ZeRO
stage (with data parallelism), sequence parallelism (with tensor parallelism), recompute, and
for a pipeline the micro-batch count and schedule (the stage cut is automatic: balanced by
predicted time), without one the micro-batches gradients are accumulated over. A shape is skipped, with the reason kept, where the program cannot take it:
the batch does not divide over the data ranks, nothing is found to split over tensor ranks
(:mod:`.annotations`), fewer repeated layers than stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autopar.mesh import ProcessMesh
from autopar.strategy import PipelineConfig, Strategy

SCHEDULES = ("1F1B", "ZBH1")


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of the data, tensor and pipeline dims of a mesh."""

    dp: int
    mp: int
    pp: int

    @property
    def world(self) -> int:
        return self.dp * self.mp * self.pp

    def mesh(self) -> ProcessMesh:
        """The mesh: pipeline outermost, tensor innermost (neighbouring ranks: one node's); dims
        of size 1 left out (one dim at least)."""
        sizes = [(name, size) for name, size in (("pp", self.pp), ("dp", self.dp), ("mp", self.mp)) if size > 1] or [("dp", 1)]
        ranks: list = list(range(self.world))
        for _, size in reversed(sizes[1:]):
            ranks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
        return ProcessMesh(ranks, [name for name, _ in sizes])

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in (("dp", self.dp), ("mp", self.mp), ("pp", self.pp)) if size > 1) or "one device"


def shapes(world: int) -> Iterator[Shape]:
    """Every factorisation of ``world`` into dp x mp x pp."""
    for mp in _divisors(world):
        for pp in _divisors(world // mp):
            yield Shape(world // (mp * pp), mp, pp)


def strategies(shape: Shape, batch: int, cluster: str | None) -> Iterator[Strategy]:
    """The strategies tried on ``shape`` for a global ``batch`` (see the module docstring)."""
    zero_stages = (0, 1, 2, 3) if shape.dp > 1 else (0,)
    sequence = (False, True) if shape.mp > 1 else (False,)
    pipelines: list[PipelineConfig | None] = [None]
    rows = batch // shape.dp
    if shape.pp > 1:  # p, 2p, 4p micro-batches, or one row each (Megatron's m = B / d: the least bubble)
        counts = sorted({m for m in (shape.pp, 2 * shape.pp, 4 * shape.pp, rows) if m >= shape.pp and rows % m == 0})
        pipelines = [PipelineConfig(micro_batches=m, schedule=s, stages=shape.pp) for m in counts for s in SCHEDULES]
    else:  # gradient accumulation: a few micro-batches, or one row each (Megatron's m = B / d)
        counts = sorted({m for m in (2, 4, rows) if 1 < m <= rows and rows % m == 0})
        pipelines += [PipelineConfig(micro_batches=m, schedule="1F1B", stages=1) for m in counts]
    for pipeline in pipelines:
        for recompute in (False, True):
            for sp in sequence:
                for zero in zero_stages:
                    yield Strategy(zero_stage=zero, sequence_parallel=sp, recompute=recompute, pipeline=pipeline, cluster=cluster)


def trades_time_for_memory(strategy: Strategy) -> bool:
    """Sequence parallelism, recompute, gradient accumulation: priced only where they may
    change the answer (the best shapes, or where nothing fits)."""
    return strategy.sequence_parallel or bool(strategy.recompute) or accumulates(strategy)


def accumulates(strategy: Strategy) -> bool:
    """Gradient accumulation (never faster: tried only where nothing fits)."""
    return strategy.pipeline is not None and strategy.pipeline.stages == 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
