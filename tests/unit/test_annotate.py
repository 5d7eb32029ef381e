import paddle
import paddle.distributed as pdist
import pytest

import autopar
from autopar.errors import AnnotationError, AutoparError, PlacementError
from autopar.testing.models import simple_net

MESH = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_every_dims_mapping_form_gives_the_same_attr():
    net = simple_net(sizes=(16, 32, 10))
    w = net.layers["linear1"].weight
    expected = autopar.DistAttr(MESH, [-1, 1])
    for spec in ([None, "mp"], [-1, 1], [None, 1], [pdist.Replicate(), pdist.Shard(1)], expected):
        autopar.shard_tensor(w, MESH, spec)
        assert autopar.compile(net.main, MESH).dist_attr(w.name) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        (["dp"], r"dims_mapping \['dp'\] has 1 entries but tensor 'x' has 2 dims"),
        (["pp", None], r"tensor 'x': unknown mesh dim 'pp'"),
        (["dp", "dp"], r"tensor 'x': mesh dim\(s\) \['dp'\] used twice"),
        ([pdist.Shard(0)], r"tensor 'x': 1 placements given"),
    ],
)
def test_bad_annotations_name_the_tensor(spec, message):
    net = simple_net(sizes=(16, 10))
    with pytest.raises(PlacementError, match=message) as info:
        autopar.shard_tensor(net.feeds["x"], MESH, spec)
    assert isinstance(info.value, AutoparError)


def test_annotation_on_a_value_of_another_program():
    a = simple_net(sizes=(16, 10))
    b = simple_net(sizes=(16, 10))
    with paddle.static.program_guard(b.main, b.startup):
        with pytest.raises(AnnotationError, match="tensor 'x' belongs to another program"):
            autopar.shard_tensor(a.feeds["x"], MESH, ["dp", None])


def test_annotation_mesh_outside_compile_mesh():
    net = simple_net(sizes=(16, 10))
    autopar.shard_tensor(net.feeds["x"], autopar.ProcessMesh([4, 5], ["dp"]), ["dp", None])
    with pytest.raises(AnnotationError, match=r"tensor 'x' is annotated on mesh\(dp=2\)\[4,5\], which is not a sub-mesh"):
        autopar.compile(net.main, MESH)


def test_shard_op_mesh_must_be_a_sub_mesh():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        layer = paddle.nn.Linear(8, 8)
        autopar.shard_op(layer, autopar.ProcessMesh([6, 7], ["dp"]))(x)
    with pytest.raises(AnnotationError, match=r"op pd_op.matmul#\d+ is placed by shard_op on mesh\(dp=2\)\[6,7\]"):
        autopar.compile(main, MESH)


def test_shard_op_places_the_ops_it_creates():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        first, second = paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 8)
        h = autopar.shard_op(first, MESH[0])(x)
        autopar.shard_op(second, MESH[1])(h)
    dist = autopar.compile(main, MESH)
    meshes = {op.name + str(i): dist.op_mesh(op.index) for i, op in enumerate(dist.graph.ops) if op.name == "pd_op.matmul"}
    assert [m.ranks for m in meshes.values()] == [(0, 1), (2, 3)]
    assert dist.dist_attr(first.weight).mesh == MESH[0]
    assert dist.dist_attr(second.weight).mesh == MESH[1]


def test_compile_never_modifies_the_program():
    net = simple_net(sizes=(16, 32, 10))
    autopar.shard_tensor(net.feeds["x"], MESH, ["dp", None])
    autopar.shard_tensor(net.layers["linear1"].weight, MESH, [None, "mp"])
    before = str(net.main)
    ops_before = [(op.id(), op.name()) for op in net.main.global_block().ops]
    autopar.compile(net.main, MESH)
    assert str(net.main) == before
    assert [(op.id(), op.name()) for op in net.main.global_block().ops] == ops_before


def test_compile_rejects_non_programs_and_meshes():
    with pytest.raises(AutoparError, match="needs an autopar.ProcessMesh"):
        autopar.compile(simple_net(sizes=(4, 2)).main, [0, 1])
    with pytest.raises(AutoparError, match="needs a Paddle static"):
        autopar.compile(object(), MESH)


def test_a_second_different_annotation_is_refused():
    """Annotating a value twice differently was accepted silently (the last one won)."""
    net = simple_net(sizes=(16, 10))
    autopar.shard_tensor(net.feeds["x"], MESH, ["dp", None])
    autopar.shard_tensor(net.feeds["x"], MESH, ["dp", None])  # the same again: fine
    with pytest.raises(AnnotationError, match=r"tensor 'x' is already annotated as .*\[S\(0\),R\].*again asks for"):
        autopar.shard_tensor(net.feeds["x"], MESH, [None, "mp"])


def test_a_second_annotation_on_another_mesh_names_both_meshes():
    """The same placement text on two stages' meshes: the message named [R] twice."""
    net = simple_net(sizes=(16, 10))
    pp = autopar.ProcessMesh([0, 1], ["pp"])
    autopar.shard_tensor(net.feeds["x"], pp[0], [None, None])
    with pytest.raises(AnnotationError, match=r"annotated as \[R\] on mesh\(pp=1\)\[0\]; .* \[R\] on mesh\(pp=1\)\[1\]"):
        autopar.shard_tensor(net.feeds["x"], pp[1], [None, None])
