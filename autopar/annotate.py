"""User annotations on PIR programs: ``shard_tensor`` and ``shard_op`` (stage: annotate).

Annotations are kept beside the program (a weak table keyed by the Program object), never
written into it: the user's program stays exactly as built. ``compile`` reads them back.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.errors import AnnotationError, AutoparError, PlacementError
from autopar.mesh import ProcessMesh
from autopar.placement import Placement


@dataclass
class ProgramAnnotations:
    """What the user said about one program: value placements and op meshes."""

    tensors: dict[str, tuple[DistAttr, str]] = field(default_factory=dict)  # value impl id -> (attr, label)
    ops: dict[int, ProcessMesh] = field(default_factory=dict)  # op id -> mesh


_TABLE: weakref.WeakKeyDictionary[Any, ProgramAnnotations] = weakref.WeakKeyDictionary()


def annotations_of(program: Any) -> ProgramAnnotations:
    """The annotations recorded for ``program`` (empty if none)."""
    try:
        return _TABLE.get(program) or ProgramAnnotations()
    except TypeError:
        return ProgramAnnotations()


def _record(program: Any) -> ProgramAnnotations:
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
    try:
        return value.get_defining_op().get_parent_block().program
    except (AttributeError, ValueError) as err:
        raise AnnotationError(f"shard_tensor expects a Value of a static PIR program, got {type(value).__name__}") from err


def _is_placement_list(spec: Sequence[Any]) -> bool:
    import paddle.distributed as pdist

    return bool(spec) and all(isinstance(p, (pdist.Placement, Placement)) for p in spec)


def to_dist_attr(spec: Any, mesh: ProcessMesh, ndim: int, label: str) -> DistAttr:
    """A user's dims_mapping (names, indices, None/-1) or Paddle placement list -> DistAttr."""
    if isinstance(spec, DistAttr):
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
        raise AnnotationError(f"shard_tensor needs an autopar.ProcessMesh, got {type(mesh).__name__}")
    program = program_of(value)
    label = value_label(value)
    _check_current_program(program, label)
    attr = to_dist_attr(dims_mapping, mesh, len(value.shape), label)
    _record(program).tensors[value.id] = (attr, label)
    return value


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
        raise AnnotationError(f"shard_op needs an autopar.ProcessMesh, got {type(mesh).__name__}")
    if not callable(layer_or_fn):
        raise AnnotationError(f"shard_op needs a layer or function, got {type(layer_or_fn).__name__}")

    @functools.wraps(layer_or_fn)
    def placed(*args: Any, **kwargs: Any) -> Any:
        import paddle

        program = paddle.static.default_main_program()
        before = {op.id() for op in program.global_block().ops}
        out = layer_or_fn(*args, **kwargs)
        table = _record(program).ops
        for op in program.global_block().ops:
            if op.id() not in before:
                table[op.id()] = mesh
        return out

    return placed
