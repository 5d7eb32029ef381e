import dataclasses

import pytest

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import shipped_profile
from autopar.cost_model.cluster import Cluster, Device
from autopar.cost_model.compute import OpCost, einsum_cost, op_cost, op_cost_or_traffic
from autopar.cost_model.memory import TensorInfo, memory_per_rank, tensor_bytes
from autopar.errors import CostModelError


def test_matmul_flops_bytes_and_roofline():
    cost = op_cost("pd_op.matmul", [(64, 128), (128, 32)], [(64, 32)])
    assert cost.flops == 2 * 64 * 128 * 32
    assert cost.bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
    t = op_cost("matmul", [(4, 64, 128), (32, 128)], [(4, 64, 32)], {"transpose_y": True})
    assert t.flops == 2 * 4 * 64 * 128 * 32
    assert (
        op_cost("pd_op.matmul_grad", [(64, 128), (128, 32), (64, 32)], [(64, 128), (128, 32)]).flops == 2 * cost.flops
    )
    h100 = shipped_profile("h100-node")
    big = OpCost(2e12, 1e6)
    assert big.time(h100, "bfloat16") == pytest.approx(2e12 / 7.1e14)  # compute bound, at the measured GEMM rate
    assert OpCost(1e3, 2.95e9).time(h100) == pytest.approx(1e-3)  # memory bound, at the measured streaming rate
    assert OpCost(2e12, 0).time(h100, "float8_e4m3fn") == pytest.approx(2e12 / 1.979e15)  # not measured: the peak


def test_a_device_prices_at_what_it_achieves_and_round_trips():
    device = Device((("float32", 1e12),), 1e11, 1e9, achieved_flops=(("float32", 5e11),), achieved_bandwidth=5e10,
                    cache_bytes=1e6, cache_bandwidth=2e11, op_seconds=3e-6, segment_seconds=1e-4, cores=2)  # fmt: skip
    cluster = dataclasses.replace(shipped_profile("cpu-shm"), device=device)
    assert OpCost(1e12, 0).time(cluster) == pytest.approx(2.0)
    assert OpCost(0, 1e6).time(cluster) == pytest.approx(1e6 / 2e11)  # fits the cache
    assert OpCost(0, 2e6).time(cluster) == pytest.approx(2e6 / 5e10)
    assert Cluster.from_dict(cluster.to_dict()).device == device
    assert device.shared_by(4) == 2.0 and device.shared_by(2) == 1.0  # four processes on two cores: half speed each
    assert shipped_profile("h100-node").device.shared_by(8) == 1.0  # each GPU its own
    assert Device.from_dict({"peak_flops": {"float32": 1.0}, "memory_bandwidth": 1.0, "memory_bytes": 1.0}).op_seconds == 5e-6


def test_a_measured_kernel_costs_at_least_its_elements_at_its_rate():
    """A CPU's gelu_grad computes per element far below the streamed bandwidth: a device with
    measured kernel rates prices such an op by them; other kernels keep the roofline."""
    device = Device((("float32", 1e12),), 1e11, 1e9, achieved_bandwidth=5e10, kernel_seconds=(("gelu_grad", 5e-9),))
    cluster = dataclasses.replace(shipped_profile("cpu-shm"), device=device)
    grad = op_cost("pd_op.gelu_grad", [(256, 256), (256, 256)], [(256, 256)])
    assert (grad.kernel, grad.elements) == ("gelu_grad", 256 * 256)
    assert grad.time(cluster) == pytest.approx(256 * 256 * 5e-9)  # 0.33 ms, not the roofline's 16 us
    add = op_cost("pd_op.add", [(256, 256), (256, 256)], [(256, 256)])
    assert add.time(cluster) == pytest.approx(add.bytes / 5e10)  # not measured: the roofline
    unlisted = op_cost_or_traffic("pd_op.rms_norm", [(8, 64), (64,)], [(8, 64)])[0]  # outside the table, still by kernel
    assert (unlisted.kernel, unlisted.elements) == ("rms_norm", 512)
    assert Cluster.from_dict(cluster.to_dict()).device == device
    with pytest.raises(CostModelError, match="kernel_seconds must be an object"):
        Device.from_dict({"peak_flops": {"float32": 1.0}, "memory_bandwidth": 1.0, "memory_bytes": 1.0,
                          "achieved": {"kernel_seconds": [1.0]}})  # fmt: skip


def test_the_cpu_profiles_measured_the_training_kernels():
    """The shipped CPU profiles carry the kernel rates of profiled training steps: the ones a
    transformer's step spends most in, each a positive finite figure."""
    for name in ("cpu-shm", "cpu-gloo"):
        kernels = dict(shipped_profile(name).device.kernel_seconds)
        assert {"gelu_grad", "layer_norm_grad", "add_grad", "softmax", "adam", "sgd"} <= kernels.keys(), name
        assert all(0 < rate < 1e-6 for rate in kernels.values()), kernels


def test_other_ops():
    assert op_cost("conv2d", [(2, 3, 8, 8), (16, 3, 3, 3)], [(2, 16, 6, 6)]).flops == 2 * 2 * 16 * 36 * 27
    assert op_cost("pd_op.relu", [(10, 10)], [(10, 10)]).flops == 100
    assert op_cost("pd_op.sum", [(10, 10)], [(10,)]).flops == 100
    assert op_cost("softmax", [(4, 5)], [(4, 5)]).flops == 100
    assert op_cost("layer_norm", [(4, 5), (5,), (5,)], [(4, 5)]).flops == 160
    assert op_cost("embedding", [(8,), (100, 16)], [(8, 16)]).flops == 0
    adam = op_cost("pd_op.adam_", [(10, 10), (10, 10)], [(10, 10)])
    assert adam.flops == 1200
    with pytest.raises(CostModelError, match="'pd_op.frobnicate'"):
        op_cost("pd_op.frobnicate", [(1,)], [(1,)])


def test_einsum_cost_with_split():
    full = einsum_cost("mk,kn->mn", {"m": 8, "k": 4, "n": 2})
    assert full.flops == 2 * 8 * 4 * 2
    assert einsum_cost("mk,kn->mn", {"m": 8, "k": 4, "n": 2}, splits={"m": 2}).flops == full.flops / 2
    assert einsum_cost("mn,mn->mn", {"m": 8, "n": 2}).flops == 16


def test_memory_per_rank():
    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    w = TensorInfo("w", (10, 8), "float32", DistAttr(mesh, [-1, 1]))
    b = TensorInfo("b", (8,), "float32", None)
    act = TensorInfo("h", (6, 8), "float32", DistAttr(mesh, [0, 1]))
    mem = memory_per_rank(mesh.ranks, [w, b], [act], optimizer="adam")
    m0 = mem[0]
    assert m0.parameters == 4 * (40 + 8) and m0.gradients == m0.parameters
    assert m0.optimizer_states == 2 * m0.parameters and m0.activations == 4 * 12
    assert m0.total == 4 * 48 * 4 + 48
    zero = memory_per_rank([0], [w], optimizer="sgd", grad_dists={"w": DistAttr(mesh, [0, 1])})
    assert zero[0].gradients == 4 * 20 and zero[0].optimizer_states == 0
    assert tensor_bytes((7,), "float16", DistAttr(ProcessMesh([0, 1]), [0]), 1) == 6
    assert tensor_bytes((7,), "float16", DistAttr(ProcessMesh([0, 1]), [0]), 5) == 0
