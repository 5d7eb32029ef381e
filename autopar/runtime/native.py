"""The native backend: each rank runs its whole program, collectives inside it.

On GPUs that is NCCL and the fast path. On CPU the collectives run on gloo communicators
created per ring (PADDLE_NOTES: one communicator per process really works, so every
collective must span the world — backend lowering refuses the rest). The rank's program is
the native form of its RankPlan (lowered at compile by the backend_lowering pass). Fetches
and parameters are exchanged through the job's TCP store.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.rank_plan import RankPlan, ValueKey


class StoreExchange:
    """``all_gather_object`` over Paddle's TCP store (no process group needed)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.count = store, rank, world, 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.count += 1
        self.store.set(f"autopar/x{self.count}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(bytes(self.store.get(f"autopar/x{self.count}/{r}"))) for r in range(self.world)]


class NativeRunner:
    """One rank's native-form program, scope and executor."""

    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None) -> None:
        import paddle

        if plan.backend != "native":
            raise AutoparError(f"rank {plan.rank}: the native runner needs the native form of the rank plan, got {plan.backend}")
        ops = list(plan.program.global_block().ops)
        self.fetch_values = [ops[p].result(i) for p, i in (plan.position(key) for key in fetch_keys)]
        self.plan, self.rank, self.fetch_keys = plan, plan.rank, list(fetch_keys)
        self.program = plan.program
        self.scope = scope if scope is not None else paddle.static.Scope()
        self.executor = paddle.static.Executor(paddle.CPUPlace())

    def run_startup(self) -> None:
        import paddle

        if self.plan.startup is None:
            raise AutoparError("compile was called without startup_program=; there is no startup to run")
        with paddle.static.scope_guard(self.scope):
            self.executor.run(self.plan.startup)

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


def create_rings(plan: RankPlan) -> Any:
    """The gloo communicators of every ring this rank is in; returns the TCP store.

    A ring made earlier in this process (another native Executor) is reused; so is ring 0
    when the host backend's world process group exists already (its communicator is ring 0).
    """
    import paddle.distributed as pdist
    from paddle.base import core

    rank = plan.rank
    store = core.create_or_get_global_tcp_store()
    for group, ring in sorted(plan.rings.items(), key=lambda item: item[1]):
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
