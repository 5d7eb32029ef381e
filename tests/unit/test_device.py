"""Device selection and the Paddle APIs the GPU path calls (checked against the installed
Paddle: a renamed or re-shaped API fails here, on CPU machines too)."""

import ast
import inspect
from pathlib import Path

import paddle
import pytest
from paddle.base import core

from autopar.errors import AutoparError
from autopar.runtime.device import Device, create_ring, current_device


def test_cpu_without_cuda():
    assert current_device({"FLAGS_selected_gpus": "3"}, cuda=False) == Device("cpu")
    assert isinstance(Device("cpu").place, paddle.CPUPlace)


def test_ops_run_in_order_on_cpu_only():
    """Trace mode (PreparedProgram's in_order) measured on CPU only; GPUs keep Paddle's scheduler."""
    assert Device("cpu").ops_in_order and not Device("gpu", 1).ops_in_order


@pytest.mark.parametrize(
    ("env", "index"),
    [({"FLAGS_selected_gpus": "3"}, 3), ({"FLAGS_selected_gpus": "5,6"}, 5), ({"PADDLE_LOCAL_RANK": "2"}, 2), ({}, 0)],
)
def test_gpu_index_from_the_launcher_environment(env, index):
    assert current_device(env, cuda=True) == Device("gpu", index)


def test_unreadable_gpu_index_is_refused_by_name():
    with pytest.raises(AutoparError, match="FLAGS_selected_gpus='x'"):
        current_device({"FLAGS_selected_gpus": "x"}, cuda=True)


def test_this_machine_runs_on_cpu():
    assert current_device().kind == ("gpu" if paddle.device.cuda.device_count() > 0 else "cpu")


def test_paddle_apis_the_gpu_path_calls_exist_with_these_arities():
    """create_nccl_comm_context is compiled only into CUDA builds: check how Paddle's own
    static auto-parallel calls it (5 arguments after set_device_id) in the installed sources."""
    assert hasattr(paddle, "CUDAPlace") and hasattr(core.CommContextManager, "set_device_id")
    assert "arg3: int" in core.CommContextManager.create_gloo_comm_context.__doc__  # (store, ring, rank, size)
    source = Path(inspect.getfile(paddle.distributed)).parent / "auto_parallel" / "static" / "process_group.py"
    calls = [
        node for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "create_nccl_comm_context"
    ]  # fmt: skip
    assert calls and all(len(call.args) == 5 for call in calls)


def test_gpu_ring_goes_through_nccl(monkeypatch):
    made = []
    monkeypatch.setattr(core.CommContextManager, "set_device_id", lambda i: made.append(("device", i)), raising=False)
    monkeypatch.setattr(
        core.CommContextManager, "create_nccl_comm_context", lambda *args: made.append(("nccl", *args[1:4])), raising=False
    )
    create_ring(Device("gpu", 1), object(), 7, 0, 2)
    assert made == [("device", 1), ("nccl", "7", 0, 2)]
