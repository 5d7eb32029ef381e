"""``autopar.analyze``: the analysis of a program as a value that several strategies compile from
(stage: analyze, between annotate and the passes).

Graph building and propagation are nearly all of a compile (a 24-layer GPT on 8 ranks: 1.7 s
of 1.75 s); the passes that follow only plan. An :class:`Analysis` holds that first part —
the graph view, the propagation result, the micro-batch, recompute and sequence-parallel
decisions — and ``autopar.compile(..., analysis=a)`` plans a Strategy from it without analysing
again. Each compile works on its own :class:`~autopar.passes.base.CompileState` over the shared,
read-only graph and propagation (a strategy decision such as ZeRO's shards derives a new
propagation value, :meth:`~autopar.propagation.PropagationResult.derived`).

What an analysis depends on (:data:`ANALYSED`): the micro-batch count and the automatic stage
cut, sequence parallelism, recompute, the cluster profile and local batch norm. Strategies that
differ only in the rest — the ZeRO stage, gradient fusion and its bucket size, the pipeline
schedule — share one; compiling a strategy that differs in an analysed field from an analysis
is refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ValueKey
from autopar.mesh import ProcessMesh
from autopar.passes.base import CompileState
from autopar.strategy import Strategy

ANALYSED = ("micro_batches", "stages", "pipelined", "sequence_parallel", "recompute", "cluster", "local_batch_norm")


def analysed_fields(strategy: Strategy) -> dict[str, Any]:
    """The fields of ``strategy`` an analysis depends on (see the module docstring)."""
    pipeline = strategy.pipeline
    return {
        "micro_batches": pipeline.micro_batches if pipeline is not None else 1,
        "stages": pipeline.stages if pipeline is not None else None,
        "pipelined": pipeline is not None,
        "sequence_parallel": strategy.sequence_parallel,
        "recompute": strategy.recompute,
        "cluster": strategy.cluster,
        "local_batch_norm": strategy.local_batch_norm,
    }


@dataclass(frozen=True)
class Analysis:
    """One program analysed on one mesh for the strategies that share :func:`analysed_fields`."""

    program: Any
    mesh: ProcessMesh
    startup_program: Any
    fields: tuple[tuple[str, Any], ...]
    state: CompileState  # never planned: compiles plan copies of it
    rewrites: tuple[Any, ...] = ()  # the serial rewrites run (autopar.rewrites), in order
    steps: tuple[Any, ...] = ()  # the analysis before them, then after each (autopar.rewrites.Analysed values)

    @property
    def graph(self) -> Any:
        return self.state.graph

    @property
    def propagation(self) -> Any:
        return self.state.propagation

    def check(self, program: Any, mesh: ProcessMesh, startup_program: Any, strategy: Strategy) -> None:
        """Refuse, naming what differs, a compile this analysis does not describe."""
        if program is not self.program:
            raise AutoparError("compile(..., analysis=...): the analysis was made for another program")
        if mesh != self.mesh:
            raise AutoparError(f"compile(..., analysis=...): the analysis was made on {self.mesh}, compile was given {mesh}")
        if startup_program is not self.startup_program:
            raise AutoparError("compile(..., analysis=...): the analysis was made with another startup_program")
        wanted = analysed_fields(strategy)
        for name, value in self.fields:
            if wanted[name] != value:
                raise AutoparError(
                    f"compile(..., analysis=...): the strategy's {name}={wanted[name]!r} but the analysis was made with "
                    f"{name}={value!r}; analyze again for it (only the ZeRO stage, gradient fusion and the schedule may differ)"
                )

    def state_for(self, strategy: Strategy) -> CompileState:
        """A fresh compile state for ``strategy`` over this analysis' results (the passes' own
        fields start empty)."""
        base = self.state
        return CompileState(
            base.graph, base.propagation, base.mesh, strategy, cluster=base.cluster, startup=base.startup, micro=base.micro,
            sequence=base.sequence, recompute=base.recompute, regather=base.regather, rewrites=base.rewrites,
        )  # fmt: skip


def analyze(
    program: Any, mesh: ProcessMesh, startup_program: Any = None, strategy: Strategy | None = None, base: Analysis | None = None,
    placements: Mapping[ValueKey, DistAttr] | None = None,
) -> Analysis:  # fmt: skip
    """The analysis of ``program`` on ``mesh`` for ``strategy`` (and every strategy sharing its
    analysed fields): pass it to ``autopar.compile(..., analysis=...)``.

    ``base``: an analysis of the same program for another strategy to derive this one from —
    the rewrites both strategies run first (the shape reads, the pipeline stages) are not run
    again, another micro-batch count is derived from ``base``'s split, and a strategy that only
    adds sequence parallelism reuses ``base``'s propagation as its first one. The result is the
    analysis ``analyze`` would make without ``base``."""
    from autopar.compile import analysis_start, effective_strategy, state_of
    from autopar.gc_pause import gc_paused
    from autopar.rewrites import applied, derived, rewrites_for

    with gc_paused():
        strategy = effective_strategy(program, mesh, strategy)
        rewrites = rewrites_for(strategy)
        if base is None:
            steps = applied(rewrites, analysis_start(program, mesh, startup_program, strategy, placements))
        else:
            if not isinstance(base, Analysis):
                raise AutoparError(f"analyze(base=...) takes what autopar.analyze returned, got {type(base).__name__}")
            _check_base(base, program, mesh, startup_program, strategy)
            steps = derived(rewrites, base.rewrites, base.steps)
        state = state_of(steps[-1], strategy, startup_program)
    return Analysis(program, mesh, startup_program, tuple(analysed_fields(strategy).items()), state, rewrites, tuple(steps))


def _check_base(base: Analysis, program: Any, mesh: ProcessMesh, startup_program: Any, strategy: Strategy) -> None:
    """``base`` must analyse the same program, mesh and start-up, with the same cluster."""
    if program is not base.program or mesh != base.mesh or startup_program is not base.startup_program:
        raise AutoparError("analyze(base=...): the base analysis was made for another program, mesh or startup_program")
    if dict(base.fields)["cluster"] != strategy.cluster:
        raise AutoparError(f"analyze(base=...): the base analysis priced another cluster ({dict(base.fields)['cluster']!r})")
