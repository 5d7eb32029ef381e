"""Hypothesis strategies for meshes, placements and shapes (shipped for users' own rules)."""

from __future__ import annotations

from hypothesis import strategies as st

from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh


@st.composite
def meshes(draw: st.DrawFn, max_ranks: int = 8, max_ndim: int = 2, names: tuple[str, ...] = ("x", "y", "z")) -> ProcessMesh:
    """1..max_ranks ranks in a 1-d or 2-d (up to max_ndim) grid; ranks shuffled."""
    ndim = draw(st.integers(1, max_ndim))
    shape = []
    budget = max_ranks
    for _ in range(ndim):
        size = draw(st.integers(1, max(1, budget)))
        shape.append(size)
        budget //= size
    size = 1
    for s in shape:
        size *= s
    ranks = draw(st.permutations(list(range(size))))
    return ProcessMesh(shape=shape, process_ids=list(ranks), dim_names=list(names[:ndim]))


@st.composite
def dist_attrs(draw: st.DrawFn, mesh: ProcessMesh, ndim: int, partial: bool = False, kinds: tuple[str, ...] = ("sum",)) -> DistAttr:
    """Each mesh dim splits a random tensor dim, is replicated, or (if ``partial``) partial."""
    mapping: list[list[int]] = [[] for _ in range(ndim)]
    partial_dims = {}
    for mesh_dim in range(mesh.ndim):
        options = ["R"] + (["S"] if ndim else []) + (["P"] if partial else [])
        choice = draw(st.sampled_from(options))
        if choice == "S":
            mapping[draw(st.integers(0, ndim - 1))].append(mesh_dim)
        elif choice == "P":
            partial_dims[mesh_dim] = draw(st.sampled_from(kinds))
    return DistAttr(mesh, [tuple(m) for m in mapping], partial_dims)


def maybe_dist_attrs(mesh: ProcessMesh, ndim: int, partial: bool = False) -> st.SearchStrategy[DistAttr | None]:
    """A placement or ``None`` (no opinion yet), as propagation hands them to rules."""
    return st.one_of(st.none(), dist_attrs(mesh, ndim, partial))


def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 9) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)
