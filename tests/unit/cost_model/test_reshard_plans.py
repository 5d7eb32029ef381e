"""Reshard plans: the collective the contract requires, their text, errors, cross-mesh."""

import pytest

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import plan_reshard, shipped_profile
from autopar.errors import AutoparError

MESH = ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
LINE = ProcessMesh([0, 1, 2, 3], ["x"])
# NCCL's collectives, sub-groups native: the plans the contract names. (Without a cluster the
# profile follows the hardware; cpu-gloo emulates reduce_scatter / all_to_all and prices a
# sub-group as a world exchange, see test_cpu_gloo_still_prefers_reduce_scatter_and_all_to_all.)
H100 = shipped_profile("h100-node")


def attr(text, mesh=MESH, ndim=2):
    return DistAttr.parse(text, mesh, ndim)


def test_identity_is_empty():
    plan = plan_reshard(attr("[S(0),P(sum)]"), attr("[S(0),P(sum)]"), (64, 64))
    assert plan.steps == () and plan.time == 0


def test_partial_to_shard_is_one_reduce_scatter():
    plan = plan_reshard(attr("[P(sum)]", LINE), attr("[S(1)]", LINE), (1024, 1024), cluster=H100)
    assert plan.kinds() == ["reduce_scatter"]
    step = plan.steps[0]
    assert step.groups == ((0, 1, 2, 3),) and step.mesh_dims == (0,) and step.tensor_dims == (1,)
    assert step.bytes == 4 << 20 and step.reduce == "sum"
    plan = plan_reshard(attr("[R,P(sum)]"), attr("[R,S(0)]"), (1024, 1024), cluster=H100)
    assert plan.kinds() == ["reduce_scatter"] and plan.steps[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_shard_to_shard_on_the_same_mesh_dim_is_one_all_to_all():
    plan = plan_reshard(attr("[S(0),R]"), attr("[S(1),R]"), (1024, 1024), cluster=H100)
    assert plan.kinds() == ["all_to_all"] and plan.steps[0].tensor_dims == (0, 1)
    assert plan.steps[0].bytes == 2 << 20  # the send buffer: one rank's half


@pytest.mark.usefixtures("gloo_profile")
def test_partial_to_replicate_on_a_line_is_one_all_reduce():
    for kind in ("sum", "max", "avg"):
        plan = plan_reshard(attr(f"[P({kind})]", LINE), attr("[R]", LINE), (1024, 1024))
        assert plan.kinds() == ["all_reduce"] and plan.steps[0].reduce == kind


def test_step_text_and_plan_sum():
    plan = plan_reshard(attr("[R,P(sum)]", ndim=1), attr("[R,S(0)]", ndim=1), (1024,), cluster=H100)
    (step,) = plan.steps
    assert str(step).startswith("reduce_scatter(mp over ranks (0,1,2,3) (+1 groups), 4 KiB, ")
    assert str(step).endswith("us): [R,P(sum)] -> [R,S(0)]")
    assert plan.time == sum(s.time for s in plan.steps)
    assert "reshard float32[1024]" in str(plan)


def test_steps_chain_and_uneven_multi_dim_gather():
    # 7 rows over (dp, mp) = 8 parts: the bounds do not nest, one gather over all 8 ranks is needed
    src, dst = attr("[S(0),S(0)]"), attr("[R,R]")
    plan = plan_reshard(src, dst, (7, 5))
    assert plan.steps[0].src == src and plan.steps[-1].dst == dst
    assert all(a.dst == b.src for a, b in zip(plan.steps, plan.steps[1:]))
    plan = plan_reshard(src, dst, (6, 5))
    assert plan.kinds() == ["all_gather"] and plan.steps[0].groups == ((0, 1, 2, 3, 4, 5, 6, 7),)


def test_replicate_to_partial_and_back():
    plan = plan_reshard(attr("[R]", LINE, 1), attr("[P(sum)]", LINE, 1), (8,))
    assert plan.kinds() == ["make_partial"]
    assert plan_reshard(attr("[R]", LINE, 1), attr("[P(max)]", LINE, 1), (8,)).time == 0


def test_cross_mesh_same_shape_sends_pieces():
    stage1 = ProcessMesh([[8, 9, 10, 11], [12, 13, 14, 15]], ["dp", "mp"])
    plan = plan_reshard(attr("[S(0),R]"), attr("[S(0),R]", stage1), (1024, 1024))
    assert plan.kinds().count("send_recv") == 1
    send = next(s for s in plan.steps if s.kind == "send_recv")
    assert len(send.groups) == 8 and send.bytes <= 2 << 20  # pieces, never the whole tensor
    assert plan.steps[-1].dst == attr("[S(0),R]", stage1)


def test_cross_mesh_different_shapes_goes_through_replicate():
    small = ProcessMesh([8, 9], ["x"])
    plan = plan_reshard(attr("[S(0),P(sum)]"), attr("[S(1)]", small), (64, 64))
    assert "send_recv" in plan.kinds()
    assert plan.steps[0].src.mesh == MESH and plan.steps[-1].dst == attr("[S(1)]", small)
    assert all(a.dst == b.src for a, b in zip(plan.steps, plan.steps[1:]) if b.kind not in ("send_recv", "broadcast"))


def test_deterministic_and_cached():
    a = plan_reshard(attr("[S(0),S(1)]"), attr("[S(1),P(sum)]"), (33, 17))
    b = plan_reshard(attr("[S(0),S(1)]"), attr("[S(1),P(sum)]"), [33, 17], "float32")
    assert a == b and str(a) == str(b)


def test_cpu_gloo_still_prefers_reduce_scatter_and_all_to_all():
    gloo = shipped_profile("cpu-gloo")
    mesh = ProcessMesh([0, 1], ["x"])
    assert plan_reshard(attr("[P(sum)]", mesh), attr("[S(0)]", mesh), (4096, 64), cluster=gloo).kinds() == [
        "reduce_scatter"
    ]
    assert plan_reshard(attr("[S(0)]", mesh), attr("[S(1)]", mesh), (4096, 64), cluster=gloo).kinds() == ["all_to_all"]


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: plan_reshard(attr("[S(0),R]"), attr("[R,R]", ndim=3), (4, 4)), "dst.dims_mapping"),
        (lambda: plan_reshard(attr("[S(0),R]", ndim=3), attr("[R,R]"), (4, 4)), "src.dims_mapping"),
        (lambda: plan_reshard(attr("[S(0),R]"), attr("[R,R]"), (4, 4), "float7"), "dtype"),
        (lambda: plan_reshard(attr("[S(0),R]"), attr("[R,R]"), (4, -4)), "negative"),
        (lambda: plan_reshard(attr("[S(0),R]"), "[R,R]", (4, 4)), "dst must be"),
        (
            lambda: plan_reshard(
                attr("[S(0),R]"),
                attr("[R,R]"),
                (4, 4),
                cluster=shipped_profile("cpu-gloo").__class__.from_dict(
                    {**shipped_profile("h100-node").to_dict(), "devices_per_node": 4}
                ),
            ),
            "src.mesh",
        ),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(AutoparError, match=field):
        call()
