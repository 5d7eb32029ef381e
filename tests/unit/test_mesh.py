import copy
import os
import pickle
import subprocess
import sys
from dataclasses import replace

import pytest

from autopar import DistAttr, ProcessMesh
from autopar.errors import AutoparError, MeshError


def test_structure_and_groups():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    assert mesh.shape == (2, 2) and mesh.ranks == (0, 1, 2, 3) and mesh.ndim == 2
    assert mesh.groups("dp") == [(0, 2), (1, 3)]
    assert mesh.groups("mp") == [(0, 1), (2, 3)]
    assert mesh.groups(["dp", "mp"]) == [(0, 1, 2, 3)]
    assert mesh.group_of(3, "dp") == (1, 3)
    assert mesh.coordinate(2) == (1, 0) and mesh.rank_at((1, 0)) == 2
    assert str(mesh) == "mesh(dp=2,mp=2)[0,1,2,3]"


def test_sub_mesh_indexes_first_dim():
    mesh = ProcessMesh([[4, 5, 6], [7, 8, 9]], ["pp", "dp"])
    stage = mesh[1]
    assert stage.ranks == (7, 8, 9) and stage.dim_names == ("dp",) and stage.shape == (3,)
    assert mesh.contains(stage) and not stage.contains(mesh)
    assert ProcessMesh([3, 1], ["x"])[0].ranks == (3,)


def test_value_semantics():
    a = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    b = ProcessMesh(shape=[2, 2], process_ids=[0, 1, 2, 3], dim_names=["dp", "mp"])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.shape = (4,)


def test_paddle_round_trip():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    assert ProcessMesh.from_paddle(mesh.to_paddle()) == mesh


@pytest.mark.parametrize(
    "ranks, names, message",
    [
        ([0, 1, 1], ["x"], "duplicate ranks"),
        ([[0, 1], [2]], ["x", "y"], "ragged"),
        ([], ["x"], "empty dim"),
        ([[0, 1], [2, 3]], ["x"], "needs 2 dim names"),
        ([[0, 1], [2, 3]], ["x", "x"], "distinct"),
    ],
)
def test_bad_meshes(ranks, names, message):
    with pytest.raises(MeshError, match=message) as info:
        ProcessMesh(ranks, names)
    assert isinstance(info.value, AutoparError)


def test_unknown_dim_name_is_named():
    mesh = ProcessMesh([0, 1], ["dp"])
    with pytest.raises(MeshError, match="unknown mesh dim 'mp'"):
        mesh.groups("mp")


def test_replace_goes_through_validation():
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    renamed = replace(mesh, dim_names=("a", "b"))
    assert renamed.dim_names == ("a", "b") and renamed.ranks == mesh.ranks and renamed != mesh
    assert replace(mesh, ranks=(3, 2, 1, 0)).tolist() == [[3, 2], [1, 0]]
    assert replace(mesh, shape=(4, 1)).groups(0) == [(0, 1, 2, 3)]
    with pytest.raises(MeshError, match="needs 2 dim names"):
        replace(mesh, dim_names=("a",))
    with pytest.raises(MeshError, match="duplicate ranks"):
        replace(mesh, ranks=(0, 0, 1, 2))
    with pytest.raises(MeshError, match="not both"):
        ProcessMesh(shape=[2], process_ids=[0, 1], ranks=[0, 1])


def test_pickle_round_trip_recomputes_the_hash():
    mesh = ProcessMesh(shape=[32, 32], process_ids=range(1024), dim_names=["dp", "mp"])
    again = pickle.loads(pickle.dumps(mesh))
    assert again == mesh and hash(again) == hash(mesh) and copy.deepcopy(mesh) == mesh
    # another process hashes strings differently: the hash must not travel with the pickle
    script = (
        "import pickle, sys\n"
        "from autopar.dist_attr import DistAttr\n"
        "from autopar.mesh import ProcessMesh\n"
        "mesh, attr = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = ProcessMesh([[0, 1], [2, 3]], ['dp', 'mp'])\n"
        "assert mesh in {fresh} and attr in {DistAttr(fresh, [('mp', 'dp'), None], {})}\n"
    )
    small = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    payload = pickle.dumps((small, DistAttr(small, [("mp", "dp"), None])))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", script], input=payload, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_hash_is_computed_once():
    """Propagation hashes the mesh thousands of times (every DistAttr hash includes it): the hash
    is made once, at construction, and never from the ranks again (checked without a clock:
    the ranks are swapped for a value that refuses to be hashed)."""

    class Unhashable:
        def __hash__(self):
            raise AssertionError("the mesh's hash read its ranks again")

    mesh = ProcessMesh(shape=[32, 32], process_ids=range(1024), dim_names=["dp", "mp"])
    first = hash(mesh)
    object.__setattr__(mesh, "ranks", Unhashable())
    assert hash(mesh) == first
