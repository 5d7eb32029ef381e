"""DistAttr: how one tensor lies on a mesh (stage: annotate / propagate).

Inside autopar a DistAttr records, for each tensor dim, the tuple of mesh dims it is split
over (ascending; empty = not split) and the mesh dims over which the tensor is *partial*
(a pending reduction: sum, avg, max or min). One tensor dim may be split over several mesh
dims (Paddle's multi-dims mapping, JAX's ``P(("x","y"))``); the public form stays Paddle's
``dims_mapping`` (-1 = not split) and placement lists, converted at the boundary only.

Text form, used by ``str``, dumps and tests: one entry per mesh dim, ``[S(0),R]``,
``[P(sum),S(1)]``; :meth:`DistAttr.parse` inverts it.

Uneven splits are legal: a size-``n`` dim over ``k`` parts gives shard ``i`` the bounds of
``numpy.array_split`` (the first ``n % k`` shards are one longer); :func:`shard_bounds` is
the one definition every pass and the runtime use.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import MeshError, PlacementError
from autopar.mesh import ProcessMesh

REDUCE_KINDS = ("sum", "avg", "max", "min")
_PADDLE_REDUCE = {"sum": "kRedSum", "avg": "kRedAvg", "max": "kRedMax", "min": "kRedMin"}


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``index`` when ``size`` elements are split into ``parts``."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _normalize_partial(partial: Any) -> tuple[tuple[int, str], ...]:
    if partial is None:
        return ()
    if isinstance(partial, Mapping):
        items = list(partial.items())
    else:
        items = [(p, "sum") if isinstance(p, int) else tuple(p) for p in partial]
    out = {}
    for mesh_dim, kind in items:
        if kind not in REDUCE_KINDS:
            raise PlacementError(f"unknown partial reduce kind {kind!r}; expected one of {REDUCE_KINDS}")
        out[int(mesh_dim)] = kind
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class DistAttr:
    """Placement of one tensor: ``mesh``, per-tensor-dim split mesh dims, partial mesh dims.

    ``DistAttr(mesh, dims_mapping=[0, -1], partial_dims={1})``: dim 0 split over mesh dim 0,
    dim 1 whole, pending sum over mesh dim 1. ``partial_dims`` may also map mesh dim -> kind.
    """

    mesh: ProcessMesh
    mapping: tuple[tuple[int, ...], ...]
    partial: tuple[tuple[int, str], ...] = ()

    def __init__(self, mesh: ProcessMesh, dims_mapping: Sequence[Any] = (), partial_dims: Any = None) -> None:
        if not isinstance(mesh, ProcessMesh):
            raise PlacementError(f"DistAttr needs an autopar.ProcessMesh, got {type(mesh).__name__}")
        mapping = tuple(_normalize_entry(entry, mesh) for entry in dims_mapping)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "mapping", mapping)
        object.__setattr__(self, "partial", _normalize_partial(partial_dims))
        self._validate()

    def _validate(self) -> None:
        used: list[int] = [d for dims in self.mapping for d in dims]
        for mesh_dim in used + [d for d, _ in self.partial]:
            if not 0 <= mesh_dim < self.mesh.ndim:
                raise PlacementError(f"mesh dim {mesh_dim} out of range for {self.mesh}")
        for dims in self.mapping:
            if list(dims) != sorted(dims):
                raise PlacementError(f"a tensor dim split over several mesh dims lists them ascending, got {dims}")
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

    def placement_of(self, mesh_dim: int) -> str:
        """``S(i)``, ``P(kind)`` or ``R`` for one mesh dim."""
        for tensor_dim, dims in enumerate(self.mapping):
            if mesh_dim in dims:
                return f"S({tensor_dim})"
        kind = self.partial_dims.get(mesh_dim)
        return f"P({kind})" if kind else "R"

    def __str__(self) -> str:
        return "[" + ",".join(self.placement_of(d) for d in range(self.mesh.ndim)) + "]"

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
            partial = tuple(sorted(partial.items())) if isinstance(partial, Mapping) else _normalize_partial(partial)
        return _cached(mesh, tuple(tuple(d) for d in mapping), partial or ())

    def with_mapping(self, mapping: Sequence[Any]) -> DistAttr:
        return DistAttr(self.mesh, mapping, self.partial)

    def with_partial(self, partial: Any) -> DistAttr:
        return DistAttr.of(self.mesh, self.mapping, _normalize_partial(partial))

    @classmethod
    def parse(cls, text: str, mesh: ProcessMesh, ndim: int) -> DistAttr:
        """Invert ``str``: ``"[S(0),P(sum)]"`` on a 2-d mesh for a tensor of ``ndim`` dims."""
        items = [t.strip() for t in text.strip().strip("[]").split(",") if t.strip()]
        if len(items) != mesh.ndim:
            raise PlacementError(f"{text!r} has {len(items)} placements, {mesh} has {mesh.ndim} dims")
        mapping: list[list[int]] = [[] for _ in range(ndim)]
        partial = {}
        for mesh_dim, item in enumerate(items):
            if item == "R":
                continue
            if m := re.fullmatch(r"S\((-?\d+)\)", item):
                tensor_dim = int(m.group(1))
                if not -ndim <= tensor_dim < ndim:
                    raise PlacementError(f"{item} in {text!r} is out of range for a {ndim}-d tensor")
                mapping[tensor_dim % ndim].append(mesh_dim)
            elif m := re.fullmatch(r"P\((\w+)\)", item):
                partial[mesh_dim] = m.group(1)
            else:
                raise PlacementError(f"cannot parse placement {item!r} in {text!r}")
        return cls(mesh, [tuple(m) for m in mapping], partial)

    # ---- local pieces ----------------------------------------------------------------
    def shard_index(self, tensor_dim: int, rank: int) -> tuple[int, int]:
        """(index, parts) of ``rank``'s piece along ``tensor_dim`` (mixed radix over its mesh dims)."""
        coord = self.mesh.coordinate(rank)
        index, parts = 0, 1
        for mesh_dim in self.mapping[tensor_dim]:
            index = index * self.mesh.shape[mesh_dim] + coord[mesh_dim]
            parts *= self.mesh.shape[mesh_dim]
        return index, parts

    def local_slices(self, shape: Sequence[int], rank: int) -> tuple[slice, ...]:
        self.check_shape(shape)
        out = []
        for tensor_dim, size in enumerate(shape):
            index, parts = self.shard_index(tensor_dim, rank)
            out.append(slice(*shard_bounds(size, parts, index)))
        return tuple(out)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local_slices(shape, rank))

    def check_shape(self, shape: Sequence[int], what: str = "tensor") -> None:
        if len(shape) != self.ndim:
            raise PlacementError(
                f"{what} of shape {list(shape)} has {len(shape)} dims, dims_mapping {self.dims_mapping_text} has {self.ndim}"
            )

    # ---- Paddle conversions ----------------------------------------------------------
    def to_placements(self) -> list[Any]:
        """Paddle placement list, one per mesh dim (``Shard(i)``, ``Replicate()``, ``Partial()``)."""
        import paddle.distributed as pdist

        out = []
        for mesh_dim in range(self.mesh.ndim):
            text = self.placement_of(mesh_dim)
            if text.startswith("S("):
                out.append(pdist.Shard(int(text[2:-1])))
            elif text.startswith("P("):
                out.append(pdist.Partial(getattr(pdist.ReduceType, _PADDLE_REDUCE[text[2:-1]])))
            else:
                out.append(pdist.Replicate())
        return out

    @classmethod
    def from_placements(cls, mesh: ProcessMesh, placements: Sequence[Any], ndim: int) -> DistAttr:
        import paddle.distributed as pdist

        if len(placements) != mesh.ndim:
            raise PlacementError(f"{len(placements)} placements given for {mesh} with {mesh.ndim} dims")
        items = []
        for p in placements:
            if isinstance(p, pdist.Shard):
                items.append(f"S({p.get_dim()})")
            elif isinstance(p, pdist.Partial):
                reverse = {v: k for k, v in _PADDLE_REDUCE.items()}
                kind = reverse.get(p.reduce_type().name)
                if kind is None:
                    raise PlacementError(f"Partial reduce type {p.reduce_type().name} is not supported")
                items.append(f"P({kind})")
            elif isinstance(p, pdist.Replicate):
                items.append("R")
            else:
                raise PlacementError(f"not a Paddle placement: {p!r}")
        return cls.parse("[" + ",".join(items) + "]", mesh, ndim)

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
    """One dims_mapping entry -> ascending tuple of mesh dim indices."""
    try:
        return _entry_dims(entry, mesh)
    except MeshError as err:
        raise PlacementError(str(err)) from err


def _entry_dims(entry: Any, mesh: ProcessMesh) -> tuple[int, ...]:
    if entry is None or (isinstance(entry, int) and not isinstance(entry, bool) and entry == -1):
        return ()
    if isinstance(entry, (str, int)) and not isinstance(entry, bool):
        return (mesh.mesh_dim(entry),)
    if isinstance(entry, Iterable):
        dims = tuple(mesh.mesh_dim(e) for e in entry)
        return tuple(sorted(dims)) if len(set(dims)) == len(dims) else dims
    raise PlacementError(f"dims_mapping entry must be a mesh dim name, index, None or -1; got {entry!r}")
