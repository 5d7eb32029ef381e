"""DistAttr: how one tensor lies on a mesh (stage: annotate / propagate).

Inside autopar a DistAttr records, for each tensor dim, the tuple of mesh dims it is split
over (empty = not split) and the mesh dims over which the tensor is *partial* (a pending
reduction: sum, avg, max or min). One tensor dim may be split over several mesh dims
(Paddle's multi-dims mapping, JAX's ``P(("x","y"))``); the public form stays Paddle's
``dims_mapping`` (-1 = not split) and placement lists, converted at the boundary only.

The order of the mesh dims that split one tensor dim is part of the layout and is kept as
given, never sorted: the pieces are numbered in mixed radix over them, the first listed being
the major digit (``("mp", "dp")`` on a ``dp=2, mp=2`` mesh gives rank (dp=1, mp=0) piece
``0 * 2 + 1 = 1``; ``("dp", "mp")`` gives it piece 2). FSDP over TP needs exactly this.

Per mesh dim the layout is a :mod:`autopar.placement` value (``attr.placements``); the text
form, used by ``str``, dumps and tests, is one entry per mesh dim, ``[S(0),R]``,
``[P(sum),S(1)]``, ``[S(0)#1,S(0)]`` (dim 0 split over mesh dims (1, 0));
:meth:`DistAttr.parse` inverts it.

Uneven splits are legal: a size-``n`` dim over ``k`` parts gives shard ``i`` the bounds of
``numpy.array_split`` (the first ``n % k`` shards are one longer); :func:`shard_bounds` is
the one definition every pass and the runtime use.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import MeshError, PlacementError
from autopar.mesh import ProcessMesh, not_a_mesh
from autopar.placement import (
    REDUCE_KINDS,
    Partial,
    Placement,
    Replicate,
    Shard,
    from_paddle_placement,
    parse_placement,
    to_paddle_placement,
)

__all__ = ["REDUCE_KINDS", "DistAttr", "shard_bounds"]


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``index`` when ``size`` elements are split into ``parts``."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


_PARTIAL_FORM = (
    "partial_dims must be a set of mesh dims (names or indices), a dict mesh dim -> reduce kind, or (dim, kind) pairs"
)


def _is_index(value: Any) -> bool:
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _partial_item(item: Any) -> tuple[Any, Any]:
    if _is_index(item) or isinstance(item, str):
        return item, "sum"
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2:
        return item[0], item[1]
    raise PlacementError(f"{_PARTIAL_FORM}; got the entry {item!r}")


def _spans(mesh: ProcessMesh, mesh_dim: int) -> bool:
    """Whether ``mesh_dim`` has more than one rank (a dim out of range is kept, to be refused)."""
    return not 0 <= mesh_dim < mesh.ndim or mesh.shape[mesh_dim] > 1


def _normalize_partial(partial: Any, mesh: ProcessMesh | None = None) -> tuple[tuple[int, str], ...]:
    """Partial mesh dims -> sorted ((mesh dim, kind), ...); names need ``mesh``."""
    if partial is None:
        return ()
    if isinstance(partial, Mapping):
        items = list(partial.items())
    elif isinstance(partial, (str, bytes)) or not isinstance(partial, Iterable):
        raise PlacementError(f"{_PARTIAL_FORM}; got {partial!r}")
    else:
        items = [_partial_item(p) for p in partial]
    out = {}
    for mesh_dim, kind in items:
        out[_partial_dim(mesh_dim, mesh)] = Partial(kind).reduce  # validates the kind
    return tuple(sorted(out.items()))


def _partial_dim(mesh_dim: Any, mesh: ProcessMesh | None) -> int:
    if isinstance(mesh_dim, str) and mesh is not None:
        try:
            return mesh.mesh_dim(mesh_dim)
        except MeshError as err:
            raise PlacementError(f"partial_dims: {err}") from err
    if not _is_index(mesh_dim) or mesh_dim < 0:
        raise PlacementError(f"partial_dims: a mesh dim is a name or an index >= 0, got {mesh_dim!r}")
    return int(mesh_dim)


@dataclass(frozen=True, slots=True)
class DistAttr:
    """Placement of one tensor: ``mesh``, per-tensor-dim split mesh dims, partial mesh dims.

    ``DistAttr(mesh, dims_mapping=[0, -1], partial_dims={1})``: dim 0 split over mesh dim 0,
    dim 1 whole, pending sum over mesh dim 1. ``partial_dims`` may also map mesh dim -> kind.
    ``DistAttr(mesh, [("mp", "dp"), None])``: dim 0 split over mp (major) then dp.
    The field names ``mapping=`` / ``partial=`` are accepted as keyword aliases so that
    ``dataclasses.replace(attr, partial=((1, "sum"),))`` works. The hash is computed once
    (planner states and rule caches hash DistAttrs constantly) and never pickled.
    """

    mesh: ProcessMesh
    mapping: tuple[tuple[int, ...], ...]
    partial: tuple[tuple[int, str], ...] = ()
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        mesh: ProcessMesh,
        dims_mapping: Sequence[Any] | None = None,
        partial_dims: Any = None,
        *,
        mapping: Sequence[Any] | None = None,
        partial: Any = None,
    ) -> None:
        if not isinstance(mesh, ProcessMesh):
            raise PlacementError(not_a_mesh("DistAttr", mesh))
        if mapping is not None:
            if dims_mapping is not None:
                raise PlacementError(f"DistAttr takes dims_mapping or mapping= (its field name), not both: {mapping!r}")
            dims_mapping = mapping
        if partial is not None:
            if partial_dims is not None:
                raise PlacementError(f"DistAttr takes partial_dims or partial= (its field name), not both: {partial!r}")
            partial_dims = partial
        entries = tuple(_normalize_entry(e, mesh) for e in _mapping_entries(dims_mapping))
        partial_t = _normalize_partial(partial_dims, mesh)
        if 1 in mesh.shape:  # a mesh dim of size 1 splits nothing and has nothing pending: no one-rank collectives
            entries = tuple(tuple(d for d in entry if _spans(mesh, d)) for entry in entries)
            partial_t = tuple((d, kind) for d, kind in partial_t if _spans(mesh, d))
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "mapping", entries)
        object.__setattr__(self, "partial", partial_t)
        object.__setattr__(self, "_hash", hash((mesh, entries, partial_t)))
        self._validate()

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Pickle the fields only: the receiving process computes its own hash."""
        return DistAttr, (self.mesh, self.mapping, self.partial)

    def _validate(self) -> None:
        used: list[int] = [d for dims in self.mapping for d in dims]
        for mesh_dim in used + [d for d, _ in self.partial]:
            if not 0 <= mesh_dim < self.mesh.ndim:
                raise PlacementError(f"mesh dim {mesh_dim} out of range for {self.mesh}")
        seen = used + [d for d, _ in self.partial]
        if len(set(seen)) != len(seen):
            twice = sorted({self.mesh.dim_names[d] for d in seen if seen.count(d) > 1})
            raise PlacementError(f"mesh dim(s) {twice} used twice in dims_mapping {self.dims_mapping_text}")

    # ---- views -----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.mapping)

    @property
    def dims_mapping(self) -> list[int]:
        """Paddle's form: per tensor dim the mesh dim it is split over, -1 if none."""
        out = []
        for dims in self.mapping:
            if len(dims) > 1:
                raise PlacementError(f"{self} splits one tensor dim over mesh dims {dims}; read .mapping")
            out.append(dims[0] if dims else -1)
        return out

    @property
    def dims_mapping_text(self) -> str:
        return "[" + ",".join("/".join(map(str, d)) if d else "-1" for d in self.mapping) + "]"

    @property
    def partial_dims(self) -> dict[int, str]:
        return dict(self.partial)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.mapping)

    def sharded_mesh_dims(self) -> set[int]:
        return {d for dims in self.mapping for d in dims}

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim. A tensor dim split over several mesh dims in other than
        ascending mesh-dim order carries each one's ``shard_order``; ascending ones leave it 0."""
        out: list[Placement] = [Replicate()] * self.mesh.ndim
        for tensor_dim, dims in enumerate(self.mapping):
            ascending = list(dims) == sorted(dims)
            for order, mesh_dim in enumerate(dims):
                out[mesh_dim] = Shard(tensor_dim, 0 if ascending else order)
        for mesh_dim, kind in self.partial:
            out[mesh_dim] = Partial(kind)
        return tuple(out)

    def placement_of(self, mesh_dim: int) -> Placement:
        """The placement along one mesh dim: ``Shard(i)``, ``Partial(kind)`` or ``Replicate()``."""
        return self.placements[mesh_dim]

    def __str__(self) -> str:
        return "[" + ",".join(map(str, self.placements)) + "]"

    def __repr__(self) -> str:
        return f"DistAttr({self.mesh}, {self})"

    # ---- derived values --------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: ProcessMesh, ndim: int) -> DistAttr:
        return _cached(mesh, ((),) * ndim, ())

    @classmethod
    def of(cls, mesh: ProcessMesh, mapping: tuple[tuple[int, ...], ...], partial: Any = None) -> DistAttr:
        """Fast, cached constructor for the normalized form rules produce (hot in propagation)."""
        if partial and not isinstance(partial, tuple):
            partial = (
                tuple(sorted(partial.items())) if isinstance(partial, Mapping) else _normalize_partial(partial, mesh)
            )
        return _cached(mesh, tuple(tuple(d) for d in mapping), partial or ())

    def with_mapping(self, mapping: Sequence[Any]) -> DistAttr:
        return DistAttr(self.mesh, mapping, self.partial)

    def with_partial(self, partial: Any) -> DistAttr:
        return DistAttr.of(self.mesh, self.mapping, _normalize_partial(partial, self.mesh))

    @classmethod
    def parse(cls, text: str, mesh: ProcessMesh, ndim: int) -> DistAttr:
        """Invert ``str``: ``"[S(0),P(sum)]"`` on a 2-d mesh for a tensor of ``ndim`` dims."""
        if not isinstance(text, str):
            raise PlacementError(f"DistAttr.parse takes the text form, e.g. '[S(0),R]', got {text!r}")
        if not isinstance(mesh, ProcessMesh):
            raise PlacementError(not_a_mesh("DistAttr.parse", mesh))
        items = [t for t in text.strip().strip("[]").split(",") if t.strip()]
        if len(items) != mesh.ndim:
            raise PlacementError(f"{text!r} has {len(items)} placements, {mesh} has {mesh.ndim} dims")
        try:
            return cls.from_placements(mesh, [parse_placement(item) for item in items], ndim)
        except PlacementError as err:
            raise PlacementError(f"{err} (in {text!r})") from err

    # ---- local pieces ----------------------------------------------------------------
    def shard_index(self, tensor_dim: int, rank: int) -> tuple[int, int]:
        """(index, parts) of ``rank``'s piece along ``tensor_dim``.

        Mixed radix over the mesh dims splitting ``tensor_dim``, in mapping order: the first
        listed is the major digit, the last the minor one (a new split appended innermost
        subdivides each existing piece).
        """
        if not _is_index(tensor_dim) or not 0 <= tensor_dim < len(self.mapping):
            raise PlacementError(f"tensor dim {tensor_dim!r} is out of range for dims_mapping {self.dims_mapping_text}")
        coord = self.mesh.coordinate(rank)
        index, parts = 0, 1
        for mesh_dim in self.mapping[tensor_dim]:
            index = index * self.mesh.shape[mesh_dim] + coord[mesh_dim]
            parts *= self.mesh.shape[mesh_dim]
        return index, parts

    def local_slices(self, shape: Sequence[int], rank: int) -> tuple[slice, ...]:
        self.check_shape(shape)
        if not all(_is_index(size) and size >= -1 for size in shape):  # -1: a size Paddle leaves unknown
            raise PlacementError(f"a shape is a list of sizes (ints >= 0, or -1 for unknown), got {list(shape)}")
        if not _is_index(rank):
            raise PlacementError(f"rank must be an int rank of {self.mesh}, got {rank!r}")
        return _local_slices(self, tuple(shape), rank)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local_slices(shape, rank))

    def check_shape(self, shape: Sequence[int], what: str = "tensor") -> None:
        if not isinstance(shape, (tuple, list)) and (
            isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence)
        ):
            raise PlacementError(f"{what} shape must be a list of sizes, got {shape!r}")
        if len(shape) != self.ndim:
            raise PlacementError(
                f"{what} of shape {list(shape)} has {len(shape)} dims, dims_mapping {self.dims_mapping_text} has {self.ndim}"
            )

    # ---- Paddle conversions ----------------------------------------------------------
    def to_placements(self) -> list[Any]:
        """Paddle placement list, one per mesh dim (``Shard(i)``, ``Replicate()``, ``Partial()``)."""
        return [to_paddle_placement(p) for p in self.placements]

    @classmethod
    def from_placements(cls, mesh: ProcessMesh, placements: Sequence[Any], ndim: int) -> DistAttr:
        """From one placement per mesh dim, Paddle's or ours (:mod:`autopar.placement`).

        Mesh dims splitting the same tensor dim are ordered by ``shard_order``, then by mesh
        dim (Paddle's rule), so all-zero orders mean ascending mesh-dim order.
        """
        if not isinstance(mesh, ProcessMesh):
            raise PlacementError(not_a_mesh("from_placements", mesh))
        if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
            raise PlacementError(f"placements must be a list with one placement per mesh dim, got {placements!r}")
        if not _is_index(ndim) or ndim < 0:
            raise PlacementError(f"ndim must be the tensor's number of dims (an int >= 0), got {ndim!r}")
        if len(placements) != mesh.ndim:
            raise PlacementError(f"{len(placements)} placements given for {mesh} with {mesh.ndim} dims")
        splits: list[list[tuple[int, int]]] = [[] for _ in range(ndim)]
        partial = {}
        for mesh_dim, placement in enumerate(placements):
            value = from_paddle_placement(placement)
            if isinstance(value, Shard):
                if not -ndim <= value.dim < ndim:
                    raise PlacementError(f"{value} on mesh dim {mesh_dim} is out of range for a {ndim}-d tensor")
                splits[value.dim % ndim].append((value.shard_order, mesh_dim))
            elif isinstance(value, Partial):
                partial[mesh_dim] = value.reduce
        return cls(mesh, [tuple(d for _, d in sorted(split)) for split in splits], partial)

    def to_paddle(self) -> Any:
        """Paddle's ``TensorDistAttr`` (multi-dims mappings are not expressible there)."""
        from paddle.distributed.auto_parallel.static.dist_attribute import TensorDistAttr

        attr = TensorDistAttr()
        attr.process_mesh = self.mesh.to_paddle()
        attr.dims_mapping = self.dims_mapping
        if self.partial:
            attr._set_partial_dims([d for d, _ in self.partial])
        return attr

    @classmethod
    def from_paddle(cls, attr: Any) -> DistAttr:
        mesh = ProcessMesh.from_paddle(attr.process_mesh)
        partial = attr._partial_dims() if attr._is_partial() else ()
        return cls(mesh, list(attr.dims_mapping), set(partial))


@functools.lru_cache(maxsize=65536)
def _cached(mesh: ProcessMesh, mapping: tuple[tuple[int, ...], ...], partial: tuple[tuple[int, str], ...]) -> DistAttr:
    return DistAttr(mesh, mapping, partial)


def _normalize_entry(entry: Any, mesh: ProcessMesh) -> tuple[int, ...]:
    """One dims_mapping entry -> tuple of mesh dim indices, in the order given (major first)."""
    try:
        return _entry_dims(entry, mesh)
    except MeshError as err:
        raise PlacementError(str(err)) from err


def _mapping_entries(dims_mapping: Any) -> tuple[Any, ...]:
    if dims_mapping is None:
        return ()
    if isinstance(dims_mapping, (str, bytes, Mapping)) or not isinstance(dims_mapping, Sequence):
        raise PlacementError(
            f"dims_mapping must be a list with one entry per tensor dim (a mesh dim name or index, None or -1), got {dims_mapping!r}"
        )
    return tuple(dims_mapping)


_ENTRY_FORM = "dims_mapping entry must be a mesh dim name, index, None or -1, or a tuple of mesh dims"


def _entry_dims(entry: Any, mesh: ProcessMesh) -> tuple[int, ...]:
    if entry is None or (_is_index(entry) and entry == -1):
        return ()
    if isinstance(entry, str) or (_is_index(entry) and entry >= 0):
        return (mesh.mesh_dim(entry),)
    if isinstance(entry, (tuple, list)):
        for item in entry:
            if not (isinstance(item, str) or (_is_index(item) and item >= 0)):
                raise PlacementError(f"{_ENTRY_FORM}; the tuple {entry!r} holds {item!r}")
        return tuple(mesh.mesh_dim(e) for e in entry)
    raise PlacementError(f"{_ENTRY_FORM}; got {entry!r}")


@functools.lru_cache(maxsize=65536)
def _local_slices(attr: DistAttr, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """Cached: passes ask for the same (placement, shape, rank) for many values."""
    out = []
    for tensor_dim, size in enumerate(shape):
        index, parts = attr.shard_index(tensor_dim, rank)
        out.append(slice(*shard_bounds(size, parts, index)))
    return tuple(out)
