"""``autopar.compile``: the driver from an annotated serial program to a DistributedProgram.

compile = analyze (graph, annotations, propagation) -> the pass pipeline the Strategy
declares (:func:`autopar.compile_plan.passes_for`), planned once for the whole job. Rank programs are built later,
one rank at a time, by the same pipeline (``dist.rank_plan(rank)``): compile's cost does not
grow with the world size. The user's program is only read, never modified: every rank
program is a clone.
"""

from __future__ import annotations

from typing import Any

from autopar.analysis import Analysis, analyze_state
from autopar.compile_plan import plan_compile
from autopar.distributed_program import DistributedProgram
from autopar.errors import AutoparError
from autopar.gc_pause import gc_paused
from autopar.mesh import ProcessMesh
from autopar.passes.base import CompileState, PassPipeline
from autopar.strategy import Strategy


def compile(  # noqa: A001  (the public name the design card fixes)
    program: Any,
    mesh: ProcessMesh,
    startup_program: Any = None,
    strategy: Strategy | None = None,
    callback: Any = None,
    analysis: Any = None,
) -> DistributedProgram:
    """Propagate the annotations of ``program`` over ``mesh`` and plan every pass; see DESIGN.md.

    ``callback(pass, state, rank_program_or_None)`` runs after each pass (compile-time
    planning, then per rank as rank programs are built): the hook for per-pass dumps.
    ``analysis``: an :class:`autopar.analysis.Analysis` of this program (``autopar.analyze``)
    to plan from instead of analysing again (strategies differing in the ZeRO stage, fusion or
    the schedule share one).
    """
    if callback is not None and not callable(callback):
        raise AutoparError(f"callback must be callable (pass, state, rank_program_or_None) or None, got {type(callback).__name__}")
    if analysis is not None and not isinstance(analysis, Analysis):
        raise AutoparError(f"analysis must be what autopar.analyze returned, got {type(analysis).__name__}")
    with gc_paused():
        plan = plan_compile(program, mesh, strategy)  # the Strategy read, once, into values handed down
        pipeline = PassPipeline(plan.passes, callback, plan.rewrites)
        if analysis is None:
            state = analyze_state(program, mesh, startup_program, plan=plan)
        else:
            analysis.check(program, mesh, startup_program, plan)
            state = analysis.state_for(plan.strategy)
        pipeline.plan(state)
        _warn_lost_splits(state)
        return DistributedProgram(program, startup_program, state, pipeline, plan.effective)


def _warn_lost_splits(state: CompileState) -> None:
    """Warn, once per op, where an op without an SPMD rule makes a split value whole every
    step (no silent loss of parallelism: the result equals serial either way)."""
    import warnings

    from autopar.errors import ParallelismWarning
    from autopar.units import format_bytes

    unsupported = set(state.propagation.unsupported)
    lost: dict[int, list[str]] = {}
    for planned in state.reshards:
        op = state.graph.ops[planned.need.op]
        if str(op) not in unsupported or planned.shared_with is not None or not planned.plan.bytes:
            continue
        if not planned.need.have.sharded_mesh_dims() and not planned.need.have.partial:
            continue
        lost.setdefault(op.index, []).append(
            f"{state.label(planned.need.value)} {planned.need.have} -> whole ({format_bytes(planned.plan.bytes)})"
        )
    for index, reads in lost.items():
        op = state.graph.ops[index]
        path = str(op.attrs.get("struct_name") or "").strip("/")
        warnings.warn(
            f"{op}{f' (in {path})' if path else ''} has no SPMD rule, so it runs whole on every rank: it reads "
            f"{'; '.join(reads)} each step, and what it makes is whole after it. Give {op.name} a rule "
            "(autopar.spmd.register_rule; check it with autopar.testing.check_rule) or compute it outside the split region",
            ParallelismWarning,
            stacklevel=3,
        )
