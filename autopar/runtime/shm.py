"""Collectives through shared memory between the ranks of one machine: the host backend's
communicator when every rank runs on this host (stage: runtime).

Measured on this machine kind (2 cores, 2 processes, a 4-float all_reduce): gloo takes
1.0-1.3 ms per collective inside a static program and 0.65 ms through dynamic-mode
``paddle.distributed``; a tensor-parallel Llama's step was mostly those waits. Here a
collective is a copy into the rank's slot, a wait until every member's slot holds the same
collective, and the reference semantics of :mod:`autopar.collective_kinds` on the members'
arrays — every member reduces the same inputs in the same order, so replicated results are
bit-identical. Any group works (a dp group of a 2 x 2 mesh talks among its two members only:
no world exchange, no gloo sub-group setup, which deadlocks with 4 processes), and no process
group is started (``init_parallel_env`` takes 0.4-3.3 s).

Layout: one control block (rank 0 makes it, its name passed through the job's TCP store) with,
per rank, two slot headers and a row of acknowledgements; per rank and slot a data segment the
rank makes itself (and remakes larger when a message outgrows it). A rank posts its n-th
message into slot ``n % 2``: payload first, then the header (group, the group's collective
count, dtype, shape), the post number last; a reader waits for the header naming its group and
count, uses the payload in place, then acknowledges the post number. A rank reuses a slot
once every reader of the post before the last acknowledged it, so it can run ahead of a slow
peer by one collective. Waits spin briefly, then sleep between checks, and are bounded by
the rank's timeout (:func:`autopar.rank_status.waiting` reports them to the launcher).

Ordering: the payload is written before the header and read after it; x86-64's stores and
loads are not reordered with each other (TSO), which this relies on: other architectures use
gloo (:func:`available`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import secrets
import time
import zlib
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any, TypeVar

import numpy as np

from autopar.collective import Collective
from autopar.collective_kinds import KINDS, perform_for, point_to_point, posted, received
from autopar.errors import AutoparError
from autopar.host_comm import ENV, choice, x86_64
from autopar.rank_status import WATCHDOG_MARGIN, collective_timeout, waiting
from autopar.runtime.jobs import ScopeCall, collective_label
from autopar.runtime.wire import record

T = TypeVar("T")

SLOTS = 2
MAX_DIMS = 8
# header fields (int64): post, group code, group count, dtype code, ndim, generation, dims...
POST, GROUP, COUNT, DTYPE, NDIM, GEN, DIMS = range(7)
HEADER = DIMS + MAX_DIMS
DTYPES = [np.dtype(t) for t in ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "uint16")]
# a scope tensor's dtype -> the numpy dtype its memory is viewed as (bfloat16 as its uint16 bits)
_BY_NAME = {dtype.name: dtype for dtype in DTYPES if dtype.name != "uint16"} | {"bfloat16": np.dtype(np.uint16)}
MIN_CAPACITY = 1 << 16
SLEEP = 20e-6  # seconds between checks once a wait is not over at once (Linux rounds it up to ~60 us)


def available(world: int) -> bool:
    """Whether the ranks of this job can use shared memory: all on this host (the launcher's
    endpoints name one host), an x86-64 CPU, and not turned off (``AUTOPAR_HOST_COMM=gloo``)."""
    chosen = choice()
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    hosts = {e.rsplit(":", 1)[0] for e in endpoints}
    fits = len(hosts) == 1 and len(endpoints) == world and x86_64()
    if chosen == "shm" and not fits:
        raise AutoparError(f"{ENV}=shm, but the ranks are not all on one x86-64 host (endpoints: {endpoints})")
    return fits and chosen != "gloo"


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open another rank's segment without handing it to this process's resource tracker
    (Python 3.11 would unlink it when this process exits, under its maker's feet)."""
    segment = shared_memory.SharedMemory(name=name)
    with contextlib.suppress(Exception):
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def _group_code(group: Sequence[int]) -> int:
    return zlib.crc32(np.asarray(group, dtype=np.int64).tobytes()) + 1  # never 0 (an empty header)


class NodeMemory:
    """The shared-memory slots of one job on one host (one per process)."""

    def __init__(self, rank: int, world: int, store: Any, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        size = world * (SLOTS * HEADER + world) * 8
        if rank == 0:
            self._control = shared_memory.SharedMemory(create=True, size=size, name=f"autopar-{os.getpid()}-{secrets.token_hex(4)}")
            self._control.buf[:size] = bytes(size)
            store.set("autopar/shm/control", self._control.name.encode())
        else:
            self._control = _attach(bytes(store.get("autopar/shm/control")).decode())
        # int64 words, read and written one at a time (no numpy objects made while spinning):
        # rank r's row holds its slot headers, then acks[r][q], the last post of r that q has read
        self.words = self._control.buf.cast("q")
        self.row = SLOTS * HEADER + world
        self.prefix = self._control.name
        self.posts = 0
        self.readers: list[tuple[int, ...]] = [(), ()]  # per slot: who must read my post there
        self.counts: dict[tuple[int, ...], int] = {}
        self.own: list[shared_memory.SharedMemory | None] = [None] * SLOTS
        self.generation = [0] * SLOTS
        self.attached: dict[tuple[int, int], tuple[int, shared_memory.SharedMemory]] = {}
        self.closed = False
        atexit.register(self.close)

    def collect(self, group: Sequence[int], x: np.ndarray, use: Callable[[dict[int, np.ndarray]], T]) -> T:
        """Post ``x`` to ``group`` (this rank among its members), wait for every member's post of
        the same collective, and return ``use(arrays by rank)`` — computed while the arrays are
        still shared — before acknowledging them (``use`` must not return a view of them)."""
        group = tuple(group)
        count = self.counts.get(group, 0) + 1
        self.counts[group] = count
        code = _group_code(group)
        self._post(code, count, np.require(x, requirements="C"), [r for r in group if r != self.rank])
        posts = {r: self._read(r, code, count) for r in group if r != self.rank}
        result = use({r: posts[r][0] if r in posts else x for r in group})
        for r, (_, post) in posts.items():
            self.words[self._ack(r, self.rank)] = post
        return result

    def _post(self, code: int, count: int, x: np.ndarray, readers: list[int]) -> None:
        post = self.posts + 1
        slot = post % SLOTS
        self._wait_for_acks(post - SLOTS, self.readers[slot])
        at = self._header(self.rank, slot)
        self.words[at + POST] = 0  # the slot holds no message while it is rewritten
        segment = self._segment(slot, x.nbytes)
        if x.nbytes:
            np.ndarray(x.shape, dtype=x.dtype, buffer=segment.buf)[...] = x
        fields = {GROUP: code, COUNT: count, DTYPE: DTYPES.index(x.dtype), NDIM: x.ndim, GEN: self.generation[slot]}
        for field, value in fields.items():
            self.words[at + field] = value
        for i, dim in enumerate(x.shape):
            self.words[at + DIMS + i] = dim
        self.words[at + POST] = post  # last: the post is complete
        self.posts, self.readers[slot] = post, tuple(readers)

    def _segment(self, slot: int, nbytes: int) -> shared_memory.SharedMemory:
        own = self.own[slot]
        if own is None or own.size < nbytes:
            if own is not None:
                own.close()
                own.unlink()
                self.generation[slot] += 1
            name = f"{self.prefix}-{self.rank}-{slot}-{self.generation[slot]}"
            own = self.own[slot] = shared_memory.SharedMemory(create=True, size=max(MIN_CAPACITY, 2 * nbytes), name=name)
        return own

    def _wait_for_acks(self, post: int, readers: tuple[int, ...], timeout: float | None = None) -> None:
        if post <= 0 or not readers:
            return
        acks = [self._ack(self.rank, q) for q in readers]
        self._spin(lambda: all(self.words[a] >= post for a in acks), f"ranks {list(readers)} to read message {post}", timeout)

    def _read(self, rank: int, code: int, count: int) -> tuple[np.ndarray, int]:
        """``rank``'s post of this collective, in place, and its post number."""
        found: list[Any] = []

        words, heads = self.words, [self._header(rank, slot) for slot in range(SLOTS)]

        def posted() -> bool:
            for at in heads:
                post = words[at + POST]
                if post and words[at + GROUP] == code and words[at + COUNT] == count:
                    fields = words[at : at + HEADER].tolist()
                    if words[at + POST] == post:  # not rewritten while read (the writer zeroes it first)
                        found[:] = [fields, post]
                        return True
            return False

        self._spin(posted, f"rank {rank}")
        header, post = found
        slot = post % SLOTS
        segment = self._peer_segment(rank, slot, header[GEN])
        shape = tuple(header[DIMS : DIMS + header[NDIM]])
        return np.ndarray(shape, dtype=DTYPES[header[DTYPE]], buffer=segment.buf), post

    def _header(self, rank: int, slot: int) -> int:
        return rank * self.row + slot * HEADER

    def _ack(self, rank: int, reader: int) -> int:
        return rank * self.row + SLOTS * HEADER + reader

    def _peer_segment(self, rank: int, slot: int, generation: int) -> shared_memory.SharedMemory:
        known = self.attached.get((rank, slot))
        if known is None or known[0] != generation:
            if known is not None:
                with contextlib.suppress(BufferError):
                    known[1].close()
            segment = _attach(f"{self.prefix}-{rank}-{slot}-{generation}")
            self.attached[(rank, slot)] = known = (generation, segment)
        return known[1]

    def _spin(self, done: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Until ``done()``: 100 checks in a row, then a check per short sleep. Sleeping, not
        yielding: a rank that kept its core while waiting starved Paddle's own threads, whose
        frees lagged and grew the heap (+1-1.5 MB over 4000 steps of a small dp model; none
        with a sleep between checks)."""
        for _ in range(100):
            if done():
                return
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        while not done():
            if time.monotonic() - start > limit:
                raise AutoparError(f"rank {self.rank}: waited {limit:g} s for {what} in shared memory")
            time.sleep(SLEEP)

    def close(self) -> None:
        """Wait (briefly) until the last posts are read, then remove this rank's segments (once)."""
        if self.closed:
            return
        self.closed = True
        for slot in range(SLOTS):
            with contextlib.suppress(AutoparError):
                self._wait_for_acks(self.posts - (self.posts - slot) % SLOTS, self.readers[slot], timeout=2.0)
        for segment in self.own:
            if segment is not None:
                with contextlib.suppress(Exception):
                    segment.close()
                    segment.unlink()
        self.own = [None] * SLOTS
        for _, segment in self.attached.values():
            with contextlib.suppress(Exception):
                segment.close()
        self.attached.clear()
        self.words.release()  # (a view of the control block)
        with contextlib.suppress(Exception):
            self._control.close()
            if self.rank == 0:
                self._control.unlink()


_NODE: NodeMemory | None = None


def node_memory(rank: int, world: int, store: Any, timeout: float) -> NodeMemory:
    """This process's slots (one per process: every Executor in it shares them, as they share
    the rank's order of collectives); ``timeout`` bounds its waits behind the rank's watchdog."""
    global _NODE
    if _NODE is None:
        _NODE = NodeMemory(rank, world, store, timeout)
    elif (_NODE.rank, _NODE.world) != (rank, world):
        raise AutoparError(f"this process is rank {_NODE.rank} of {_NODE.world}; it cannot also be rank {rank} of {world}")
    return _NODE


class SharedMemoryCommunicator:
    """The host backend's communicator on one machine: every collective among its group's
    members through :class:`NodeMemory`; pipeline send / recv over the p2p links
    (:mod:`autopar.runtime.p2p`). Every member must run a group's collectives in the same order."""

    group_exchange = False  # (sub-groups always talk among their members only)

    def __init__(self, rank: int, world: int, timeout: float | None = None) -> None:
        from paddle.base import core

        from autopar.runtime.native import startup_label, wait_for_store

        self.rank, self.world = rank, world
        self.timeout = float(timeout) if timeout else collective_timeout()
        with waiting(startup_label(), timeout=self.timeout):
            wait_for_store(rank)
            self.store = core.create_or_get_global_tcp_store()
            self.node = node_memory(rank, world, self.store, self.timeout + WATCHDOG_MARGIN + 1.0)

    def run_in_scope(self, call: ScopeCall) -> bool:
        """Perform ``call`` reading the scope tensor in place and writing the result into the
        output tensor's memory when it already has that shape (a copy into a fresh tensor
        every step grew resident memory by ~900 B a step); p2p goes through :meth:`run`."""
        job = call.collective
        if point_to_point(job.kind) or job.trim_axis is not None:  # (a packed wire form goes through run)
            return False
        source = tensor_view(call.source)
        if source is None:
            return False

        def finish(arrays: dict[int, np.ndarray]) -> None:
            target = tensor_view(call.target)
            fits = target is not None and target.shape == source.shape and target.dtype == source.dtype
            if fits and not np.may_share_memory(target, source) and KINDS[job.kind].perform_into(job, target, arrays):
                return
            out = perform_for(job, arrays, self.rank)
            if target is not None and target.shape == out.shape and target.dtype == out.dtype:
                target[...] = out
            else:
                import paddle

                call.target.set(np.array(out), paddle.CPUPlace())  # (the source is a CPU tensor)

        record(job, source, self.rank)
        with waiting(collective_label(job), timeout=self.timeout):
            self.node.collect(job.group, source, finish)
        return True

    def run(self, job: Collective, x: np.ndarray) -> np.ndarray | None:
        with waiting(collective_label(job), timeout=self.timeout):
            if point_to_point(job.kind):
                from autopar.runtime.p2p import send_or_recv

                return send_or_recv(self.rank, self.store, job, x, self.timeout)
            message = posted(job, x, self.rank)
            record(job, message, self.rank)
            return self.node.collect(job.group, message, lambda arrays: _owned(received(job, arrays, x, self.rank), arrays))

    def all_gather_object(self, obj: Any, what: str | None = None) -> list[Any]:
        from autopar.runtime.native import exchange_label

        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        with waiting(what or exchange_label(), timeout=self.timeout):
            return self.node.collect(range(self.world), data, lambda arrays: [pickle.loads(arrays[r].tobytes()) for r in range(self.world)])


def _owned(out: np.ndarray, arrays: dict[int, np.ndarray]) -> np.ndarray:
    """``out``, copied if it is a view of a peer's slot (a broadcast's root piece), which the
    peer rewrites once this rank has acknowledged it."""
    return np.array(out) if any(np.may_share_memory(out, a) for a in arrays.values()) else out


def tensor_view(tensor: Any) -> np.ndarray | None:
    """A numpy array over a CPU ``core.DenseTensor``'s memory (no copy; valid while the tensor
    keeps its allocation), or None when it has none or a dtype numpy lacks."""
    import ctypes

    if not tensor._is_initialized() or not tensor._place().is_cpu_place():
        return None
    name = str(tensor._dtype()).removeprefix("paddle.")
    if name not in _BY_NAME:
        return None
    dtype = _BY_NAME[name]
    shape = tuple(tensor.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(tensor._ptr())
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)

