"""The native backend: each rank runs its whole program, collectives inside it.

On GPUs that is NCCL and the fast path. On CPU the collectives run on gloo communicators
created per ring (PADDLE_NOTES: one communicator per process really works, so every
collective must span the world — backend lowering refuses the rest). The rank's program is
the native form of its RankPlan (lowered at compile by the backend_lowering pass). Fetches
and parameters are exchanged through the job's TCP store.

Every wait is reported to the launcher (:func:`autopar.rank_status.waiting`): start-up (joining the
store, making the communicators), each exchange, and each step (its collectives run inside
gloo, where Python cannot interrupt them: the launcher bounds a step only while another rank
has not reached it, and gloo gives up on a collective after its fixed 30 s). Start-up and
exchanges are bounded by ``AUTOPAR_COLLECTIVE_TIMEOUT`` in the rank as well.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.rank_plan import RankPlan, ValueKey
from autopar.rank_status import waiting
from autopar.runtime.device import create_ring, current_device
from autopar.runtime.prepared import PreparedProgram


class StoreExchange:
    """``all_gather_object`` over Paddle's TCP store (no process group needed).

    Each exchange is a reported, bounded wait: ``store.get`` would otherwise block for the
    store's 900 s; it releases the GIL, so the rank's watchdog can end it.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.count = store, rank, world, 0
        _stay_for_readers(store, rank, world)

    def all_gather_object(self, obj: Any, what: str | None = None) -> list[Any]:
        self.count += 1
        data = pickle.dumps(obj)
        with waiting(what or exchange_label()):
            self.store.set(f"autopar/x{self.count}/{self.rank}", data)
            pieces = [bytes(self.store.get(f"autopar/x{self.count}/{r}")) for r in range(self.world)]
        return [pickle.loads(piece) for piece in pieces]


def exchange_label(depth: int = 2) -> str:
    """Names an exchange by the Executor method that asked for it ("exchange in parameters()"),
    read from the caller's frame so the Executor need not pass it."""
    name = sys._getframe(depth).f_code.co_name
    return "exchange" if name.startswith("<") else f"exchange in {name}()"


_STAYING: list[bool] = []


def _stay_for_readers(store: Any, rank: int, world: int) -> None:
    """Rank 0 serves the TCP store: had it left while another rank still read the last
    exchange, that rank would fail. At exit every rank counts itself out and rank 0 waits for
    the count (2 s at most: a rank that crashed never counts). Once per process."""
    if _STAYING:
        return
    _STAYING.append(True)

    def count_out() -> None:
        with contextlib.suppress(Exception):  # the store may be gone already
            store.add("autopar/exited", 1)
            deadline = time.monotonic() + 2.0
            while rank == 0 and store.add("autopar/exited", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)

    atexit.register(count_out)


_STEPS = itertools.count(1)
_STEP_LABELS: dict[int, tuple[RankPlan, str]] = {}  # id(plan) -> (plan, what its steps' collectives are)


@contextlib.contextmanager
def native_step(plan: RankPlan) -> Iterator[None]:
    """Reports a step with collectives as a wait the launcher bounds only while another rank
    has not reached it (the step also computes, for as long as it takes)."""
    if not plan.collectives:
        yield
        return
    known = _STEP_LABELS.get(id(plan))
    if known is None or known[0] is not plan:
        kinds = sorted({f"{c.kind} over {list(c.group)}" for c, _ in plan.collectives})
        count = len(plan.collectives)
        known = _STEP_LABELS[id(plan)] = (plan, f"{count} collective{'s' * (count > 1)}: {', '.join(kinds)}")
    label = known[1]
    with waiting(f"step {next(_STEPS)} of the native program ({label})", bounded=False):
        yield


class NativeRunner:
    """One rank's native-form program, scope and executor."""

    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None) -> None:
        import paddle

        if plan.backend != "native":
            raise AutoparError(f"rank {plan.rank}: the native runner needs the native form of the rank plan, got {plan.backend}")
        ops = list(plan.program.global_block().ops)
        self.whole, positions = plan.fetch_sites(tuple(fetch_keys))
        self.fetch_values = [ops[p].result(i) for p, i in positions]
        self.plan, self.rank, self.fetch_keys = plan, plan.rank, list(fetch_keys)
        self.program = plan.program
        self.scope = scope if scope is not None else paddle.static.Scope()
        self.device = current_device()
        self.executor = paddle.static.Executor(self.device.place)  # start-up only
        self._prepared: PreparedProgram | None = None  # the program's interpreter, built on the first step

    def run_startup(self) -> None:
        self.plan.run_startup(self.scope, self.executor)

    def run(self, local_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self._prepared is None:
            self._prepared = PreparedProgram(self.program, self.scope, self.device.place, self.fetch_values, self.device.ops_in_order)
        if self.plan.learning_rate is not None:
            self.plan.learning_rate.write(self.scope, self.device.place)
        with native_step(self.plan):
            return self._prepared.run(local_feeds)

    def parameter_piece(self, name: str) -> np.ndarray:
        var = self.scope.find_var(name)
        if var is None:
            raise AutoparError(f"rank {self.rank}: scope has no parameter {name!r}")
        return np.array(var.get_tensor())


# rings this process has communicators for, and their groups (Paddle refuses to create one twice)
CREATED_RINGS: dict[int, tuple[int, ...]] = {}


def store_endpoint() -> tuple[str, int]:
    """The job's TCP store as Paddle finds it: PADDLE_MASTER, else the first trainer endpoint."""
    endpoint = os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]
    host, _, port = endpoint.strip().rpartition(":")
    if not host or not port.isdigit():
        raise AutoparError(f"no TCP store address in the environment (PADDLE_MASTER={endpoint!r})")
    return host, int(port)


def startup_label() -> str:
    host, port = store_endpoint()
    return f"start-up (joining the job's TCP store at {host}:{port})"


def wait_for_store(rank: int) -> None:
    """Ranks > 0 wait here, in Python, until rank 0's TCP store listens: Paddle's own connect
    retries only every 3 s and holds the GIL, so no watchdog could end it."""
    if rank == 0:
        return
    address, delay = store_endpoint(), 0.02
    while True:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError:
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)


def _rings_to_create(plan: RankPlan) -> list[tuple[tuple[int, ...], int]]:
    """The rings of ``plan`` this process has no communicator for yet. A ring made earlier
    (another native Executor) is reused; so is ring 0 when the host backend's world process
    group exists already (its communicator is ring 0)."""
    import paddle.distributed as pdist

    todo = []
    for group, ring in sorted(plan.rings.items(), key=lambda item: item[1]):
        if ring in CREATED_RINGS:
            if CREATED_RINGS[ring] != tuple(group):
                raise AutoparError(
                    f"ring {ring} is already this process's communicator for ranks {list(CREATED_RINGS[ring])}; "
                    f"another program wants it for {list(group)}: run one program's native Executor per process"
                )
        elif ring == 0 and pdist.is_initialized() and len(group) == pdist.get_world_size():
            CREATED_RINGS[ring] = tuple(group)
        else:
            todo.append((tuple(group), ring))
    return todo


def join_store(rank: int) -> Any:
    """The job's TCP store (Paddle's global one), joined once per process."""
    from paddle.base import core

    wait_for_store(rank)
    store = core.create_or_get_global_tcp_store()
    _JOINED.append(True)
    return store


_JOINED: list[bool] = []  # the host backend's init_parallel_env joins the store too


def create_rings(plan: RankPlan) -> Any:
    """The communicators of every ring this rank is in (gloo on CPU, NCCL on GPUs: see
    :mod:`autopar.runtime.device`); returns the TCP store. Joining the store and making
    communicators is the start-up wait the launcher and watchdog bound."""
    import paddle.distributed as pdist
    from paddle.base import core

    todo = _rings_to_create(plan)
    if not todo and (_JOINED or pdist.is_initialized()):
        return core.create_or_get_global_tcp_store()
    with waiting(startup_label()):
        store = join_store(plan.rank)
        device = current_device()
        endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")
        for group, ring in todo:
            create_ring(device, store, ring, list(group).index(plan.rank), len(group), endpoints)
            CREATED_RINGS[ring] = group
    return store
