"""The native backend: each rank runs its whole program, collectives inside it.

On GPUs that is NCCL and the fast path. On CPU the collectives run on gloo communicators
created per ring (PADDLE_NOTES: one communicator per process really works, so every
collective must span the world — :func:`lower_for_native` refuses the rest). Fetches and
parameters are exchanged through the job's TCP store.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.passes.backend_lowering import lower_for_native


class StoreExchange:
    """``all_gather_object`` over Paddle's TCP store (no process group needed)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.count = store, rank, world, 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.count += 1
        self.store.set(f"autopar/x{self.count}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(bytes(self.store.get(f"autopar/x{self.count}/{r}"))) for r in range(self.world)]


class NativeRunner:
    """One rank's lowered program, scope and executor."""

    def __init__(self, dist: Any, rank: int, world: int, fetch_keys: Sequence[Any]) -> None:
        import paddle

        rp = dist.state.ranks[rank]
        ops = list(rp.program.global_block().ops)
        position = {op.id(): i for i, op in enumerate(ops)}
        keep = []
        for key in fetch_keys:
            value = rp.current(key)
            keep.append((position[value.get_defining_op().id()], value.index()))
        self.program, self.fetch_values = lower_for_native(rp, dist.state.rings, world, keep)
        self.dist, self.rank, self.fetch_keys = dist, rank, list(fetch_keys)
        self.scope = paddle.static.Scope()
        self.executor = paddle.static.Executor(paddle.CPUPlace())

    def run_startup(self) -> None:
        import paddle

        with paddle.static.scope_guard(self.scope):
            self.executor.run(self.dist.rank_startup_program(self.rank))

    def run(self, local_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        import paddle

        with paddle.static.scope_guard(self.scope):
            out = self.executor.run(self.program, feed=dict(local_feeds), fetch_list=list(self.fetch_values))
        return [np.asarray(o) for o in out]

    def parameter_piece(self, name: str) -> np.ndarray:
        var = self.scope.find_var(name)
        if var is None:
            raise AutoparError(f"rank {self.rank}: scope has no parameter {name!r}")
        return np.array(var.get_tensor())


# rings this process has communicators for, and their groups (Paddle refuses to create one twice)
CREATED_RINGS: dict[int, tuple[int, ...]] = {}


def create_rings(dist: Any, rank: int) -> Any:
    """The gloo communicators of every ring this rank is in; returns the TCP store.

    A ring made earlier in this process (another native Executor) is reused; so is ring 0
    when the host backend's world process group exists already (its communicator is ring 0).
    """
    import paddle.distributed as pdist
    from paddle.base import core

    store = core.create_or_get_global_tcp_store()
    for group, ring in sorted(dist.state.rings.items(), key=lambda item: item[1]):
        if rank not in group:
            continue
        if ring in CREATED_RINGS:
            if CREATED_RINGS[ring] != tuple(group):
                raise AutoparError(
                    f"ring {ring} is already this process's communicator for ranks {list(CREATED_RINGS[ring])}; "
                    f"another program wants it for {list(group)}: run one program's native Executor per process"
                )
            continue
        if not (ring == 0 and pdist.is_initialized() and len(group) == pdist.get_world_size()):
            core.CommContextManager.create_gloo_comm_context(store, str(ring), list(group).index(rank), len(group))
        CREATED_RINGS[ring] = tuple(group)
    return store
