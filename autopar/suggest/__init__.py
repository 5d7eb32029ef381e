"""``autopar.suggest``: the best plans for a program on ``world`` devices, ranked and explained
(stage: strategy search, before compile).

For each mesh shape (:mod:`.search`) the annotations are found from the program
(:mod:`.annotations`: the feeds' batch dim, Megatron's column / row pairs of linears, a
vocabulary-parallel embedding), analysed once (``autopar.analyze(..., placements=...)``, the
program itself is not annotated), and every strategy of that shape is compiled from the
analysis (or one derived from it) and priced from what compile planned (:mod:`.pricing`: no
rank program is built). Plans whose parameter and optimizer memory alone cannot fit the budget
are dropped before any compile. Every shape's plain strategies are priced first (each ZeRO
stage, schedule and micro-batch count); sequence parallelism and recompute — which trade time
for memory — only for the :data:`FURTHER` fastest shapes and for shapes where nothing fits yet,
gradient accumulation only for the latter.
The result is ranked by predicted step time among the plans that fit, then by memory; each
:class:`Plan` says why in the user's terms, and ``plan.compile()`` gives its DistributedProgram.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.analysis import analysed_fields, analyze
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.gc_pause import gc_paused
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.strategy import Strategy
from autopar.suggest.pricing import Price, price
from autopar.suggest.search import Shape, accumulates, strategies, trades_time_for_memory
from autopar.suggest.search import shapes as factorisations
from autopar.units import format_bytes, format_time


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

    @property
    def fits(self) -> bool:
        return self.price.memory <= self.budget

    def compile(self) -> Any:
        """The DistributedProgram of this plan (the program is compiled with the plan's
        annotations; it is not annotated)."""
        import autopar

        return autopar.compile(self.program, self.mesh, self.startup_program, self.strategy, analysis=self.analysis)

    @property
    def features(self) -> str:
        s, out = self.strategy, []
        if s.zero_stage:
            out.append(f"ZeRO-{s.zero_stage}")
        if s.sequence_parallel:
            out.append("SP")
        if s.recompute:
            out.append("recompute")
        if s.pipeline is not None and s.pipeline.stages == 1:
            out.append(f"accumulate m={s.pipeline.micro_batches}")
        elif s.pipeline is not None:
            out.append(f"{s.pipeline.schedule} m={s.pipeline.micro_batches}")
        return ", ".join(out) or "-"

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
        return (str(self.shape), self.features, format_time(p.step), format_time(p.compute), format_time(p.communication),
                format_time(p.bubble), format_bytes(p.memory), "yes" if self.fits else "no")  # fmt: skip

    def __str__(self) -> str:
        return f"{self.shape} [{self.features}]: {self.why}"


class Suggestions(list):
    """The ranked plans (a list of :class:`Plan`), with what the search did: ``searched``
    candidates priced, ``pruned`` by memory before compiling, ``skipped`` shapes and why,
    ``seconds`` it took. ``str()`` is a table."""

    searched: int = 0
    pruned: int = 0
    seconds: float = 0.0
    skipped: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        head = ("mesh", "strategy", "step", "compute", "comm", "bubble", "peak mem", "fits")
        rows = [head] + [plan.row() for plan in self]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"{self.searched} candidates priced, {self.pruned} pruned by memory, in {self.seconds:.1f} s")
        lines += [f"skipped {shape}: {why}" for shape, why in self.skipped]
        if self:
            lines += ["", f"best: {self[0]}"]
        return "\n".join(lines)


def suggest(
    program: Any, world: int, startup_program: Any = None, memory_per_rank: int | None = None,
    cluster: str | None = None, top: int = 5, shapes: Iterable[Shape | tuple[int, int, int]] | None = None,
) -> Suggestions:  # fmt: skip
    """The ``top`` plans for ``program`` on ``world`` devices (see the module docstring).
    ``memory_per_rank``: bytes (default: the profile's device memory); ``cluster``: a cost
    profile name or path (default: the hardware in use); ``shapes``: only these mesh shapes
    (``Shape`` or ``(dp, mp, pp)``; default: every factorisation of ``world``)."""
    only = shapes
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise AutoparError(f"suggest: world must be a positive number of devices, got {world!r}")
    if not isinstance(top, int) or top < 1:
        raise AutoparError(f"suggest: top must be a positive int, got {top!r}")
    started = time.perf_counter()
    graph, batch, profile, budget = _setting(program, cluster, memory_per_rank)
    out, skipped = Suggestions(), []
    weights = _parameter_bytes(graph)
    tried: dict[Shape, _Shape] = {}
    for shape in factorisations(world) if only is None else _given_shapes(only, world):
        try:
            tried[shape] = _shape_entry(graph, shape, batch, profile, cluster)
        except _Unfit as why:
            skipped.append((str(shape), str(why)))

    def run(entry: _Shape, chosen: list[Strategy]) -> None:
        for strategy in chosen:
            if _memory_floor(weights, entry.shape, strategy) > budget:
                out.pruned += 1
                continue
            try:
                plan = entry.priced(program, startup_program, strategy, budget)
            except AutoparError as error:
                skipped.append((f"{entry.shape} [{strategy}]", str(error).splitlines()[0]))
                continue
            out.searched += 1
            out.append(plan)

    with gc_paused():  # (once for the whole search: each compile's own pause ended in a collection's worth of work)
        for entry in tried.values():  # the shape's plain analyses: every ZeRO stage, schedule and micro-batch count
            run(entry, [s for s in entry.strategies if not trades_time_for_memory(s)])
        best = sorted(tried.values(), key=_Shape.best_step)
        for entry in tried.values():  # SP and recompute where they may change the answer: the best shapes, or none fits
            short = not any(plan.fits for plan in entry.plans)  # (and only then gradient accumulation)
            if entry in best[:FURTHER] or short:
                run(entry, [s for s in entry.strategies if trades_time_for_memory(s) and (short or not accumulates(s))])
    out.sort(key=lambda plan: (not plan.fits, plan.price.step if plan.fits else plan.price.memory, plan.price.memory))
    del out[top:]
    out.skipped = tuple(skipped)
    out.seconds = time.perf_counter() - started
    return out


FURTHER = 3  # shapes whose sequence-parallel and recompute variants are priced (besides those where nothing fits)


def price_plan(
    program: Any, shape: Shape | tuple[int, int, int], strategy: Strategy | None = None, startup_program: Any = None,
    memory_per_rank: int | None = None, cluster: str | None = None,
) -> Plan:  # fmt: skip
    """One given plan priced as :func:`suggest` prices its candidates: ``shape`` (``Shape`` or
    ``(dp, mp, pp)``) with the annotations the search would find for it, and ``strategy``
    (default: none of the features; its ``cluster`` is used when ``cluster`` is not given) —
    a published recipe beside the search's choice, say."""
    strategy = strategy or Strategy()
    cluster = cluster or strategy.cluster
    graph, batch, profile, budget = _setting(program, cluster, memory_per_rank)
    (shape,) = _given_shapes([shape], None)
    strategy = dataclasses.replace(strategy, cluster=cluster)
    try:
        entry = _shape_entry(graph, shape, batch, profile, cluster)
    except _Unfit as why:
        raise AutoparError(f"price_plan: {shape}: {why}") from None
    return entry.priced(program, startup_program, strategy, budget)


class _Unfit(Exception):
    """Why a mesh shape cannot take the program."""


def _setting(program: Any, cluster: str | None, memory_per_rank: int | None) -> tuple[ProgramGraph, int, Any, int]:
    """The program's graph, its global batch, the cost profile and the memory budget per rank."""
    from autopar.cost_model.cluster import default_cluster, load_cluster
    from autopar.suggest.annotations import batch_feeds

    graph = ProgramGraph(program)
    feeds = batch_feeds(graph)
    batch = graph.values[feeds[0]].shape[0] if feeds else 1
    profile = load_cluster(cluster) if cluster else default_cluster()
    return graph, batch, profile, int(memory_per_rank if memory_per_rank is not None else profile.device.memory_bytes)


def _given_shapes(given: Iterable[Any], world: int | None) -> list[Shape]:
    out = []
    for item in given:
        shape = item if isinstance(item, Shape) else None
        if shape is None and isinstance(item, tuple) and len(item) == 3 and all(isinstance(n, int) and n >= 1 for n in item):
            shape = Shape(*item)
        if shape is None:
            raise AutoparError(f"a mesh shape is a Shape or (dp, mp, pp) of positive ints, got {item!r}")
        if world is not None and shape.world != world:
            raise AutoparError(f"mesh shape {shape} has {shape.world} devices, not the world's {world}")
        out.append(shape)
    return out


def _shape_entry(graph: ProgramGraph, shape: Shape, batch: int, profile: Any, cluster: str | None) -> _Shape:
    """``shape``'s annotations and strategies; raises :class:`_Unfit` saying why it cannot take the program."""
    from autopar.suggest.annotations import placements, tensor_parallel

    if batch % shape.dp:
        raise _Unfit(f"the batch of {batch} rows does not split over {shape.dp} data ranks")
    if shape.mp > profile.devices_per_node:
        raise _Unfit(f"tensor parallelism over {shape.mp} ranks would cross nodes of {profile.devices_per_node}")
    tp = tensor_parallel(graph, shape.mp) if shape.mp > 1 else None
    if shape.mp > 1 and not tp:
        raise _Unfit(f"nothing found to split over {shape.mp} tensor ranks")
    mesh = shape.mesh()
    annotated = placements(graph, mesh, tp, "dp" if shape.dp > 1 else None, "mp" if shape.mp > 1 else None)
    return _Shape(shape, mesh, annotated, _split_words(tp), list(strategies(shape, batch, cluster)))


@dataclass(eq=False)
class _Shape:
    """One mesh shape of a search: its annotations, strategies, analyses and priced plans."""

    shape: Shape
    mesh: ProcessMesh
    placements: Mapping[ValueKey, DistAttr]
    split: str
    strategies: list[Strategy]
    analyses: dict[tuple, Any] = field(default_factory=dict)
    plans: list[Plan] = field(default_factory=list)

    def analysis(self, program: Any, startup: Any, strategy: Strategy) -> Any:
        """The analysis ``strategy`` compiles from: made once, from the shape's first (derived)."""
        key = tuple(analysed_fields(strategy).items())
        if key not in self.analyses:
            first = next((a for a in self.analyses.values() if not isinstance(a, AutoparError)), None)
            try:
                self.analyses[key] = analyze(program, self.mesh, startup, strategy, base=first, placements=self.placements)
            except AutoparError as error:  # (once: the strategies sharing the analysis fail alike)
                self.analyses[key] = error
        found = self.analyses[key]
        if isinstance(found, AutoparError):
            raise found
        return found

    def priced(self, program: Any, startup: Any, strategy: Strategy, budget: int) -> Plan:
        """``strategy`` on this shape compiled from its analysis and priced (kept in ``plans``)."""
        analysis = self.analysis(program, startup, strategy)
        dist = _compiled(program, self.mesh, startup, strategy, analysis)
        plan = Plan(self.shape, self.mesh, strategy, self.placements, price(dist.state), budget, self.split, program,
                    startup, analysis)  # fmt: skip
        self.plans.append(plan)
        return plan

    def best_step(self) -> float:
        fitting = [plan.price.step for plan in self.plans if plan.fits]
        return min(fitting, default=float("inf"))


def _compiled(program: Any, mesh: ProcessMesh, startup: Any, strategy: Strategy, analysis: Any) -> Any:
    import warnings

    import autopar

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(program, mesh, startup, strategy, analysis=analysis)


def _parameter_bytes(graph: ProgramGraph) -> tuple[int, int]:
    """Bytes of the parameters and of the optimizer states (the program's state tensors)."""
    from autopar.cost_model import tensor_bytes

    params = sum(tensor_bytes(v.shape, v.dtype, None, 0) for v in graph.values.values() if v.kind == "parameter")
    states = sum(tensor_bytes(v.shape, v.dtype, None, 0) for v in graph.values.values() if v.kind == "state")
    return params, states


def _memory_floor(weights: tuple[int, int], shape: Shape, strategy: Strategy) -> float:
    """Parameters, gradients and optimizer states per rank at best (every weight split over the
    tensor and pipeline ranks; ZeRO's shards over the data ranks): a plan above the budget by
    these alone cannot fit whatever its activations."""
    params, states = weights
    model = shape.mp * shape.pp
    zero = strategy.zero_stage
    return params / model / (shape.dp if zero >= 3 else 1) + params / model / (shape.dp if zero >= 2 else 1) + states / model / (
        shape.dp if zero >= 1 else 1
    )


def _split_words(tp: Any) -> str:
    if not tp:
        return "nothing"
    parts = [f"{len(tp.column) - len(tp.heads)} column-parallel and {len(tp.row)} row-parallel weights"]
    if tp.vocab:
        parts.append(f"{len(tp.vocab)} vocabulary-parallel embedding(s)")
    if tp.heads:
        parts.append(f"{len(tp.heads)} output head(s) by vocabulary")
    return " and ".join(parts) + " are split"
