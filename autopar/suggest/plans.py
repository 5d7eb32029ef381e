"""The plans a search found, as values and as the table a person reads (stage: strategy search).

A :class:`Plan` is one candidate priced; :class:`Suggestions` the ranked list. The cost model is
not exact (benchmarks/RESULTS.md, the measured rankings: predicted and measured steps agree in order, not to
the percent), so plans whose predicted steps are within :data:`TIE` of each other are a tie, not
a ranking: they share a rank (``Suggestions.ranks``; printed ``1=``), and the table says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.compile import compile as compile_program
from autopar.dist_attr import DistAttr
from autopar.graph import ValueKey
from autopar.mesh import ProcessMesh
from autopar.pricing import Price
from autopar.strategy import Strategy
from autopar.suggest.search import Shape
from autopar.suggest.tables import SkippedPlans, strategy_words
from autopar.units import format_bytes, format_time

TIE = 0.05  # plans whose steps are within this fraction of a faster one's share its rank


@dataclass(frozen=True)
class Plan:
    """One candidate: a mesh, the annotations applied, a Strategy, and its predicted price."""

    shape: Shape
    mesh: ProcessMesh
    strategy: Strategy
    placements: Mapping[ValueKey, DistAttr] = field(repr=False)
    price: Price
    budget: int  # bytes per rank
    split: str  # what the annotations split, in words
    program: Any = field(repr=False, compare=False)
    startup_program: Any = field(repr=False, compare=False)
    analysis: Any = field(repr=False, compare=False)
    world: int = 0  # devices the search had (0: the plan's own); a plan may leave some idle
    precision: str = "float32"  # what it was priced in (the program's own dtypes, or the mixed precision asked)

    @property
    def devices(self) -> str:
        """``"4 of 7 devices"`` (or ``"4 devices"`` when it uses them all)."""
        n = self.shape.world
        return f"{n} of {self.world} devices" if self.world > n else f"{n} device{'s' if n > 1 else ''}"

    @property
    def idle(self) -> int:
        """Devices of the world this plan leaves idle."""
        return max(self.world - self.shape.world, 0)

    @property
    def fits(self) -> bool:
        return self.price.memory <= self.budget

    def compile(self) -> Any:
        """The DistributedProgram of this plan (the program is compiled with the plan's
        annotations; it is not annotated). A float32 program priced in mixed precision
        (``precision="bf16"``) compiles as the float32 program it is."""
        return compile_program(self.program, self.mesh, self.startup_program, self.strategy, analysis=self.analysis)

    @property
    def features(self) -> str:
        return strategy_words(self.strategy)

    @property
    def why(self) -> str:
        """One paragraph: what each rank holds and runs, where the time goes, the memory."""
        p, s = self.price, self.shape
        parts = []
        if s.dp > 1:
            parts.append(f"the batch is split over {s.dp} data-parallel ranks (one gradient sync per step)")
        if s.mp > 1:
            parts.append(f"{self.split} over {s.mp} tensor-parallel ranks of one node")
        if s.pp > 1:
            parts.append(f"the layers are cut into {s.pp} pipeline stages balanced by predicted time")
        if s.ep > 1:
            parts.append(f"the stacked experts are split over {s.ep} expert-parallel ranks, the batch over data x expert "
                         "(tokens dispatched to their experts' ranks and combined back)")  # fmt: skip
        if s.cp > 1:
            context = self.strategy.context_parallel
            how = (f"attention by {context.method}" if context is not None
                   else "attention reads k and v gathered whole each layer")  # fmt: skip
            parts.append(f"the sequence is split over {s.cp} context-parallel ranks ({how})")
        if self.strategy.zero_stage:
            what = {1: "optimizer states", 2: "optimizer states and gradients", 3: "optimizer states, gradients and parameters"}
            parts.append(f"ZeRO-{self.strategy.zero_stage} shards the {what[self.strategy.zero_stage]} over the data ranks")
        if self.strategy.sequence_parallel:
            parts.append("sequence parallelism splits the activations between tensor-parallel regions")
        if self.strategy.recompute:
            parts.append("each layer's activations are recomputed in the backward instead of kept")
        if self.strategy.pipeline is not None and self.strategy.pipeline.stages == 1:
            m = self.strategy.pipeline.micro_batches
            parts.append(f"gradients are accumulated over {m} micro-batches (one micro-batch's activations held at a time)")
        head = "; ".join(parts) or "one device runs the whole program"
        if self.idle:
            head = f"uses {self.devices} ({self.idle} left idle); {head}"
        room = "fits" if self.fits else "does NOT fit"
        return (
            f"{head[0].upper()}{head[1:]}. Step {format_time(p.step)} = compute {format_time(p.compute)} + "
            f"communication {format_time(p.communication)} + bubble {format_time(p.bubble)}; "
            f"{format_bytes(p.sent)} sent per step; peak {format_bytes(p.memory)} per rank "
            f"({format_bytes(p.parameter_memory)} parameters, gradients and optimizer states), which {room} "
            f"in {format_bytes(self.budget)}."
        )

    def row(self) -> tuple[str, ...]:
        p = self.price
        mesh = f"{self.shape} ({self.devices})" if self.idle else str(self.shape)
        return (mesh, self.features, format_time(p.step), format_time(p.compute), format_time(p.communication),
                format_time(p.bubble), format_bytes(p.memory), "yes" if self.fits else "no")  # fmt: skip

    def __str__(self) -> str:
        return f"{self.shape} [{self.features}]: {self.why}"


class Suggestions(list):
    """The ranked plans (a list of :class:`Plan`: those that fit by predicted step, then the
    others by memory), with what the search did: ``searched`` candidates priced, ``pruned`` by
    memory before compiling, ``skipped`` shapes and why, ``seconds`` it took; ``ranks``: each
    plan's rank (plans within ``tolerance`` of the first plan of a rank share it; None: does not
    fit), ``notes``: what the search could not do (nothing fits, ...). ``str()`` is a table."""

    searched: int = 0
    pruned: int = 0
    precision: str = "float32"  # what every plan was priced in: the program's own dtypes, or the mixed precision asked
    seconds: float = 0.0
    skipped: SkippedPlans = SkippedPlans()
    notes: tuple[str, ...] = ()
    tolerance: float = TIE

    @property
    def ranks(self) -> tuple[int | None, ...]:
        """Each plan's rank: 1 for the best and every plan whose step is within ``tolerance`` of
        it, then the next plan's position (1, 1, 3, ...); None for a plan that does not fit."""
        out: list[int | None] = []
        lead: float | None = None
        for i, plan in enumerate(self):
            if not plan.fits:
                out.append(None)
            elif lead is not None and out[-1] is not None and plan.price.step <= lead * (1 + self.tolerance):
                out.append(out[-1])
            else:
                lead = plan.price.step
                out.append(i + 1)
        return tuple(out)

    @property
    def tied(self) -> tuple[Plan, ...]:
        """The plans tied with the best (the best included): within ``tolerance`` of its step."""
        return tuple(plan for plan, rank in zip(self, self.ranks) if rank == 1)

    def __str__(self) -> str:
        head = ("rank", "mesh", "strategy", "step", "compute", "comm", "bubble", "peak mem", "fits")
        ranks = self.ranks
        shared = {r for r in ranks if r is not None and ranks.count(r) > 1}
        marks = ["-" if r is None else f"{r}=" if r in shared else str(r) for r in ranks]
        rows = [head] + [(mark, *plan.row()) for mark, plan in zip(marks, self)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if shared:
            lines.append(f"n= : tied, steps within {self.tolerance:.0%} of each other (within the cost model's error: "
                         "measure them to choose)")  # fmt: skip
        lines.append(f"{self.searched} candidates priced, {self.pruned} pruned by memory, in {self.seconds:.1f} s")
        lines.append(f"precision: {self.precision}")
        lines += str(self.skipped).splitlines() if self.skipped else []
        lines += [f"note: {note}" for note in self.notes]
        if self:
            lines += ["", f"best: {self[0]}"]
            others = [f"{plan.shape} [{plan.features}]" for plan in self.tied[1:]]
            if others:
                lines.append(f"tied with it (within {self.tolerance:.0%}): " + "; ".join(others))
        return "\n".join(lines)
