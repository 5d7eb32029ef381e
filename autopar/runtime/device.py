"""Where this rank runs and how its communicators are made (stage: runtime): the one seam
between autopar's runtime and the hardware.

With a CUDA build of Paddle and a visible GPU, a rank runs on ``CUDAPlace(i)`` — ``i`` from
``FLAGS_selected_gpus`` (what ``python -m paddle.distributed.launch`` sets), else
``PADDLE_LOCAL_RANK`` — and its rings are NCCL communicators made through Paddle's
comm-context API, exactly as Paddle's own static auto-parallel makes them
(``paddle/distributed/auto_parallel/static/process_group.py``). Otherwise it runs on the CPU
with gloo rings. Only the CPU path has run on our machines (no GPU); the GPU path's API names
and arities are checked against the installed Paddle by tests/unit/test_device.py.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cpu" or "gpu"
    index: int = 0

    @property
    def place(self) -> Any:
        import paddle

        return paddle.CUDAPlace(self.index) if self.kind == "gpu" else paddle.CPUPlace()

    @property
    def ops_in_order(self) -> bool:
        """Whether programs run their ops one after the other in the calling thread (Paddle's
        trace mode; :class:`autopar.runtime.prepared.PreparedProgram`): on CPU, faster and flat in
        memory (measured). On GPUs Paddle's default scheduler keeps its streams and events; trace
        mode was not run there."""
        return self.kind == "cpu"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def _cuda_available() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def current_device(env: Mapping[str, str] | None = None, cuda: bool | None = None) -> Device:
    """This process's device (``env`` / ``cuda`` override the environment, for tests)."""
    env = os.environ if env is None else env
    if not (_cuda_available() if cuda is None else cuda):
        return Device("cpu")
    selected = env.get("FLAGS_selected_gpus", "").split(",")[0].strip()
    local = env.get("PADDLE_LOCAL_RANK", "0").strip()
    text = selected or local
    if not text.isdigit():
        raise AutoparError(f"cannot tell this rank's GPU: FLAGS_selected_gpus={selected!r}, PADDLE_LOCAL_RANK={local!r}")
    return Device("gpu", int(text))


def create_ring(device: Device, store: Any, ring: int, rank_in_group: int, group_size: int, endpoints: str = "") -> None:
    """Make communicator ``ring`` for this rank (position ``rank_in_group`` of ``group_size``)."""
    from paddle.base import core

    if device.kind == "gpu":
        key = hashlib.md5(f"{endpoints}ring_id:{ring}".encode()).hexdigest()
        core.CommContextManager.set_device_id(device.index)
        core.CommContextManager.create_nccl_comm_context(store, str(ring), rank_in_group, group_size, key)
    else:
        core.CommContextManager.create_gloo_comm_context(store, str(ring), rank_in_group, group_size)
