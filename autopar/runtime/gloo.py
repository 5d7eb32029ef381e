"""Collectives between processes over gloo (CPU): the host backend's communicator.

Collectives over the whole world run natively through Paddle's dynamic-mode
``paddle.distributed`` on the default gloo group (all_reduce, all_gather, broadcast).
Sub-group collectives (a dp group of a 2 x 2 mesh) do NOT use ``new_group``: with 4 gloo
processes on this machine, creating the sub-groups deadlocks in gloo's pair setup (measured:
ranks time out in ``new_group`` after ~150 s — contrary to PADDLE_NOTES). Instead every rank
exchanges its input with the whole world (``all_gather_object``) and computes its own group's
output with the reference semantics of :mod:`autopar.runtime.collectives`. That moves
world-size times the bytes — fine for CPU tests, not a production path (the native backend
with NCCL is). It works because every rank meets the same sequence of collectives: each
planned reshard step emits one collective on every rank of the mesh (its own group's).

What gloo lacks is emulated the same way: reduce_scatter (all_reduce + own slice),
all_to_all, uneven all_gather. Those collectives switch to dynamic mode and back (0.3 ms a
switch here) and go through numpy. The common ones — a world all_reduce (sum, max, min) or
broadcast of a value in the rank's scope: gradients, partial sums, a fetched loss — run
through :meth:`GlooCommunicator.run_in_scope` instead: the input tensor copied into the output
variable once (a memcpy), reduced there in place by the world process group, in static mode.

Start-up (joining the TCP store, the world process group), every collective
and every exchange is a wait reported to the launcher (:func:`autopar.rank_status.waiting`), which
stops the job when one lasts longer than its ``--timeout`` and names the rank that never
arrived. The rank bounds the same waits itself (``AUTOPAR_COLLECTIVE_TIMEOUT``, default 120 s:
the process ends with a line naming the rank and the wait), so the bound holds under
``python -m paddle.distributed.launch`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autopar.collective import Collective
from autopar.collective_kinds import KINDS, emulated, point_to_point, posted, received
from autopar.errors import AutoparError
from autopar.paddle_mode import dygraph
from autopar.rank_status import collective_timeout, waiting
from autopar.runtime.jobs import ScopeCall, collective_label
from autopar.runtime.native import CREATED_RINGS, exchange_label, startup_label, wait_for_store
from autopar.runtime.wire import record


class GlooCommunicator:
    """One per process; every rank must call :meth:`run` for the same jobs in the same order."""

    def __init__(
        self, rank: int, world: int, groups: Sequence[Sequence[int]] = (), timeout: float | None = None
    ) -> None:
        import paddle
        import paddle.distributed as pdist

        self.rank = rank
        self.world = world
        self._buffers: dict[tuple, Any] = {}
        self.group_exchange = False  # sub-group collectives over the p2p links (set for pipelines)
        self.timeout = float(timeout) if timeout else collective_timeout()
        with dygraph():
            if not pdist.is_initialized():
                if CREATED_RINGS:
                    raise AutoparError(
                        "a native-backend Executor already made this process's communicators; the host "
                        "backend cannot start its process group after it: create host Executors first"
                    )
                with waiting(startup_label(), timeout=self.timeout):
                    wait_for_store(rank)
                    pdist.init_parallel_env()
            self._view = paddle.to_tensor(np.zeros((1,), "float32"))  # re-pointed at a scope tensor per collective
        self._world_group = pdist.collective._get_default_group().process_group

    def run_in_scope(self, call: ScopeCall) -> bool:
        """Perform ``call`` on this rank's scope tensors if it is a world all_reduce (sum, max,
        min) or broadcast; return whether it did (else use :meth:`run`). The input is copied
        into the output variable, which the world process group reduces or overwrites in place
        through an eager view sharing its memory: no numpy copies, no switch to dynamic mode
        (before: 4 copies and 2 mode switches a collective).

        Consecutive all_reduces are not merged into one here: whether two are consecutive (no
        segment between) depends on the rank's own program, and ranks that merged differently
        would call gloo with different sizes (measured: dp2 x mp2 with sequence parallelism,
        the fetched loss's all_reduce follows the gradients' on even mp ranks only). Merging
        them is a decision for the compiler, which sees every rank."""

        job = call.collective
        run = KINDS[job.kind].in_place(job) if sorted(job.group) == list(range(self.world)) else None
        if run is None:
            return False
        with waiting(collective_label(job), timeout=self.timeout):
            call.target._copy_from(call.source, call.source._place())
            view = self._view
            view.get_tensor()._share_data_with(call.target)
            run(self._world_group, view).wait()
        return True

    def run(self, job: Collective, x: np.ndarray) -> np.ndarray | None:
        what = collective_label(job)
        if point_to_point(job.kind):
            with waiting(what, timeout=self.timeout), dygraph():
                return self._point_to_point(job, x)
        with waiting(what, timeout=self.timeout), dygraph():
            world = sorted(job.group) == list(range(self.world))
            x = np.require(x, requirements="C")
            message = posted(job, x, self.rank) if self.rank in job.group else x  # (packed once: the kind's wire form)
            if self.rank in job.group:
                record(job, message, self.rank)  # (counted only inside autopar.runtime.wire.counting)
            if self.group_exchange and not world:
                return self._in_group(job, x, message)
            if world and KINDS[job.kind].emulated_by is not None:  # as gloo runs it natively (and the cost model prices it)
                return emulated(job, self.rank, lambda emulation: KINDS[emulation.kind].eager(emulation, x, self))
            if world:
                return KINDS[job.kind].eager(job, x, self)
            everyone: list[Any] = []
            import paddle.distributed as pdist

            pdist.all_gather_object(everyone, message)
            if self.rank not in job.group:
                return None
            return received(job, {r: everyone[r] for r in job.group}, x, self.rank)

    def _in_group(self, job: Collective, x: np.ndarray, message: np.ndarray) -> np.ndarray | None:
        """A sub-group collective among its members only, over the p2p links: each member sends
        its ``message`` (its input in the kind's wire form) to the others and computes its output
        (pipelines: the ranks of other stages run other jobs meanwhile, so the world exchange
        cannot serve them)."""
        links = self._links()
        for member in job.group:
            if member != self.rank:
                links.send(member, message, job.key)
        messages = {member: message if member == self.rank else links.recv(member, job.key, self.timeout) for member in job.group}
        return received(job, messages, x, self.rank)

    def _links(self) -> Any:
        from paddle.base import core

        from autopar.runtime.p2p import process_links

        return process_links(self.rank, core.create_or_get_global_tcp_store())

    def _point_to_point(self, job: Collective, x: np.ndarray) -> np.ndarray | None:
        """Pipeline p2p over buffered links, each message matched to its recv by the
        collective's key (value, micro-batch), not by its place on the link
        (:mod:`autopar.runtime.p2p`: gloo's send blocks until the recv is posted, which
        deadlocks 1F1B; the TCP store costs ~40 ms a message)."""
        from paddle.base import core

        from autopar.runtime.p2p import send_or_recv

        return send_or_recv(self.rank, core.create_or_get_global_tcp_store(), job, x, self.timeout)

    def buffer(self, x: np.ndarray) -> Any:
        """An eager tensor holding ``x``, reused per shape and dtype: every new eager tensor
        leaves ~100 B behind in Paddle 3.3.1 (measured), which grows with every step."""
        import paddle

        key = (x.shape, x.dtype.str)
        tensor = self._buffers.get(key)
        if tensor is None:
            tensor = self._buffers[key] = paddle.to_tensor(x)
        else:
            tensor.get_tensor().set(x, paddle.CPUPlace())
        return tensor

    def gathered(self, x: np.ndarray) -> dict[int, np.ndarray]:
        """Every rank's array, by rank (gloo's all_gather when the shapes agree, else an exchange;
        bfloat16 bits, held as uint16, always through the exchange: they come back as uint16)."""
        import paddle
        import paddle.distributed as pdist

        pieces: list[Any] = []
        if x.dtype != np.uint16 and self._even(x):
            pdist.all_gather(pieces, paddle.to_tensor(x))
            return dict(zip(range(self.world), (p.numpy() for p in pieces)))
        pdist.all_gather_object(pieces, x)
        return dict(zip(range(self.world), pieces))

    def _even(self, x: np.ndarray) -> bool:
        """Whether every rank's piece has the same shape (gloo's all_gather needs it)."""
        import paddle
        import paddle.distributed as pdist

        shapes: list[Any] = []
        pdist.all_gather(shapes, paddle.to_tensor(np.asarray(x.shape, dtype="int64")))
        return len({tuple(s.numpy().tolist()) for s in shapes}) == 1

    def all_gather_object(self, obj: Any, what: str | None = None) -> list[Any]:
        import paddle.distributed as pdist

        with waiting(what or exchange_label(), timeout=self.timeout), dygraph():
            out: list[Any] = []
            pdist.all_gather_object(out, obj)
            return out
