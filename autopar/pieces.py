"""Global tensor <-> per-rank pieces, by a DistAttr (used by the runtime and the rule checker).

``scatter`` cuts a global array into each rank's piece (a partial placement is made up: the
group's first rank holds the value and the others the reduction's identity, or random pieces
that reduce back to it when an ``rng`` is given); ``assemble`` is its inverse: partial pieces
are reduced over their mesh dims (ascending), then shards are placed by their bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.low_precision import is_low
from autopar.low_precision import reduce as reduce_low

REDUCERS = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


def split_partial(value: np.ndarray, kind: str, parts: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """``parts`` pieces whose reduction by ``kind`` is ``value`` (random if ``rng``)."""
    if parts == 1:
        return [value.copy()]
    if rng is None:
        if kind in ("max", "min", "avg"):
            return [value.copy() for _ in range(parts)]
        return [value.copy()] + [np.zeros_like(value) for _ in range(parts - 1)]
    noise = [rng.standard_normal(value.shape).astype(value.dtype) for _ in range(parts - 1)]
    if kind == "sum":
        return noise + [value - sum(noise)]
    if kind == "avg":
        return noise + [value * parts - sum(noise)]
    sign = -1 if kind == "max" else 1
    pieces = [value + sign * (np.abs(n) + 0.1) for n in noise]
    pieces.insert(int(rng.integers(parts)), value.copy())
    return pieces


def scatter(value: np.ndarray, dist: DistAttr, rng: np.random.Generator | None = None) -> dict[int, np.ndarray]:
    """Each rank's local piece of a global ``value`` lying as ``dist``."""
    dist.check_shape(value.shape)
    mesh = dist.mesh
    pieces = {rank: value[dist.local_slices(value.shape, rank)] for rank in mesh.ranks}
    # split in reverse of the assemble order: the last-reduced mesh dim splits first.
    # Pieces stay identical along replicated mesh dims (as a real program's are): groups
    # that differ only in replicated coordinates share one split.
    significant = dist.sharded_mesh_dims() | set(dist.partial_dims)
    for mesh_dim, kind in reversed(sorted(dist.partial_dims.items())):
        splits: dict[tuple[int, ...], list[np.ndarray]] = {}
        for group in mesh.groups(mesh_dim):
            coord = mesh.coordinate(group[0])
            key = tuple(coord[d] for d in sorted(significant - {mesh_dim}))
            if key not in splits:
                splits[key] = split_partial(pieces[group[0]], kind, len(group), rng)
            for rank, piece in zip(group, splits[key]):
                pieces[rank] = piece
    return pieces


def reduce_partials(pieces: Mapping[int, np.ndarray], dist: DistAttr, dtype: str = "float32") -> dict[int, np.ndarray]:
    """Reduce every rank's piece over the partial mesh dims (ascending mesh dim order); a
    low-precision ``dtype`` by its rule (member by member, each addition rounded)."""
    out = dict(pieces)
    for mesh_dim, kind in sorted(dist.partial_dims.items()):
        for group in dist.mesh.groups(mesh_dim):
            shapes = {out[r].shape for r in group}
            if len(shapes) != 1:
                raise AutoparError(f"partial pieces over mesh dim {mesh_dim} differ in shape: {shapes}")
            arrays = [out[r] for r in group]
            if arrays[0].dtype == np.uint16 and not is_low(dtype):
                raise AutoparError(f"partial pieces of uint16 (bfloat16 bits) reduced as {dtype}: give the value's dtype")
            reduced = reduce_low(arrays, kind, dtype) if is_low(dtype) else REDUCERS[kind](np.stack(arrays), axis=0)
            for rank in group:
                out[rank] = reduced
    return out


def assemble(pieces: Mapping[int, np.ndarray], dist: DistAttr, shape: Sequence[int], dtype: str = "float32") -> np.ndarray:
    """The global array from every rank's piece (partials reduced, shards placed); only the
    ranks of ``dist``'s mesh are read (a pipeline stage's value is on its ranks only).
    ``dtype``: the value's (a bfloat16 one's pieces are its bits, reduced by
    :func:`autopar.low_precision.reduce`)."""
    reduced = reduce_partials({r: pieces[r] for r in dist.mesh.ranks}, dist, dtype)
    first = next(iter(reduced.values()))
    out = np.empty(tuple(shape), dtype=first.dtype)
    for rank, piece in reduced.items():
        out[dist.local_slices(shape, rank)] = piece
    return out
