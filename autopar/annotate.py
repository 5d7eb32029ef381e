"""User annotations on PIR programs: ``shard_tensor``, ``shard_op`` and ``reshard`` (stage: annotate).

Annotations are kept beside the program (a weak table keyed by the Program object), never
written into it: the user's program stays exactly as built. ``compile`` reads them back.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.errors import AnnotationError, AnnotationWarning, AutoparError, PlacementError
from autopar.mesh import ProcessMesh, not_a_mesh
from autopar.placement import Placement


@dataclass
class ProgramAnnotations:
    """What the user said about one program: value placements and op meshes."""

    tensors: dict[str, tuple[DistAttr, str]] = field(default_factory=dict)  # value impl id -> (attr, label)
    ops: dict[int, ProcessMesh] = field(default_factory=dict)  # op id -> mesh
    keep: set[str] = field(default_factory=set)  # value impl ids computed even if nothing reads them (autopar.keep)
    local_ops: dict[int, ProcessMesh] = field(default_factory=dict)  # op id -> sub-mesh, no pipeline stage (autopar.local_map)


_TABLE: weakref.WeakKeyDictionary[Any, ProgramAnnotations] = weakref.WeakKeyDictionary()


def annotations_of(program: Any) -> ProgramAnnotations:
    """The annotations recorded for ``program`` (empty if none)."""
    try:
        return _TABLE.get(program) or ProgramAnnotations()
    except TypeError:
        return ProgramAnnotations()


def local_op_ids() -> set[int]:
    """The ids of the ops ``autopar.local_map`` placed, in any live program (op ids are unique
    in a process: a rewritten clone's graph finds the user's ops by them, ``graph.op_aliases``)."""
    return {op_id for notes in list(_TABLE.values()) for op_id in notes.local_ops}


def record(program: Any) -> ProgramAnnotations:
    if program not in _TABLE:
        _TABLE[program] = ProgramAnnotations()
    return _TABLE[program]


def value_label(value: Any) -> str:
    """A readable name for a PIR value: its parameter / feed name or producer op."""
    op = value.get_defining_op()
    name = op.name()
    attrs = op.attrs()
    if name == "builtin.parameter":
        return str(attrs["parameter_name"])
    if name == "pd_op.data":
        return str(attrs["name"])
    return f"{name} output {value.index() if hasattr(value, 'index') else 0} (op id {op.id()})"


def program_of(value: Any) -> Any:
    """The PIR program a Value belongs to (refuses legacy Variables and block arguments by name)."""
    import paddle

    if not isinstance(value, paddle.pir.Value):
        hint = " (a legacy static Variable: build the program under PIR, the default in Paddle 3)" if is_legacy(value) else ""
        raise AnnotationError(f"shard_tensor expects a Value of a static PIR program, got {type(value).__name__}{hint}")
    op = value.get_defining_op()
    if op is None:
        raise AnnotationError("shard_tensor expects a Value made by an op of a PIR program, got a block argument")
    return op.get_parent_block().program


def is_legacy(obj: Any) -> bool:
    """A value or program of Paddle's legacy (pre-PIR) static graph."""
    from paddle.base import framework

    return isinstance(obj, (framework.Variable, framework.Program))


def _is_placement_list(spec: Sequence[Any]) -> bool:
    import paddle.distributed as pdist

    return bool(spec) and all(isinstance(p, (pdist.Placement, Placement)) for p in spec)


def to_dist_attr(spec: Any, mesh: ProcessMesh, ndim: int, label: str) -> DistAttr:
    """A user's dims_mapping (names, indices, None/-1) or Paddle placement list -> DistAttr."""
    if isinstance(spec, DistAttr):
        if spec.mesh != mesh:
            raise PlacementError(f"tensor {label!r}: its DistAttr is on {spec.mesh} but shard_tensor was given {mesh}")
        if spec.ndim != ndim:
            raise PlacementError(f"tensor {label!r} has {ndim} dims but its DistAttr {spec} has {spec.ndim}")
        return spec
    if not isinstance(spec, Sequence) or isinstance(spec, str):
        raise PlacementError(f"tensor {label!r}: dims_mapping must be a list, got {spec!r}")
    try:
        if _is_placement_list(spec):
            return DistAttr.from_placements(mesh, spec, ndim)
        if len(spec) != ndim:
            raise PlacementError(f"dims_mapping {list(spec)} has {len(spec)} entries but tensor {label!r} has {ndim} dims")
        return DistAttr(mesh, list(spec))
    except AutoparError as err:
        if label in str(err):
            raise
        raise type(err)(f"tensor {label!r}: {err}") from err


def shard_tensor(value: Any, mesh: ProcessMesh, dims_mapping: Any) -> Any:
    """Declare how ``value`` (a feed, parameter or intermediate) lies on ``mesh``; returns it.

    ``dims_mapping`` has one entry per tensor dim: a mesh dim name or index to split over
    (a tuple for several), or None / -1; or a Paddle placement list, one per mesh dim.
    """
    if not isinstance(mesh, ProcessMesh):
        raise AnnotationError(not_a_mesh("shard_tensor", mesh))
    program = program_of(value)
    label = value_label(value)
    _check_not_startup(program, value, label, "shard_tensor")
    if not value.is_dense_tensor_type():
        raise AnnotationError(f"shard_tensor annotates tensors; {label} is a {value.type()} (annotate its members)")
    _check_current_program(program, label)
    attr = to_dist_attr(dims_mapping, mesh, len(value.shape), label)
    _check_static_dims(attr, list(value.shape), label)
    tensors = record(program).tensors
    earlier = tensors.get(value.id)
    if earlier is not None and earlier[0] != attr:  # which one was meant cannot be told
        before, now = earlier[0], attr
        if before.mesh != now.mesh:  # the same placement text on two meshes: name them
            raise AnnotationError(
                f"tensor {label!r} is already annotated as {before} on {before.mesh}; shard_tensor again asks for {now} "
                f"on {now.mesh} (to move a value to another placement or stage, use autopar.reshard(value, mesh, placements))"
            )
        raise AnnotationError(f"tensor {label!r} is already annotated as {before}; shard_tensor again asks for {now}")
    tensors[value.id] = (attr, label)
    return value


def _check_static_dims(attr: DistAttr, shape: list[int], label: str) -> None:
    """A dim of unknown size (-1) cannot be split: autopar slices global arrays by their sizes."""
    for tensor_dim, (size, dims) in enumerate(zip(shape, attr.mapping)):
        if dims and size < 0:
            raise AnnotationError(
                f"tensor {label!r} of shape {shape}: dim {tensor_dim} has no static size and cannot be split; "
                "declare its size (the global batch) when building the program"
            )


def warn_foreign_annotations(program: Any, graph: Any) -> None:
    """Warn about values of ``program`` annotated only on another program (a clone, or the
    same net built again): annotations belong to the program whose Value was annotated.

    Parameters are matched by name (and number of dims) in any other live program: Paddle names
    parameters uniquely per process, so another program holding an annotated parameter of the
    same name is a clone or a rebuild of the same net. Feeds ("x") repeat across unrelated
    programs, so theirs are matched only when this program carries no annotation at all and
    the other is another *build* of it (the same ops in the same order): the batch split the
    user meant for this program, which would otherwise turn data parallelism off without a
    word. (A program annotated on its own leaves its feeds whole on purpose.) Compiling a
    clone unannotated on purpose is legal: a warning, naming the values. Activations are never
    matched (their ids are per program).
    """
    notes = annotations_of(program)
    own = {label for _, label in notes.tensors.values()}
    params = {v.name: len(v.shape) for v in graph.values.values() if v.kind == "parameter"}
    feeds = {v.name: len(v.shape) for v in graph.values.values() if v.kind == "feed"}
    foreign_params, foreign_feeds = set(), set()
    ops: list[tuple[str, tuple]] | None = None
    for other, other_notes in list(_TABLE.items()):
        if other is program or not other_notes.tensors:
            continue
        annotated = {(label, attr.ndim) for attr, label in other_notes.tensors.values() if label not in own}
        foreign_params |= {label for label, ndim in annotated if params.get(label) == ndim}
        wanted = {label for label, ndim in annotated if feeds.get(label) == ndim and not own}
        if wanted and other.num_ops() == program.num_ops():
            ops = ops if ops is not None else _signature(program)
            if _signature(other) == ops:
                foreign_feeds |= wanted
    consequence = {"parameters": "", "feeds": " (its feeds unannotated, the batch is not split: no data parallelism)"}
    for kind, found in (("parameters", foreign_params), ("feeds", foreign_feeds)):
        if found:
            warnings.warn(
                f"{kind} {sorted(found)} were annotated in another program (a clone or a rebuild of this one) and are not "
                "annotated in this one; annotations apply only to the program whose values were annotated: annotate "
                f"this program's values{consequence[kind]}",
                AnnotationWarning,
                stacklevel=3,
            )


def _signature(program: Any) -> list[tuple[str, tuple]]:
    """Each op's name and its results' shapes: equal for two builds of one net."""
    return [
        (op.name(), tuple(tuple(r.shape) if r.is_dense_tensor_type() else None for r in op.results()))
        for op in program.global_block().ops
    ]


def is_startup(program: Any) -> bool:
    """A start-up program: Paddle's default one, or one that initializes parameters
    (``builtin.set_parameter``, which a training program never holds)."""
    import paddle

    if program is paddle.static.default_startup_program():
        return True
    return any(op.name() == "builtin.set_parameter" for op in program.global_block().ops)


def _check_not_startup(program: Any, value: Any, label: str, what: str) -> None:
    """Annotations of a start-up program's values would be ignored (compile places the main
    program's values; the start-up's are sliced from them): refused, naming what the value
    initializes where it can."""
    if not is_startup(program):
        return
    made = []
    for op in value.all_used_ops():
        attrs = op.attrs()
        if op.name() == "builtin.set_parameter":
            made.append(f"parameter {str(attrs['parameter_name'])!r}")
        elif op.name() == "builtin.shadow_output":
            made.append(f"{str(attrs['output_name'])!r}")
    initializes = f" (the initial value of {', '.join(made)})" if made else ""
    raise AnnotationError(
        f"{what}: {label} is a value of a start-up program{initializes}; annotate the main program's values "
        "(its parameters, feeds, intermediates): compile slices the start-up's values to follow them"
    )


def _check_current_program(program: Any, label: str) -> None:
    """Annotating a value of program A while program B is being built is a mistake worth naming.

    Paddle keeps no record of an active ``program_guard``; a non-empty default main program
    other than the value's own is the sign that the user is building something else.
    """
    import paddle

    current = paddle.static.default_main_program()
    if current is not program and current.num_ops() > 0:
        raise AnnotationError(
            f"tensor {label!r} belongs to another program than the current default main program "
            f"({current.num_ops()} ops); call shard_tensor inside program_guard of the tensor's own program"
        )


def shard_op(layer_or_fn: Callable[..., Any], mesh: ProcessMesh) -> Callable[..., Any]:
    """Wrap a layer or function so the ops its calls create are placed on ``mesh``."""
    if not isinstance(mesh, ProcessMesh):
        raise AnnotationError(not_a_mesh("shard_op", mesh))
    if not callable(layer_or_fn):
        raise AnnotationError(f"shard_op needs a layer or function, got {type(layer_or_fn).__name__}")

    @functools.wraps(layer_or_fn)
    def placed(*args: Any, **kwargs: Any) -> Any:
        import paddle

        program = paddle.static.default_main_program()
        before = {op.id() for op in program.global_block().ops}
        out = layer_or_fn(*args, **kwargs)
        table = record(program).ops
        for op in program.global_block().ops:
            if op.id() not in before:
                table[op.id()] = mesh
        return out

    return placed


def keep(*values: Any) -> None:
    """Compute each of ``values`` although nothing in the program reads it: a metric or
    statistic you fetch (``paddle.static.accuracy``). compile removes the ops whose results
    nothing reads before analysis (:mod:`autopar.rewrites.dead_ops`); fetching one of those
    is refused by name."""
    for value in values:
        if not hasattr(value, "is_dense_tensor_type"):
            raise AnnotationError(f"keep takes Values of a static program, got {type(value).__name__}")
        program = program_of(value)
        _check_not_startup(program, value, value_label(value), "keep")
        _check_current_program(program, value_label(value))
        record(program).keep.add(value.id)


def reshard(value: Any, mesh: ProcessMesh, dims_mapping: Any) -> Any:
    """A new value equal to ``value``, placed on ``mesh`` as ``dims_mapping`` says (Paddle's
    ``dist.reshard``): the forward moves the value there, the backward moves its gradient
    back; onto another pipeline stage's mesh it is a send / recv. ``value`` keeps its own
    placement (one value has one annotation; this is the way to ask for a second).

    It is a copy (``paddle.assign``) run on ``mesh``, its result annotated: call it while
    building the program, where Paddle's ``dist.reshard`` would be called."""
    import paddle

    if not isinstance(mesh, ProcessMesh):
        raise AnnotationError(not_a_mesh("reshard", mesh))
    if not hasattr(value, "is_dense_tensor_type") or not value.is_dense_tensor_type():
        raise AnnotationError(f"reshard moves a tensor of a static program, got {type(value).__name__}")
    label = value_label(value)
    program = program_of(value)
    _check_not_startup(program, value, label, "reshard")
    _check_current_program(program, label)
    to_dist_attr(dims_mapping, mesh, len(value.shape), label)  # refused here, naming the value, if it does not fit
    copy = shard_op(paddle.assign, mesh)(value)
    copy.stop_gradient = value.stop_gradient
    return shard_tensor(copy, mesh, dims_mapping)
