import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.dist_attr import shard_bounds
from autopar.errors import PlacementError
from autopar.testing import dist_attrs, meshes

MESH = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_text_form_and_public_views():
    attr = DistAttr(MESH, dims_mapping=[0, -1], partial_dims={1})
    assert str(attr) == "[S(0),P(sum)]"
    assert attr.dims_mapping == [0, -1] and attr.partial_dims == {1: "sum"}
    assert DistAttr(MESH, ["mp", None]).dims_mapping == [1, -1]
    assert str(DistAttr(MESH, [("dp", "mp"), None])) == "[S(0),S(0)]"
    assert str(DistAttr(MESH, [None, None], {0: "max"})) == "[P(max),R]"


def test_immutable_and_hashable():
    a, b = DistAttr(MESH, [0, -1]), DistAttr(MESH, ["dp", None])
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.mapping = ()
    assert a.with_partial({1}) != a


@given(st.data())
def test_parse_inverts_str(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(0, 3))
    attr = data.draw(dist_attrs(mesh, ndim, partial=True, kinds=("sum", "avg", "max", "min")))
    assert DistAttr.parse(str(attr), mesh, ndim) == attr


@given(st.data())
def test_paddle_placements_round_trip(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(1, 3))
    attr = data.draw(dist_attrs(mesh, ndim, partial=True, kinds=("sum", "avg", "max", "min")))
    assert DistAttr.from_placements(mesh, attr.to_placements(), ndim) == attr


def test_paddle_tensor_dist_attr_round_trip():
    attr = DistAttr(MESH, [-1, 1], {0})
    paddle_attr = attr.to_paddle()
    assert list(paddle_attr.dims_mapping) == [-1, 1]
    assert DistAttr.from_paddle(paddle_attr) == attr


@given(st.integers(0, 50), st.integers(1, 9))
def test_shard_bounds_tile_the_dim(size, parts):
    bounds = [shard_bounds(size, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert [len(c) for c in np.array_split(np.arange(size), parts)] == lengths


def test_uneven_local_shapes_and_multi_mesh_dim_split():
    attr = DistAttr(MESH, [("dp", "mp"), None])
    shapes = [attr.local_shape([7, 3], r) for r in MESH.ranks]
    assert shapes == [(2, 3), (2, 3), (2, 3), (1, 3)]
    attr = DistAttr(MESH, ["mp", "dp"])
    assert attr.local_slices([5, 4], 1) == (slice(3, 5), slice(0, 2))


@pytest.mark.parametrize(
    "mapping, partial, message",
    [
        (["dp", "dp"], None, "used twice"),
        (["dp", None], {0}, "used twice"),
        (["pp", None], None, "unknown mesh dim 'pp'"),
        ([5, None], None, "out of range"),
        ([0.5], None, "must be a mesh dim name, index, None or -1"),
    ],
)
def test_bad_dims_mappings(mapping, partial, message):
    with pytest.raises(PlacementError, match=message):
        DistAttr(MESH, mapping, partial)


def test_shape_mismatch_is_named():
    with pytest.raises(PlacementError, match=r"shape \[4\] has 1 dims, dims_mapping \[0,-1\] has 2"):
        DistAttr(MESH, [0, -1]).local_shape([4], 0)
