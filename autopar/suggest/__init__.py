"""``autopar.suggest``: the best plans for a program on ``world`` devices, ranked and explained
(stage: strategy search, before compile).

For each mesh shape (:mod:`.search`: the factorisations of the world — with a context-parallel
dim splitting the sequence when it is long, :func:`.annotations.long_sequence`; with an expert-parallel
dim ``ep`` splitting the stacked experts where the program has them, :func:`.annotations.expert_count` — and the shapes on fewer
devices that cannot grow — when the world does not divide the program well, leaving devices
idle is the better plan, and the result says so: "uses 4 of 7 devices") the annotations are
found from the program (:mod:`.annotations`: the feeds' batch dim, Megatron's column / row
pairs of linears, a vocabulary-parallel embedding), analysed once
(``autopar.analyze(..., placements=...)``, the program itself is not annotated), and every
strategy of that shape is compiled from the analysis (or one derived from it) and priced from
what compile planned (:mod:`.pricing`: no rank program is built). Plans whose parameter and
optimizer memory alone cannot fit the budget are dropped before any compile; a shape on fewer
devices is dropped when even one device's compute divided over its devices is slower than the
best plan found. Every shape's plain strategies are priced first (each ZeRO stage, schedule and
micro-batch count); sequence parallelism and recompute — which trade time for memory — for the
:data:`FURTHER` fastest shapes and for every plain strategy that does not fit (its variants
may), gradient accumulation only for shapes where nothing fits yet.
Every plan is priced in one precision (:mod:`.precision`): the program's own dtypes (a user's
AMP O2 program: bfloat16), or, asked with ``precision="bf16"``, a float32 program as the
mixed-precision program it stands for; ``Suggestions.precision`` says which.
The result is ranked by predicted step time among the plans that fit (a plan leaving devices idle
after those that use more of them and are within :data:`TIE` of it), then by memory, near-ties shown as ties
(:mod:`.plans`); each :class:`Plan` says why in the user's terms, and
``plan.compile()`` gives its DistributedProgram. Arguments are read by :mod:`.arguments`.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.analysis import analyze
from autopar.compile import compile as compile_program
from autopar.compile_plan import analysed_fields
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.gc_pause import gc_paused
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.strategy import Strategy
from autopar.suggest import arguments
from autopar.suggest.annotations import expert_count, long_sequence, sequence_length
from autopar.suggest.plans import TIE, Plan, Suggestions
from autopar.suggest.search import (
    CONTEXT_DIM,
    EXPERT_DIM,
    Shape,
    accumulates,
    largest,
    most_stages,
    strategies,
    trades_time_for_memory,
)
from autopar.suggest.search import shapes as factorisations
from autopar.suggest.tables import PlacementTable, Skipped, SkippedPlans
from autopar.units import format_bytes, format_time

__all__ = ["FURTHER", "TIE", "Plan", "Suggestions", "price_plan", "suggest"]


def suggest(
    program: Any, world: int, startup_program: Any = None, memory_per_rank: int | str | None = None,
    cluster: str | Any = None, top: int = 5, shapes: Iterable[Shape | Sequence[int]] | None = None,
    all_devices: bool = False, precision: str | None = None,
) -> Suggestions:  # fmt: skip
    """The ``top`` plans for ``program`` on ``world`` devices (see the module docstring).
    ``memory_per_rank``: bytes, or a size such as ``"80GB"`` (default: the profile's device
    memory); ``cluster``: a cost profile name, a JSON path or a ``Cluster`` (default: the
    hardware in use); ``shapes``: only these mesh shapes (``Shape`` or ``(dp, mp, pp[, cp])``, on at
    most ``world`` devices; default: every factorisation of ``world`` and the shapes on fewer
    devices that cannot grow); ``all_devices``: only plans that use every device;
    ``precision``: None prices the program as built (each value's own dtype: a user's AMP
    program in bfloat16), ``"bf16"`` / ``"fp16"`` a float32 program as the mixed-precision
    program it stands for (:mod:`.precision`)."""
    arguments.programs("suggest", program, startup_program)
    world = arguments.count("suggest", "world", world, "number of devices")
    top = arguments.count("suggest", "top", top)
    only = None if shapes is None else arguments.shapes("suggest", shapes, world)
    cluster = arguments.profile("suggest", cluster)
    budget = arguments.budget("suggest", memory_per_rank)
    arguments.warn_annotated("suggest", program)
    started = time.perf_counter()
    search = _Search(program, startup_program, world, cluster, budget, precision, "suggest")
    with gc_paused():  # (once for the whole search: each compile's own pause ended in a collection's worth of work)
        search.run(only if only is not None else search.shapes(all_devices))
    out = search.result(top, memory_per_rank)
    out.seconds = time.perf_counter() - started
    return out


FURTHER = 3  # shapes whose sequence-parallel and recompute variants are priced (besides those where nothing fits)


def price_plan(
    program: Any, shape: Shape | Sequence[int], strategy: Strategy | None = None, startup_program: Any = None,
    memory_per_rank: int | str | None = None, cluster: str | Any = None, precision: str | None = None,
) -> Plan:  # fmt: skip
    """One given plan priced as :func:`suggest` prices its candidates: ``shape`` (``Shape`` or
    ``(dp, mp, pp[, cp])``) with the annotations the search would find for it, and ``strategy``
    (default: none of the features; its ``cluster`` is used when ``cluster`` is not given) —
    a published recipe beside the search's choice, say. Arguments as :func:`suggest`'s."""
    arguments.programs("price_plan", program, startup_program)
    if strategy is not None and not isinstance(strategy, Strategy):
        raise AutoparError(f"price_plan: strategy must be an autopar.Strategy or None, got a {type(strategy).__name__}")
    strategy = strategy or Strategy()
    cluster = arguments.profile("price_plan", cluster) or strategy.cluster
    (shape,) = arguments.shapes("price_plan", [shape], None)
    budget = arguments.budget("price_plan", memory_per_rank)
    search = _Search(program, startup_program, shape.world, cluster, budget, precision, "price_plan")
    why = search.unfit(shape, strategy)
    if why is not None:
        raise AutoparError(f"price_plan: {shape}: {why}")
    return search.entry(shape).priced(program, startup_program, dataclasses.replace(strategy, cluster=cluster), search.budget)


class _Search:
    """One search's state: the program's graph and batch, the profile, the budget, the shapes
    tried and the plans priced."""

    def __init__(
        self, program: Any, startup: Any, world: int, cluster: str | None, budget: int | None, precision: Any = None,
        who: str = "suggest",
    ) -> None:  # fmt: skip
        from autopar.suggest.precision import chosen

        self.program, self.startup, self.world, self.cluster = program, startup, world, cluster
        self.graph, self.batch, self.profile, self.budget = _setting(program, cluster, budget)
        self.precision, self.precision_words = chosen(who, precision, self.graph)
        self.weights = (*_parameter_bytes(self.graph, self.precision), _expert_bytes(self.graph, self.precision))
        self.experts = expert_count(self.graph)  # stacked experts: try splitting them over an ep dim
        self.stages = most_stages(self.graph)
        self.seq = sequence_length(self.graph)
        self.context = long_sequence(self.graph)  # attention's [S, S] activations decide: try splitting the sequence
        self.entries: dict[Shape, _Shape] = {}
        self.plans: list[Plan] = []
        self.skipped: list[Skipped] = []
        self.pruned = 0
        self.least = float("inf")  # the least memory any candidate needs (its floor when pruned)
        self._split: dict[int, Any] = {}  # mp -> TensorParallel (or None: nothing to split)

    def shapes(self, all_devices: bool) -> list[Shape]:
        """The world's factorisations, then (unless ``all_devices``) the shapes on fewer devices
        that cannot grow (:func:`.search.largest`)."""
        context = [cp for cp in range(1, self.world + 1) if cp == 1 or (self.context and self.seq % cp == 0)]
        experts = [ep for ep in range(1, self.world + 1) if ep == 1 or (self.experts and self.experts % ep == 0)]
        out = list(factorisations(self.world, context, experts))
        if not all_devices:
            data = [d for d in range(1, self.world + 1) if self.batch % d == 0]
            fewer = largest(self.world, data, range(1, self.world + 1), lambda s: self.unfit(s) is None)
            out += [s for s in fewer if s.world < self.world]
        return out

    def unfit(self, shape: Shape, given: Strategy | None = None) -> str | None:
        """Why ``shape`` cannot take the program (None: it can), with the ``given`` strategy or
        (None) with the search's, whose pipelines need as many micro-batches as stages."""
        rows = self.batch // shape.data
        if shape.ep > 1 and not self.experts:
            return f"no stacked experts (an [E, ...] weight an einsum batches over E) to split over {shape.ep} expert-parallel ranks"
        if shape.ep > 1 and self.experts % shape.ep:
            return f"the {self.experts} experts do not split over {shape.ep} expert-parallel ranks"
        if self.batch % shape.data:
            ranks = f"{shape.dp} data ranks" if shape.ep == 1 else f"{shape.dp} x {shape.ep} data x expert ranks"
            return f"the batch of {self.batch} rows does not split over {ranks}"
        straddling = _straddling(shape, self.profile.devices_per_node)
        if straddling:
            return (f"tensor parallelism over {shape.mp} ranks would cross nodes of {self.profile.devices_per_node} "
                    f"devices (ranks {straddling}): it must divide the node")  # fmt: skip
        if shape.pp > self.stages:
            return f"the program's forward has {self.stages} layer(s) to cut, fewer than {shape.pp} stages"
        if given is None and shape.pp > rows:
            return f"{rows} rows per data rank cannot make the {shape.pp} micro-batches {shape.pp} stages need"
        if shape.mp > 1 and not self.split(shape.mp):
            return f"nothing found to split over {shape.mp} tensor ranks"
        if shape.cp > 1 and self.seq < 2:
            return "no feed carries a sequence (dim 1 of the batch feeds) to split over context-parallel ranks"
        if shape.cp > 1 and self.seq % shape.cp:
            return f"the sequence of {self.seq} tokens does not split over {shape.cp} context-parallel ranks"
        return None

    def split(self, mp: int) -> Any:
        from autopar.suggest.annotations import tensor_parallel

        if mp not in self._split:
            self._split[mp] = tensor_parallel(self.graph, mp)
        return self._split[mp]

    def entry(self, shape: Shape) -> _Shape:
        """``shape``'s annotations and strategies (it takes the program: :meth:`unfit` is None)."""
        from autopar.suggest.annotations import placements

        if shape not in self.entries:
            tp = self.split(shape.mp) if shape.mp > 1 else None
            mesh = shape.mesh()
            sep = CONTEXT_DIM if shape.cp > 1 else None
            ep = EXPERT_DIM if shape.ep > 1 else None
            annotated = placements(self.graph, mesh, tp, "dp" if shape.dp > 1 else None, "mp" if shape.mp > 1 else None, sep, ep)
            annotated = PlacementTable(annotated, self.graph)
            chosen = list(strategies(shape, self.batch, self.cluster))
            self.entries[shape] = _Shape(shape, mesh, annotated, _split_words(tp), chosen, self.world, self.precision,
                                         self.precision_words)  # fmt: skip
        return self.entries[shape]

    def run(self, shapes: Iterable[Shape]) -> None:
        """Plain strategies of every shape (one device first: its compute bounds the shapes on
        fewer devices), then the variants that trade time for memory where they may matter."""
        for shape in shapes:
            why = self.unfit(shape)
            if why is not None:
                self.skipped.append(Skipped(shape, why, world=self.world))
            else:
                self.entry(shape)
        order = sorted(self.entries.values(), key=lambda e: (e.shape.world > 1, e.shape.world < self.world, -e.shape.world))
        priced = [entry for entry in order if not self._beaten(entry)]
        for entry in priced:  # the shape's plain analyses: every ZeRO stage, schedule and micro-batch count
            self.price(entry, [s for s in entry.strategies if not trades_time_for_memory(s)])
        best = sorted(priced, key=_Shape.best_step)[:FURTHER]
        for entry in priced:  # SP and recompute where they may change the answer
            self.price(entry, [s for s in entry.strategies if trades_time_for_memory(s) and self._worth(entry, s, best)])

    def price(self, entry: _Shape, chosen: list[Strategy]) -> None:
        for strategy in chosen:
            floor = _memory_floor(self.weights, entry.shape, strategy)
            if floor > self.budget:
                self.pruned += 1
                self.least = min(self.least, floor)
                continue
            try:
                plan = entry.priced(self.program, self.startup, strategy, self.budget)
            except AutoparError as error:
                self.skipped.append(Skipped(entry.shape, str(error).splitlines()[0], strategy, self.world))
                continue
            self.least = min(self.least, plan.price.memory)
            self.plans.append(plan)

    def _worth(self, entry: _Shape, strategy: Strategy, best: list[_Shape]) -> bool:
        """Whether to price a variant that trades time for memory: gradient accumulation where
        nothing fits yet; SP and recompute on the fastest shapes, where nothing fits, and
        wherever the plain strategy they vary does not fit."""
        short = not any(plan.fits for plan in entry.plans)
        if accumulates(strategy):
            return short
        if short or entry in best:
            return True
        plain = dataclasses.replace(strategy, sequence_parallel=False, recompute=False)
        return not any(plan.fits and plan.strategy == plain for plan in entry.plans)

    def _beaten(self, entry: _Shape) -> bool:
        """A shape on fewer devices than the world whose compute cannot be less than one
        device's divided over its devices, already slower than the best plan found (skipped)."""
        one = self.entries.get(Shape(1, 1, 1))
        n = entry.shape.world
        if n == self.world or one is None or not one.plans or entry is one:
            return False
        bound = min(plan.price.compute for plan in one.plans) / n
        best = min((plan.price.step for plan in self.plans if plan.fits), default=float("inf"))
        if bound <= best:
            return False
        why = (f"at least {format_time(bound)} of compute (one device's / {n}), "
               f"slower than the best plan found ({format_time(best)})")  # fmt: skip
        self.skipped.append(Skipped(entry.shape, why, world=self.world))
        return True

    def result(self, top: int, given: Any) -> Suggestions:
        """The ranked plans (see :class:`Suggestions`), the first ``top``."""
        out = Suggestions(sorted(self.plans, key=_rank_key))
        out.searched, out.pruned, out.skipped = len(self.plans), self.pruned, SkippedPlans(self.skipped)
        out.precision = self.precision_words
        if not any(plan.fits for plan in out):
            least = f"; the least a plan needs is {format_bytes(self.least)}" if self.least < float("inf") else ""
            hint = arguments.unit_hint(given, self.budget) if given is not None else ""
            out.notes = (f"nothing fits in {format_bytes(self.budget)} per rank{least}", *([hint] if hint else []))
            warnings.warn(f"suggest: {'; '.join(out.notes)}", UserWarning, stacklevel=3)
        del out[top:]
        return out


def _rank_key(plan: Plan) -> tuple:
    """Plans that fit by step, then the others by memory. A plan leaving devices idle goes after
    plans that use more of them and are slower by less than :data:`TIE` x the idle fraction
    (one device of 7: 4.3 %): asked for ``world`` devices, a tie (within the cost model's error)
    goes to using them — more memory per rank to spare, no device idle."""
    step = plan.price.step * (1 + (TIE * plan.idle / plan.world if plan.idle else 0.0))
    return (not plan.fits, step if plan.fits else plan.price.memory, plan.price.memory, -plan.shape.world)


def _straddling(shape: Shape, per_node: int) -> str:
    """The first tensor-parallel group of ``shape``'s mesh (groups: runs of ``mp`` consecutive
    ranks) that spans two nodes of ``per_node`` devices, as ``"6, 7, 8"``; empty: none does."""
    for first in range(0, shape.world, shape.mp):
        if first // per_node != (first + shape.mp - 1) // per_node:
            return ", ".join(str(r) for r in range(first, first + shape.mp))
    return ""


def _setting(program: Any, cluster: str | None, memory_per_rank: int | None) -> tuple[ProgramGraph, int, Any, int]:
    """The program's graph, its global batch, the cost profile and the memory budget per rank."""
    from autopar.cost_model.cluster import default_cluster, load_cluster
    from autopar.suggest.annotations import batch_feeds

    graph = ProgramGraph(program)
    feeds = batch_feeds(graph)
    batch = graph.values[feeds[0]].shape[0] if feeds else 1
    profile = load_cluster(cluster) if cluster else default_cluster()
    return graph, batch, profile, int(memory_per_rank if memory_per_rank is not None else profile.device.memory_bytes)


@dataclass(eq=False)
class _Shape:
    """One mesh shape of a search: its annotations, strategies, analyses and priced plans."""

    shape: Shape
    mesh: ProcessMesh
    placements: Mapping[ValueKey, DistAttr]
    split: str
    strategies: list[Strategy]
    world: int  # devices the search had
    precision: Any  # the Precision every plan is priced in
    precision_words: str  # and what the search reports it as
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
        plan = Plan(self.shape, self.mesh, strategy, self.placements, dist.decisions.price(self.precision), budget, self.split,
                    program, startup, analysis, self.world, self.precision_words)  # fmt: skip
        self.plans.append(plan)
        return plan

    def best_step(self) -> float:
        fitting = [plan.price.step for plan in self.plans if plan.fits]
        return min(fitting, default=float("inf"))


def _compiled(program: Any, mesh: ProcessMesh, startup: Any, strategy: Strategy, analysis: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_program(program, mesh, startup, strategy, analysis=analysis)


def _expert_bytes(graph: ProgramGraph, precision: Any = None) -> int:
    """Bytes of the stacked experts' parameters (:func:`.annotations.expert_parameters`) in ``precision``."""
    from autopar.cost_model import tensor_bytes
    from autopar.cost_model.precision import AS_BUILT
    from autopar.suggest.annotations import expert_parameters

    precision = precision or AS_BUILT
    return sum(tensor_bytes(graph.values[k].shape, precision.dtype(graph.values[k].dtype, "parameter"), None, 0)
               for k in expert_parameters(graph))  # fmt: skip


def _parameter_bytes(graph: ProgramGraph, precision: Any = None) -> tuple[int, int]:
    """Bytes of the parameters and of the optimizer states (the program's state tensors: an O2
    program's fp32 masters among them; a float32 program priced in mixed precision gains a
    master per parameter), in ``precision``."""
    from autopar.cost_model import tensor_bytes
    from autopar.cost_model.precision import AS_BUILT

    precision = precision or AS_BUILT
    values = list(graph.values.values())
    params = sum(tensor_bytes(v.shape, precision.dtype(v.dtype, v.kind), None, 0) for v in values if v.kind == "parameter")
    states = sum(tensor_bytes(v.shape, v.dtype, None, 0) for v in values if v.kind == "state")
    masters = [(v, precision.master_of(v.dtype)) for v in values if v.kind == "parameter"]
    states += sum(tensor_bytes(v.shape, master, None, 0) for v, master in masters if master is not None)
    return params, states


def _memory_floor(weights: tuple[int, int, int], shape: Shape, strategy: Strategy) -> float:
    """Parameters, gradients and optimizer states per rank at best (every weight split over the
    tensor and pipeline ranks, the stacked experts (``weights[2]``) also over the expert ranks;
    ZeRO's shards over the data ranks; the states as if all were the experts'): a plan above
    the budget by these alone cannot fit whatever its activations."""
    params, states, experts = weights
    model = shape.mp * shape.pp
    params = (params - experts) / model + experts / (model * shape.ep)
    zero = strategy.zero_stage
    return params / (shape.dp if zero >= 3 else 1) + params / (shape.dp if zero >= 2 else 1) + states / (model * shape.ep) / (
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
