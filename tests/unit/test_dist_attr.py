import copy
import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.dist_attr import shard_bounds
from autopar.errors import PlacementError
from autopar.placement import Partial, Replicate, Shard, from_paddle_placement, parse_placement
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


# ---- placement values -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, text",
    [
        (Shard(0), "S(0)"),
        (Shard(2, 1), "S(2)#1"),
        (Replicate(), "R"),
        (Partial(), "P(sum)"),
        (Partial("max"), "P(max)"),
    ],
)
def test_placement_text_round_trip(value, text):
    assert str(value) == text and parse_placement(text) == value
    assert hash(parse_placement(text)) == hash(value)


def test_placement_values_are_validated_frozen_and_distinct():
    assert len({Shard(0), Shard(0), Shard(0, 0), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    assert Shard(0) != Shard(1) and Partial("sum") != Partial("max") and Shard(0) != Replicate()
    with pytest.raises(AttributeError):
        Shard(0).dim = 1
    for bad, message in [
        (lambda: Partial("prod"), "'prod'"),
        (lambda: Shard("0"), "'0'"),
        (lambda: Shard(True), "True"),
        (lambda: Shard(0, -1), "-1"),
        (lambda: parse_placement("S(x)"), "'S\\(x\\)'"),
        (lambda: parse_placement("P(prod)"), "'prod'"),
    ]:
        with pytest.raises(PlacementError, match=message):
            bad()


def test_placements_are_values():
    attr = DistAttr(MESH, dims_mapping=[0, -1], partial_dims={1})
    assert attr.placements == (Shard(0), Partial("sum"))
    assert attr.placement_of(0) == Shard(0) and attr.placement_of(1).is_partial()
    assert DistAttr(MESH, [None, None]).placements == (Replicate(), Replicate())
    assert DistAttr(MESH, [None, ("dp", "mp")]).placements == (Shard(1), Shard(1))
    assert DistAttr(MESH, [None, ("mp", "dp")]).placements == (Shard(1, 1), Shard(1, 0))


# ---- dataclasses.replace, pickling --------------------------------------------------------


def test_replace_goes_through_validation():
    attr = DistAttr(MESH, [0, -1])
    assert replace(attr, partial=((1, "sum"),)) == DistAttr(MESH, dims_mapping=[0, -1], partial_dims={1})
    assert replace(attr, mapping=((), (1, 0))) == DistAttr(MESH, [None, ("mp", "dp")])
    other = ProcessMesh([[4, 5], [6, 7]], ["dp", "mp"])
    assert replace(attr, mesh=other).mesh == other
    with pytest.raises(PlacementError, match="used twice"):
        replace(attr, mapping=((0,), (0,)))
    with pytest.raises(PlacementError, match="'max2'"):
        replace(attr, partial=((1, "max2"),))
    with pytest.raises(PlacementError, match="not both"):
        DistAttr(MESH, [0, -1], mapping=[0, -1])


def test_pickle_round_trip_keeps_equality_and_hash():
    attr = DistAttr(MESH, [("mp", "dp"), None], {})
    again = pickle.loads(pickle.dumps(attr))
    assert again == attr and hash(again) == hash(attr) and str(again) == "[S(0)#1,S(0)]"
    assert copy.deepcopy(attr) == attr


# ---- the order of mesh dims splitting one tensor dim -----------------------------------------


def test_split_order_is_kept_as_given():
    mp_dp = DistAttr(MESH, [("mp", "dp"), None])
    dp_mp = DistAttr(MESH, [("dp", "mp"), None])
    assert mp_dp.mapping == ((1, 0), ()) and dp_mp.mapping == ((0, 1), ())
    assert mp_dp != dp_mp and mp_dp.dims_mapping_text == "[1/0,-1]"
    # mixed radix in mapping order, the first listed mesh dim the major digit:
    # rank 1 = (dp 0, mp 1): piece mp * 2 + dp = 2 under (mp, dp), dp * 2 + mp = 1 under (dp, mp)
    rows = {r: mp_dp.local_slices([8, 3], r)[0] for r in MESH.ranks}
    assert rows == {0: slice(0, 2), 1: slice(4, 6), 2: slice(2, 4), 3: slice(6, 8)}
    rows = {r: dp_mp.local_slices([8, 3], r)[0] for r in MESH.ranks}
    assert rows == {0: slice(0, 2), 1: slice(2, 4), 2: slice(4, 6), 3: slice(6, 8)}
    assert str(mp_dp) == "[S(0)#1,S(0)]" and str(dp_mp) == "[S(0),S(0)]"
    assert DistAttr.parse(str(mp_dp), MESH, 2) == mp_dp


def reordered(data, attr):
    """``attr`` with each multi-mesh-dim split in a random order."""
    return attr.with_mapping([tuple(data.draw(st.permutations(dims))) for dims in attr.mapping])


@given(st.data())
def test_parse_inverts_str_with_any_split_order(data):
    mesh = data.draw(meshes(max_ranks=8, max_ndim=3))
    ndim = data.draw(st.integers(1, 2))
    attr = reordered(data, data.draw(dist_attrs(mesh, ndim, partial=True, kinds=("sum", "max"))))
    assert DistAttr.parse(str(attr), mesh, ndim) == attr
    assert DistAttr.from_placements(mesh, attr.placements, ndim) == attr


# ---- Paddle placements ----------------------------------------------------------------------


@given(st.data())
def test_paddle_placements_round_trip_with_any_split_order(data):
    mesh = data.draw(meshes(max_ranks=8, max_ndim=3))
    ndim = data.draw(st.integers(1, 2))
    attr = reordered(data, data.draw(dist_attrs(mesh, ndim, partial=True, kinds=("sum", "avg", "max", "min"))))
    paddle_placements = attr.to_placements()
    assert [from_paddle_placement(p) for p in paddle_placements] == list(attr.placements)
    assert DistAttr.from_placements(mesh, paddle_placements, ndim) == attr


def test_paddle_placements_carry_the_split_order():
    import paddle.distributed as pdist

    attr = DistAttr(MESH, [("mp", "dp"), None], {})
    first, second = attr.to_placements()
    assert first.get_dim() == 0 and first.get_co_shard_order() == 1 and second.get_co_shard_order() == 0
    # Paddle's own co-shard lists number every member; all-zero orders mean ascending
    ordered = [pdist.Shard(0, shard_order=0), pdist.Shard(0, shard_order=1)]
    assert DistAttr.from_placements(MESH, ordered, 2).mapping == ((0, 1), ())
    assert DistAttr.from_placements(MESH, [pdist.Shard(0), pdist.Shard(0)], 2).mapping == ((0, 1), ())
    assert DistAttr.from_placements(MESH, [Shard(0, 1), Shard(0)], 2) == attr
    with pytest.raises(PlacementError, match="kRedProd"):
        DistAttr.from_placements(MESH, [pdist.Partial(pdist.ReduceType.kRedProd), Replicate()], 2)
    with pytest.raises(PlacementError, match="S\\(2\\) on mesh dim 1"):
        DistAttr.from_placements(MESH, [Replicate(), Shard(2)], 2)
