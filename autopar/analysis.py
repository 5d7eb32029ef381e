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

from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError
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


def analyze(program: Any, mesh: ProcessMesh, startup_program: Any = None, strategy: Strategy | None = None) -> Analysis:
    """The analysis of ``program`` on ``mesh`` for ``strategy`` (and every strategy sharing its
    analysed fields): pass it to ``autopar.compile(..., analysis=...)``."""
    from autopar.compile import analyze_state, effective_strategy
    from autopar.gc_pause import gc_paused

    with gc_paused():
        strategy = effective_strategy(program, mesh, strategy)
        state = analyze_state(program, mesh, startup_program, strategy)
    return Analysis(program, mesh, startup_program, tuple(analysed_fields(strategy).items()), state)
