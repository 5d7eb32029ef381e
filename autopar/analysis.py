"""``autopar.analyze``: the analysis of a program as a value that several strategies compile from
(stage: analyze, between annotate and the passes).

Graph building and propagation are nearly all of a compile (a 24-layer GPT on 8 ranks: 1.7 s
of 1.75 s); the passes that follow only plan. An :class:`Analysis` holds that first part —
the graph view, the propagation result, the micro-batch, recompute and sequence-parallel
decisions — and ``autopar.compile(..., analysis=a)`` plans a Strategy from it without analysing
again. The analysis is a read-only value (:class:`~autopar.passes.base.AnalysedProgram`, its
propagation frozen); each compile records its passes' results in its own
:class:`~autopar.passes.base.CompileState` over it (a strategy decision such as ZeRO's shards
layers a :class:`~autopar.propagation.PlacementOverride` on the propagation: a new value,
:meth:`~autopar.propagation.PropagationResult.overridden`).

What an analysis depends on (:data:`autopar.compile_plan.ANALYSED`): the micro-batch count and the automatic stage
cut, sequence parallelism, recompute, the cluster profile and local batch norm. Strategies that
differ only in the rest — the ZeRO stage, gradient fusion and its bucket size, the pipeline
schedule — share one; compiling a strategy that differs in an analysed field from an analysis
is refused, naming the field.

The analysis code lives here, below the compile driver: the program and start-up checks, the
user's placements and op meshes read from the annotations, the Strategy's serial rewrites and
propagation (:func:`analysis_start`, :func:`analysed_program`, :func:`analyze_state`);
``autopar.compile`` runs it, then the passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.annotate import annotations_of, is_legacy, warn_foreign_annotations
from autopar.compile_plan import AnalysedField, CompilePlan, plan_compile
from autopar.dist_attr import DistAttr
from autopar.errors import AnnotationError, AutoparError
from autopar.gc_pause import gc_paused
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh, not_a_mesh
from autopar.passes.base import AnalysedProgram, CompileState
from autopar.propagation import PropagationResult, transplant
from autopar.rewrites import Analysed, Rewrite, applied, apply_all, derived
from autopar.rewrites.recompute import regathered
from autopar.strategy import Strategy
from autopar.sub_meshes import find_views, is_sub_mesh, place_ops, value_meshes

if TYPE_CHECKING:
    from paddle.pir import Program

    from autopar.cost_model.cluster import Cluster

@dataclass(frozen=True)
class Analysis:
    """One program analysed on one mesh for the strategies that share :func:`analysed_fields`."""

    program: Program
    mesh: ProcessMesh
    startup_program: Program | None
    fields: tuple[tuple[str, AnalysedField], ...]
    state: AnalysedProgram  # read only: each compile plans its own CompileState over it
    rewrites: tuple[Rewrite, ...] = ()  # the serial rewrites run (autopar.rewrites), in order
    steps: tuple[Analysed, ...] = ()  # the analysis before them, then after each

    @property
    def graph(self) -> ProgramGraph:
        return self.state.graph

    @property
    def propagation(self) -> PropagationResult:
        return self.state.propagation

    def check(self, program: Any, mesh: ProcessMesh, startup_program: Any, plan: CompilePlan) -> None:
        """Refuse, naming what differs, a compile this analysis does not describe."""
        if program is not self.program:
            raise AutoparError("compile(..., analysis=...): the analysis was made for another program")
        if mesh != self.mesh:
            raise AutoparError(f"compile(..., analysis=...): the analysis was made on {self.mesh}, compile was given {mesh}")
        if startup_program is not self.startup_program:
            raise AutoparError("compile(..., analysis=...): the analysis was made with another startup_program")
        wanted = dict(plan.analysed)
        for name, value in self.fields:
            if wanted[name] != value:
                raise AutoparError(
                    f"compile(..., analysis=...): the strategy's {name}={wanted[name]!r} but the analysis was made with "
                    f"{name}={value!r}; analyze again for it (only the ZeRO stage, gradient fusion and the schedule may differ)"
                )

    def state_for(self, strategy: Strategy) -> CompileState:
        """A fresh compile state for ``strategy`` over this analysis' results (no pass result yet)."""
        return CompileState(self.state, strategy)


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
    with gc_paused():
        plan = plan_compile(program, mesh, strategy)
        rewrites = plan.rewrites
        if base is None:
            steps = applied(rewrites, analysis_start(program, mesh, startup_program, plan, placements))
        else:
            if not isinstance(base, Analysis):
                raise AutoparError(f"analyze(base=...) takes what autopar.analyze returned, got {type(base).__name__}")
            _check_base(base, program, mesh, startup_program, plan)
            steps = derived(rewrites, base.rewrites, base.steps)
        state = analysed_program(steps[-1], plan, startup_program)
    return Analysis(program, mesh, startup_program, plan.analysed, state, rewrites, tuple(steps))


def _check_base(base: Analysis, program: Any, mesh: ProcessMesh, startup_program: Any, plan: CompilePlan) -> None:
    """``base`` must analyse the same program, mesh and start-up, with the same cluster."""
    if program is not base.program or mesh != base.mesh or startup_program is not base.startup_program:
        raise AutoparError("analyze(base=...): the base analysis was made for another program, mesh or startup_program")
    if dict(base.fields)["cluster"] != plan.cluster:
        raise AutoparError(f"analyze(base=...): the base analysis priced another cluster ({dict(base.fields)['cluster']!r})")


def analyze_state(
    program: Any, mesh: ProcessMesh, startup_program: Any = None, strategy: Strategy | None = None, plan: CompilePlan | None = None
) -> CompileState:  # fmt: skip
    """The analysis: graph view, annotations, the Strategy's serial rewrites
    (:mod:`autopar.rewrites`, each returning a new value) and propagation."""
    plan = plan or plan_compile(None, mesh, strategy)  # (compile hands its plan, made with the program's stages)
    work = apply_all(plan.rewrites, analysis_start(program, mesh, startup_program, plan))
    return CompileState(analysed_program(work, plan, startup_program), plan.strategy)


def analysis_start(
    program: Any, mesh: ProcessMesh, startup_program: Any, plan: CompilePlan, placements: Mapping[ValueKey, DistAttr] | None = None
) -> Analysed:  # fmt: skip
    """The analysis before any rewrite: the program checked, its graph view, the user's
    annotations and op placements (``placements``: a plan's annotations by value key, used
    instead of the program's — strategy search tries plans without annotating the program)."""
    if not isinstance(mesh, ProcessMesh):
        raise AutoparError(not_a_mesh("compile", mesh))
    _check_program(program, "program")
    if startup_program is not None:
        _check_program(startup_program, "startup_program")
    if plan.pipelined:
        _check_pipeline_dim(mesh)
    graph = ProgramGraph(program)
    _check_static_shapes(graph)
    _check_startup(graph, startup_program)
    if placements is not None:
        user, op_meshes = dict(placements), {}
    else:
        warn_foreign_annotations(program, graph)
        user, op_meshes = _user_placements(program, graph, mesh, staged=plan.pipelined), _op_meshes(program, graph, mesh)
        # values and ops on sub-meshes that are no pipeline stage (autopar/sub_meshes.py); under a
        # pipeline, on the sub-meshes of the stages once the stages are cut (rewrites.PipelineStages)
        if not plan.pipelined:
            op_meshes = place_ops(graph, mesh, user, op_meshes)
            _refuse_sub_meshes_never_joined(graph, mesh, user, op_meshes)
    _refuse_meaningless_partials(graph, user)
    return Analysed(program, graph, mesh, _cluster(plan.cluster).fitted(mesh.ranks), user, op_meshes)


def analysed_program(work: Analysed, plan: CompilePlan, startup_program: Any) -> AnalysedProgram:
    """What the strategies compiled from the rewritten analysis ``work`` share: propagated, checked."""
    _check_pieces(work.graph, work.user)
    _refuse_annotations_off_their_stage(work.graph, work.user, work.op_meshes)
    propagation = work.propagate()
    _refuse_annotations_off_their_stage(work.graph, work.user, propagation.op_meshes)
    return AnalysedProgram(
        work.graph, propagation, work.mesh, cluster=work.cluster, startup=startup_program, micro=work.micro, recompute=work.recompute,
        sequence=work.sequence, regather=frozenset(regathered(work.recompute, work.graph, plan.pipelined)), rewrites=work.reports,
        single_stage=plan.single_stage, zigzag=work.zigzag,
    )  # fmt: skip


def _refuse_meaningless_partials(graph: ProgramGraph, user: dict[ValueKey, DistAttr]) -> None:
    """Partial annotations with no defined value: on a parameter or optimizer state (initialized
    whole by the start-up program and updated in place), or mixing reductions that do not
    commute. (A Partial *feed* has one: rank 0 of each group gets the value, the others the
    reduction's identity; an intermediate is resharded after its producer.)"""
    for key, attr in user.items():
        value = graph.values[key]
        kinds = set(attr.partial_dims.values())
        if len(kinds) > 1 and not kinds <= {"sum", "avg"}:
            raise AnnotationError(
                f"tensor {value.label!r} is annotated {attr}: pending {' and '.join(sorted(kinds))} reductions do not "
                "commute, so the value they stand for is ambiguous; use one kind (sum and avg may be mixed)"
            )
        if attr.is_partial and value.kind in ("parameter", "state"):
            raise AnnotationError(
                f"{value.kind} {value.label!r} is annotated {attr}: a {value.kind} cannot be Partial (it is "
                "initialized whole and updated in place); annotate it Shard or Replicate"
            )


def _check_program(program: Any, what: str) -> None:
    import paddle

    if isinstance(program, paddle.pir.Program):
        return
    if is_legacy(program):
        raise AutoparError(f"{what} is a legacy (non-PIR) Program: build the program under PIR (the default in Paddle 3)")
    raise AutoparError(f"compile needs a Paddle static (PIR) Program as {what}, got {type(program).__name__}")


def _check_static_shapes(graph: ProgramGraph) -> None:
    """autopar slices feeds, parameters and states by their sizes: each needs a static shape.
    (Auxiliary op outputs such as batch_norm's reserve space may keep a -1.)"""
    for value in graph.values.values():
        if value.name is not None and any(size < 0 for size in value.shape):
            raise AutoparError(
                f"tensor {value.label!r} has shape {list(value.shape)}: autopar needs static shapes; "
                "declare every size (the global batch too) when building the program"
            )


def _check_startup(graph: ProgramGraph, startup: Any) -> None:
    """Every parameter and persistable state of the program must be made by the startup
    program, by name and shape (a startup of another net fails later inside Paddle)."""
    if startup is None:
        return
    made = {}
    for op in startup.global_block().ops:
        attrs = op.attrs()
        name = attrs.get("parameter_name") if op.name() == "builtin.set_parameter" else attrs.get("output_name")
        if op.name() in ("builtin.set_parameter", "builtin.shadow_output") and name is not None:
            made[str(name)] = tuple(int(s) for s in op.operand_source(0).shape)
    needed = [v for v in graph.values.values() if v.kind in ("parameter", "state")]
    missing = sorted(v.name for v in needed if v.name not in made)
    if missing:
        shown = ", ".join(map(repr, missing[:6])) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise AutoparError(
            f"startup_program does not initialize {shown} of the program: pass the startup program built "
            "with it (paddle.static.program_guard(main, startup))"
        )
    for v in needed:
        if made[v.name] != tuple(v.shape):
            raise AutoparError(
                f"startup_program initializes {v.name!r} with shape {list(made[v.name])}, the program declares "
                f"{list(v.shape)}: pass the startup program built with it"
            )


def _cluster(name: str | None) -> Cluster:
    from autopar.cost_model.cluster import default_cluster, load_cluster

    return load_cluster(name) if name else default_cluster()


def _user_placements(program: Any, graph: ProgramGraph, mesh: ProcessMesh, staged: bool = False) -> dict[ValueKey, DistAttr]:
    placements = {}
    for impl_id, (attr, label) in annotations_of(program).tensors.items():
        key = graph._by_impl.get(impl_id)
        if key is None:
            raise AnnotationError(f"tensor {label!r} is annotated but is not a value of the compiled program")
        if not mesh.contains(attr.mesh):
            raise AnnotationError(f"tensor {label!r} is annotated on {attr.mesh}, which is not a sub-mesh of {mesh}")
        if attr.mesh != mesh and attr.mesh.same_grid(mesh):  # a slice of size-1 dims away: the same placement
            attr = transplant(attr, mesh)
        if attr.mesh != mesh and not (staged and attr.mesh.size < mesh.size) and not (not staged and is_sub_mesh(mesh, attr.mesh)):
            why = (
                "annotate with the mesh given to compile" if attr.mesh.size == mesh.size
                else "sub-mesh placements land with the pipeline (place a stage's ops with shard_op)"
            )  # fmt: skip
            raise AnnotationError(f"tensor {label!r} is annotated on {attr.mesh} but compile was given {mesh}; {why}")
        placements[key] = attr
    return placements


def _refuse_sub_meshes_never_joined(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh]
) -> None:  # fmt: skip
    """Without a pipeline, values placed on sub-meshes must come back to the mesh through a view
    (a split / concat / sum of one piece per shard: autopar/sub_meshes.py); a program with none
    would leave the other ranks idle and its results on a few."""
    if find_views(graph, mesh, value_meshes(graph, mesh, user, op_meshes), op_meshes):
        return
    for key, attr in user.items():
        if attr.mesh != mesh:
            raise AnnotationError(
                f"tensor {graph.values[key].label!r} is annotated on {attr.mesh} but compile was given {mesh}; sub-mesh placements "
                "land with the pipeline (place a stage's ops with shard_op), or, without one, are joined back to the mesh "
                "(autopar.global_mesh_tensor, the out_placements of autopar.local_map)"
            )


def _refuse_annotations_off_their_stage(
    graph: ProgramGraph, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh]
) -> None:  # fmt: skip
    """An intermediate annotated on a mesh its producer does not run on (a stage-0 output
    annotated on ``mesh[1]``) is refused: a value has one placement, made where its op runs;
    moving it to another stage is ``autopar.reshard`` (before: an internal MeshError when rank
    programs were built). Asked before propagation with the ops placed so far (propagation
    could not price such a read), and after it with the ops it placed."""
    for key, attr in user.items():
        made_on = op_meshes.get(key[0])
        if made_on is None or graph.values[key].kind != "activation" or set(attr.mesh.ranks) <= set(made_on.ranks):
            continue
        raise AnnotationError(
            f"tensor {graph.values[key].label!r} is made by {graph.ops[key[0]]} on {made_on} but annotated on {attr.mesh}: "
            f"annotate it on the mesh its op runs on, or move it with autopar.reshard(value, mesh, placements), which "
            "returns a copy placed there"
        )


def _check_pieces(graph: ProgramGraph, user: dict[ValueKey, DistAttr]) -> None:
    """No annotation may leave a rank an empty piece (of one micro-batch, under a pipeline)."""
    for key, attr in user.items():
        value = graph.values[key]
        for tensor_dim, size in enumerate(value.shape):
            parts = attr.shard_index(tensor_dim, attr.mesh.ranks[0])[1]
            if parts > size:
                raise AnnotationError(
                    f"tensor {value.label!r} of shape {list(value.shape)}: dim {tensor_dim} ({size} elements) split into "
                    f"{parts} pieces would leave ranks an empty piece"
                )


def _check_pipeline_dim(mesh: ProcessMesh) -> None:
    """Pipeline stages run over mesh dim 0 (``mesh[i]`` is stage ``i``'s sub-mesh). A mesh
    naming its pipeline dim elsewhere would cut the stages over another dim (the rank plans
    deadlocked)."""
    if mesh.ndim > 1 and "pp" in mesh.dim_names and mesh.dim_names[0] != "pp":
        names = ["pp", *(n for n in mesh.dim_names if n != "pp")]
        raise AutoparError(
            f"a pipeline runs its stages over mesh dim 0, which {mesh} names {mesh.dim_names[0]!r}; "
            f"put 'pp' first: ProcessMesh(..., dim_names={names}) with the ranks arranged to match"
        )


def _op_meshes(program: Any, graph: ProgramGraph, mesh: ProcessMesh) -> dict[int, ProcessMesh]:
    by_id = {op.op_id: op.index for op in graph.ops} | graph.op_aliases  # (the user's op ids after a serial rewrite)
    meshes = {}
    notes = annotations_of(program)
    for op_id, op_mesh in (*notes.ops.items(), *notes.local_ops.items()):
        if op_id not in by_id:
            continue  # an op erased from the program after shard_op recorded it
        op = graph.ops[by_id[op_id]]
        if not mesh.contains(op_mesh):
            raise AnnotationError(f"op {op} is placed by shard_op on {op_mesh}, which is not a sub-mesh of {mesh}")
        meshes[op.index] = mesh if op_mesh.same_grid(mesh) else op_mesh
    return meshes
