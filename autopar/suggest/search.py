"""The candidates a search tries for a program on ``world`` devices (stage: strategy search).

A candidate is a mesh shape — data x tensor x pipeline parallelism, any factorisation of the
world, tensor parallelism innermost so that it stays inside a node; and, when the sequence is
long (the memory of attention's activations decides: :func:`autopar.suggest.annotations.long_sequence`),
context parallelism, the sequence split over a ``sep`` mesh dim between data and tensor; and,
when the program has stacked experts (:func:`autopar.suggest.annotations.expert_parameters`),
expert parallelism, the experts split by expert over an ``ep`` mesh dim after data, the batch
over data x expert (GShard's groups) — and
a Strategy: the ZeRO stage (with data parallelism), sequence parallelism (with tensor
parallelism), the context-parallel method (with context parallelism: every
``ContextParallel.method``; one compile refuses is kept among the skipped plans, with its
reason), recompute, and
for a pipeline the micro-batch count and schedule (the stage cut is automatic: balanced by
predicted time), without one the micro-batches gradients are accumulated over. A shape is skipped, with the reason kept, where the program cannot take it:
the batch does not divide over the data ranks, nothing is found to split over tensor ranks
(:mod:`.annotations`), fewer repeated layers than stages.

Fewer devices than the world: a world the program does not divide well (7 devices, a batch of
8) leaves every factorisation of it crippled (a 7-stage pipeline), while 4 of the 7 run data
parallel. So the search also tries the shapes on fewer devices that cannot grow
(:func:`largest`): each combination of a data and a tensor size the program takes, with as
many pipeline stages as still fit; a shape that can grow by a whole factor on the same world
is assumed no faster than the grown one (more of one kind of parallelism divides the
compute, its communication grows slower), except one device, which has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from autopar.mesh import ProcessMesh
from autopar.strategy import CONTEXT_PARALLEL_METHODS, ContextParallel, PipelineConfig, Strategy

SCHEDULES = ("1F1B", "ZBH1")


CONTEXT_DIM = "sep"  # the mesh dim context parallelism splits the sequence over (Paddle's name)
EXPERT_DIM = "ep"  # the mesh dim expert parallelism splits the stacked experts (and the batch) over


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of the data, tensor, pipeline, context (sequence) and expert dims of a mesh."""

    dp: int
    mp: int
    pp: int
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.mp * self.pp * self.cp * self.ep

    @property
    def data(self) -> int:
        """The ranks the batch is split over: data x expert (GShard's groups of tokens)."""
        return self.dp * self.ep

    def mesh(self) -> ProcessMesh:
        """The mesh: pipeline outermost, then data, expert (``ep``), context (``sep``), tensor
        innermost (neighbouring ranks: one node's); dims of size 1 left out (one dim at least)."""
        dims = (("pp", self.pp), ("dp", self.dp), (EXPERT_DIM, self.ep), (CONTEXT_DIM, self.cp), ("mp", self.mp))
        sizes = [(name, size) for name, size in dims if size > 1] or [("dp", 1)]
        ranks: list = list(range(self.world))
        for _, size in reversed(sizes[1:]):
            ranks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
        return ProcessMesh(ranks, [name for name, _ in sizes])

    def __str__(self) -> str:
        sizes = (("dp", self.dp), ("mp", self.mp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
        return " x ".join(f"{name}={size}" for name, size in sizes if size > 1) or "one device"


def shapes(world: int, context: Iterable[int] = (1,), experts: Iterable[int] = (1,)) -> Iterator[Shape]:
    """Every factorisation of ``world`` into dp x mp x pp x cp x ep, for each ``cp`` of
    ``context`` and ``ep`` of ``experts`` that divide it (default: none with context or expert
    parallelism)."""
    experts = list(experts)
    for cp in (c for c in context if world % c == 0):
        for ep in (e for e in experts if (world // cp) % e == 0):
            rest = world // (cp * ep)
            for mp in _divisors(rest):
                for pp in _divisors(rest // mp):
                    yield Shape(rest // (mp * pp), mp, pp, cp, ep)


def largest(world: int, data: Iterable[int], tensor: Iterable[int], takes: Callable[[Shape], bool]) -> list[Shape]:
    """The shapes on at most ``world`` devices, of ``data`` x ``tensor`` sizes and the most
    pipeline stages that ``takes`` accepts, that no other such shape contains (every size at
    least as large); one device (the plan without communication) always among them. Most
    devices first."""
    found = []
    for dp in data:
        for mp in tensor:
            stages = (pp for pp in range(world // (dp * mp), 0, -1) if takes(Shape(dp, mp, pp)))
            found += [Shape(dp, mp, pp) for pp in [next(stages, 0)] if pp]
    grown = [s for s in found if not any(o != s and o.dp >= s.dp and o.mp >= s.mp and o.pp >= s.pp for o in found)]
    if Shape(1, 1, 1) not in grown:
        grown.append(Shape(1, 1, 1))
    return sorted(grown, key=lambda s: (-s.world, s.mp, s.pp))


def most_stages(graph: Any) -> int:
    """The most pipeline stages the automatic cut can make of ``graph``'s forward layers (one
    per distinct layer path; :mod:`autopar.rewrites.pipeline_cut`)."""
    from autopar.graph import Role
    from autopar.layer_paths import path_of
    from autopar.op_kinds import SOURCE_OPS

    forward = [op for op in graph.ops if op.role is Role.FORWARD and op.name not in SOURCE_OPS and op.inputs]
    return max(len({path_of(op) for op in forward if path_of(op)}), 1)


def strategies(shape: Shape, batch: int, cluster: str | None) -> Iterator[Strategy]:
    """The strategies tried on ``shape`` for a global ``batch`` (see the module docstring)."""
    zero_stages = (0, 1, 2, 3) if shape.dp > 1 else (0,)
    sequence = (False, True) if shape.mp > 1 else (False,)
    context = [ContextParallel(CONTEXT_DIM, m) for m in CONTEXT_PARALLEL_METHODS] if shape.cp > 1 else [None]
    pipelines: list[PipelineConfig | None] = [None]
    rows = batch // shape.data
    if shape.pp > 1:  # p, 2p, 4p micro-batches, or one row each (Megatron's m = B / d: the least bubble)
        counts = sorted({m for m in (shape.pp, 2 * shape.pp, 4 * shape.pp, rows) if m >= shape.pp and rows % m == 0})
        pipelines = [PipelineConfig(micro_batches=m, schedule=s, stages=shape.pp) for m in counts for s in SCHEDULES]
    else:  # gradient accumulation: a few micro-batches, or one row each (Megatron's m = B / d)
        counts = sorted({m for m in (2, 4, rows) if 1 < m <= rows and rows % m == 0})
        pipelines += [PipelineConfig(micro_batches=m, schedule="1F1B", stages=1) for m in counts]
    for pipeline in pipelines:
        for recompute in (False, True):
            for sp in sequence:
                for cp in context:
                    for zero in zero_stages:
                        yield Strategy(zero_stage=zero, sequence_parallel=sp, recompute=recompute, pipeline=pipeline,
                                       cluster=cluster, context_parallel=cp)  # fmt: skip


def trades_time_for_memory(strategy: Strategy) -> bool:
    """Sequence parallelism, recompute, gradient accumulation: priced only where they may
    change the answer (the best shapes, or where nothing fits)."""
    return strategy.sequence_parallel or bool(strategy.recompute) or accumulates(strategy)


def accumulates(strategy: Strategy) -> bool:
    """Gradient accumulation (never faster: tried only where nothing fits)."""
    return strategy.pipeline is not None and strategy.pipeline.stages == 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
