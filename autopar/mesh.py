"""ProcessMesh: an n-d array of ranks with named dims (stage: annotate).

A mesh is a value: frozen, hashable, printed as ``mesh(dp=2,mp=2)[0,1,2,3]``. ``mesh[i]``
is the sub-mesh at index ``i`` of the first mesh dim (a pipeline stage); ``groups(mesh_dim)``
lists the rank groups that communicate along one mesh dim.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.errors import MeshError

MAX_DIMS = 32  # deeper nesting is a mistake (and would exhaust Python's recursion limit)


def _rank(value: Any, what: str) -> int:
    """An integer rank >= 0 (ints and numpy integers; never bools, floats or strings)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MeshError(f"{what} must be integer ranks >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise MeshError(f"{what} must be integer ranks >= 0, got {value!r}")
    return int(value)


def _is_nested(value: Any) -> bool:
    """A list of ranks (or of lists): sequences and numpy arrays, never strings."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _shape_and_ranks(nested: Any, depth: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Flatten a nested list of ranks, checking it is rectangular (not ragged)."""
    if not _is_nested(nested):
        return (), (_rank(nested, "mesh entries"),)
    if depth >= MAX_DIMS:
        raise MeshError(f"mesh is nested more than {MAX_DIMS} levels deep; expected a nested list of integer ranks")
    if len(nested) == 0:
        raise MeshError("mesh has an empty dim")
    parts = [_shape_and_ranks(item, depth + 1) for item in nested]
    inner = {shape for shape, _ in parts}
    if len(inner) != 1:
        raise MeshError(f"mesh is ragged: sub-lists have shapes {sorted(inner)}")
    return (len(nested), *parts[0][0]), tuple(r for _, ranks in parts for r in ranks)


def _sequence(value: Any, what: str) -> tuple[Any, ...]:
    if not _is_nested(value):
        raise MeshError(f"{what} must be a list, got {value!r} ({type(value).__name__})")
    return tuple(value)


def _flat_layout(shape: Any, process_ids: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, ranks) from ``shape=`` and ``process_ids=``: integers only, never coerced."""
    mesh_shape = _sequence(shape, "ProcessMesh shape=")
    for extent in mesh_shape:
        if isinstance(extent, bool) or not isinstance(extent, numbers.Integral) or extent <= 0:
            raise MeshError(f"ProcessMesh shape= must be a list of integers >= 1, got {list(mesh_shape)}")
    ranks = tuple(_rank(r, "ProcessMesh process_ids=") for r in _sequence(process_ids, "ProcessMesh process_ids="))
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if math.prod(mesh_shape) != len(ranks):
        raise MeshError(f"mesh shape {list(mesh_shape)} does not hold {len(ranks)} ranks")
    return mesh_shape, ranks


def _layout(
    mesh: Any, shape: Sequence[int] | None, process_ids: Sequence[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, ranks) from a nested rank list, or from ``shape`` and ``process_ids``."""
    if mesh is None:
        if shape is None or process_ids is None:
            raise MeshError("ProcessMesh needs a nested rank list, or shape= and process_ids=")
        mesh_shape, ranks = _flat_layout(shape, process_ids)
    else:
        if shape is not None or process_ids is not None:
            raise MeshError("ProcessMesh takes a nested rank list or shape= and process_ids=, not both")
        if isinstance(mesh, ProcessMesh):
            mesh = mesh.tolist()
        mesh_shape, ranks = _shape_and_ranks(mesh)
    if not mesh_shape:
        raise MeshError(f"mesh must have at least one dim, got the scalar {mesh!r}")
    return mesh_shape, ranks


def _names(dim_names: Any, ndim: int) -> tuple[str, ...]:
    """The dim names: a list of strings (a single string is refused, not split into letters)."""
    if dim_names is None:
        return tuple(f"d{i}" for i in range(ndim))
    if isinstance(dim_names, str) or not _is_nested(dim_names):
        raise MeshError(f"dim_names must be a list of strings, one per mesh dim, got {dim_names!r}")
    return tuple(dim_names)


def _check(shape: tuple[int, ...], ranks: tuple[int, ...], names: tuple[str, ...]) -> None:
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise MeshError(f"mesh has duplicate ranks {dup}")
    if len(names) != len(shape):
        raise MeshError(f"mesh of shape {list(shape)} needs {len(shape)} dim names, got {list(names)}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise MeshError(f"mesh dim names must be distinct non-empty strings, got {list(names)}")


@dataclass(frozen=True, slots=True)
class ProcessMesh:
    """Ranks laid out in an n-d grid; ``dim_names`` name the mesh dims (``dp``, ``mp``, ...).

    Built from a nested rank list, ``ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])``,
    or from ``shape=`` and ``process_ids=`` (alias ``ranks=``, the field name, so that
    ``dataclasses.replace(mesh, dim_names=...)`` works). The hash is computed once: a mesh of
    a thousand ranks is hashed thousands of times during propagation (every DistAttr hash
    includes it). It is never pickled: string hashes differ between processes.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        mesh: Any = None,
        dim_names: Sequence[str] | None = None,
        *,
        shape: Sequence[int] | None = None,
        process_ids: Sequence[int] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        if ranks is not None:
            if process_ids is not None:
                raise MeshError("ProcessMesh takes process_ids= or ranks= (the same thing), not both")
            process_ids = ranks
        mesh_shape, mesh_ranks = _layout(mesh, shape, process_ids)
        names = _names(dim_names, len(mesh_shape))
        _check(mesh_shape, mesh_ranks, names)
        object.__setattr__(self, "shape", mesh_shape)
        object.__setattr__(self, "ranks", mesh_ranks)
        object.__setattr__(self, "dim_names", names)
        object.__setattr__(self, "_hash", hash((mesh_shape, mesh_ranks, names)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Pickle the fields only: the receiving process computes its own hash."""
        return _restore, (self.shape, self.ranks, self.dim_names)

    # ---- structure -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def process_ids(self) -> list[int]:
        """Paddle's name for :attr:`ranks`."""
        return list(self.ranks)

    def mesh_dim(self, name_or_index: str | int) -> int:
        """The index of a mesh dim given by name or (possibly negative) index."""
        if isinstance(name_or_index, str):
            if name_or_index not in self.dim_names:
                raise MeshError(f"unknown mesh dim {name_or_index!r}; {self} has dims {list(self.dim_names)}")
            return self.dim_names.index(name_or_index)
        if isinstance(name_or_index, bool) or not isinstance(name_or_index, numbers.Integral):
            raise MeshError(f"mesh dim must be a name or an index, got {name_or_index!r}")
        name_or_index = int(name_or_index)
        if not -self.ndim <= name_or_index < self.ndim:
            raise MeshError(f"mesh dim {name_or_index} out of range for {self}")
        return name_or_index % self.ndim

    def dim_size(self, name_or_index: str | int) -> int:
        return self.shape[self.mesh_dim(name_or_index)]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The position of ``rank`` in the grid (row-major, last mesh dim innermost)."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank not in self.ranks:
            raise MeshError(f"rank {rank} is not in {self}")
        flat = self.ranks.index(rank)
        coord = []
        for extent in reversed(self.shape):
            coord.append(flat % extent)
            flat //= extent
        return tuple(reversed(coord))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        if not _is_nested(coordinate) or len(coordinate) != self.ndim:
            raise MeshError(f"a coordinate of {self} is a list of {self.ndim} indices, got {coordinate!r}")
        for index, extent in zip(coordinate, self.shape):
            if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < extent:
                raise MeshError(f"coordinate {list(coordinate)} is out of range for {self}")
        return self._rank_at(coordinate)

    def _rank_at(self, coordinate: Sequence[int]) -> int:
        flat = 0
        for index, extent in zip(coordinate, self.shape, strict=True):
            flat = flat * extent + index
        return self.ranks[flat]

    def groups(self, mesh_dims: str | int | Sequence[str | int]) -> list[tuple[int, ...]]:
        """Rank groups that vary along ``mesh_dims`` (all other coordinates fixed), in order."""
        if isinstance(mesh_dims, (str, numbers.Integral)):
            mesh_dims = [mesh_dims]
        if not _is_nested(mesh_dims):
            raise MeshError(f"mesh_dims must be a mesh dim name or index, or a list of them, got {mesh_dims!r}")
        along = [self.mesh_dim(d) for d in mesh_dims]
        fixed = [d for d in range(self.ndim) if d not in along]
        result = []
        for outer in itertools.product(*(range(self.shape[d]) for d in fixed)):
            group = []
            for inner in itertools.product(*(range(self.shape[d]) for d in along)):
                coord = [0] * self.ndim
                for d, i in zip(fixed, outer):
                    coord[d] = i
                for d, i in zip(along, inner):
                    coord[d] = i
                group.append(self._rank_at(coord))
            result.append(tuple(group))
        return result

    def group_of(self, rank: int, mesh_dims: str | int | Sequence[str | int]) -> tuple[int, ...]:
        """The group along ``mesh_dims`` that contains ``rank``."""
        for group in self.groups(mesh_dims):
            if rank in group:
                return group
        raise MeshError(f"rank {rank} is not in {self}")

    def __getitem__(self, index: int) -> ProcessMesh:
        """The sub-mesh at ``index`` of the first mesh dim (keeps the remaining dims)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise MeshError(f"{self}[...] takes an int index into the first mesh dim, got {index!r}")
        index = int(index)
        if not -self.shape[0] <= index < self.shape[0]:
            raise MeshError(f"{self}[{index}] is out of range (first dim has {self.shape[0]} entries)")
        index %= self.shape[0]
        if self.ndim == 1:
            return ProcessMesh([self.ranks[index]], [self.dim_names[0]])
        step = self.size // self.shape[0]
        sub = self.ranks[index * step : (index + 1) * step]
        return ProcessMesh(shape=self.shape[1:], process_ids=sub, dim_names=self.dim_names[1:])

    def contains(self, other: ProcessMesh) -> bool:
        if not isinstance(other, ProcessMesh):
            raise MeshError(f"contains() takes an autopar.ProcessMesh, got {type(other).__name__}")
        return set(other.ranks) <= set(self.ranks)

    def same_grid(self, other: ProcessMesh) -> bool:
        """The same ranks in the same order along the same named dims, dims of size 1 aside:
        ``[pp=1, dp=2, mp=2]`` and its slice ``[dp=2, mp=2]`` (PaddleNLP's meshes)."""

        def spanning(mesh: ProcessMesh) -> list[tuple[str, int]]:
            return [(name, size) for name, size in zip(mesh.dim_names, mesh.shape) if size > 1]

        return self.ranks == other.ranks and spanning(self) == spanning(other)

    def tolist(self) -> Any:
        def build(offset: int, dims: tuple[int, ...]) -> Any:
            if len(dims) == 1:
                return list(self.ranks[offset : offset + dims[0]])
            step = math.prod(dims[1:])
            return [build(offset + i * step, dims[1:]) for i in range(dims[0])]

        return build(0, self.shape)

    # ---- conversions -----------------------------------------------------------------
    def to_paddle(self) -> Any:
        import paddle.distributed as pdist

        return pdist.ProcessMesh(self.tolist(), dim_names=list(self.dim_names))

    @classmethod
    def from_paddle(cls, mesh: Any) -> ProcessMesh:
        return cls(shape=list(mesh.shape), process_ids=list(mesh.process_ids), dim_names=list(mesh.dim_names))

    def __str__(self) -> str:
        dims = ",".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"mesh({dims})[{','.join(map(str, self.ranks))}]"

    __repr__ = __str__


def not_a_mesh(who: str, mesh: Any) -> str:
    """The error text for ``who`` given something that is no autopar.ProcessMesh; a Paddle mesh
    (the spelling of Paddle's own examples) is told how to convert."""
    text = f"{who} needs an autopar.ProcessMesh, got {type(mesh).__name__}"
    if type(mesh).__name__ == "ProcessMesh" and type(mesh).__module__.startswith("paddle"):
        text += " (paddle.distributed's): convert it with autopar.ProcessMesh.from_paddle(mesh)"
    return text


def _restore(shape: tuple[int, ...], ranks: tuple[int, ...], dim_names: tuple[str, ...]) -> ProcessMesh:
    return ProcessMesh(shape=shape, ranks=ranks, dim_names=dim_names)
