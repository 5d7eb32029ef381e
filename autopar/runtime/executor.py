"""autopar.Executor: run this process's rank of a DistributedProgram (stage: runtime).

One process per rank (``python -m autopar.launch --nproc N script.py``). The rank comes from
the environment (``PADDLE_TRAINER_ID``). Feeds are the *global* batch (sliced here by the
feeds' placements); fetches come back as *global* arrays (every rank gathers the pieces);
``parameters()`` returns full arrays. The host backend runs the rank's segments with the
Paddle executor and performs the collectives between them through a communicator. The only
thing taken from the compiler is this rank's :class:`~autopar.rank_plan.RankPlan`.
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from autopar.collective import Collective
from autopar.errors import AutoparError, NativeUnsupported
from autopar.mesh import ProcessMesh
from autopar.pieces import assemble
from autopar.rank_plan import RankPlan
from autopar.runtime.paddle_log import quiet_paddle_logs
from autopar.runtime.rank_runner import RankRunner
from autopar.runtime.replicas import checksum, digest, first_mismatch, generator_state, use_generator_state

CHECK_EVERY = 100  # steps between comparisons of the replicated copies (and the first step)


class Communicator(Protocol):
    """What the executor needs from a process-group backend."""

    def run(self, job: Collective, x: np.ndarray) -> np.ndarray | None:
        """Perform ``job`` with this rank's input; return this rank's output (None if none)."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for fetches and parameters)."""

    # optional: ``run_in_scope(call) -> bool`` performs ``call`` (a collective with this rank's
    # scope tensors: jobs.ScopeCall) in place and says whether it did (else the executor uses ``run``)


def rank_from_env() -> int:
    value = os.environ.get("PADDLE_TRAINER_ID", os.environ.get("RANK"))
    if value is None:
        raise AutoparError("no rank in the environment: run under python -m autopar.launch --nproc N (PADDLE_TRAINER_ID)")
    if not value.strip().isdigit():
        raise AutoparError(f"PADDLE_TRAINER_ID (or RANK) must be this process's rank, got {value!r}")
    return int(value)


def _check_arguments(dist: Any, rank: Any, communicator: Any) -> None:
    if not (callable(getattr(dist, "rank_plan", None)) and isinstance(getattr(dist, "mesh", None), ProcessMesh)):
        raise AutoparError(f"Executor needs the DistributedProgram autopar.compile returned, got {type(dist).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)):
        raise AutoparError(f"rank must be an int (or None: from the environment), got {rank!r}")
    if communicator is not None and not all(callable(getattr(communicator, m, None)) for m in ("run", "all_gather_object")):
        raise AutoparError(f"communicator must have run(job, x) and all_gather_object(obj), got {type(communicator).__name__}")


def _world_size(dist: Any) -> int:
    value = os.environ.get("PADDLE_TRAINERS_NUM")
    if value is None:
        return dist.world_size
    if not value.strip().isdigit():
        raise AutoparError(f"PADDLE_TRAINERS_NUM must be the number of processes, got {value!r}")
    return int(value)


class Executor:
    """``backend``: "host" (any mesh: segments + process-group collectives), "native" (the
    whole rank program with in-program collectives; on CPU only world-spanning ones), or
    "auto": on a CPU job whose ranks share one host, host (its shared-memory collectives take
    tens of microseconds, gloo's in-program ones a millisecond); otherwise native when every
    collective spans the world (on GPUs always), else host.

    ``check_every``: after the first step and every ``check_every``-th, every rank's checksums
    of its replicated copies (parameters, optimizer states, another stage's tied weight) ride in
    the step's exchange and a copy that differs is refused by name (None: never; a silently
    diverged copy would otherwise train on unnoticed)."""

    def __init__(
        self, dist: Any, rank: int | None = None, backend: str = "auto", communicator: Communicator | None = None,
        check_every: int | None = CHECK_EVERY,
    ) -> None:  # fmt: skip
        _check_arguments(dist, rank, communicator)
        quiet_paddle_logs()  # before the communicator: its store logs too
        if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, numbers.Integral) or check_every < 1):
            raise AutoparError(f"check_every must be a number of steps >= 1 (or None: never), got {check_every!r}")
        self.check_every = check_every
        if not isinstance(backend, str):
            raise AutoparError(f"backend must be one of 'host', 'native', 'auto', got {type(backend).__name__}")
        self.rank = rank_from_env() if rank is None else int(rank)
        self.world = _world_size(dist)
        if dist.world_size > self.world:
            raise AutoparError(f"the mesh {dist.mesh} needs {dist.world_size} processes, only {self.world} were started")
        if self.rank not in dist.mesh.ranks:
            raise AutoparError(f"rank {self.rank} is not in {dist.mesh}")
        if backend == "auto" and communicator is None and _shared_memory_host(self.world):
            backend = "host"
        self.plan: RankPlan = dist.rank_plan(self.rank, backend)
        self.backend = self.plan.backend
        # the plan for a fetch list makes the fetches whole inside the program (no exchange)
        self._plan_for = functools.partial(dist.rank_plan, self.rank, self.backend)
        if (self.backend == "native" or communicator is None) and "PADDLE_TRAINER_ENDPOINTS" not in os.environ:
            raise AutoparError(
                f"the {self.backend} backend needs a launched job (PADDLE_TRAINER_ENDPOINTS is not set): run under "
                "python -m autopar.launch --nproc N; for every rank in one process use autopar.simulate"
            )
        if self.backend == "native":
            from autopar.runtime.native import StoreExchange, create_rings

            self.comm = StoreExchange(create_rings(self.plan), self.rank, self.world)
        elif communicator is None:
            self.comm = _host_communicator(self.rank, self.world)
        else:
            self.comm = communicator
        if self.plan.pipeline is not None and hasattr(self.comm, "group_exchange"):
            self.comm.group_exchange = True  # a stage's collectives among its own ranks only
        self._runners: dict[tuple, Any] = {}
        self._last_fetch: tuple[list, tuple] = ([], ())
        self._runner: Any = None
        self._started = False
        self._steps = 0

    def _runner_for(self, fetch_list: Sequence[Any]) -> Any:
        if isinstance(fetch_list, (str, bytes)) or not isinstance(fetch_list, Sequence):
            raise AutoparError(f"fetch_list must be a list of Values or names, got {type(fetch_list).__name__}")
        last_list, last_keys = self._last_fetch
        if len(last_list) == len(fetch_list) and all(a is b for a, b in zip(last_list, fetch_list)):
            keys = last_keys  # the same fetch list as last step: no lookups (each leaves bytes behind in Paddle)
        else:
            keys = tuple(self.plan.values.key(item) for item in fetch_list)
            for key in keys:  # (before the step: a value that could only come back permuted is refused)
                self.plan.values.info(key).check_fetchable()
            self._last_fetch = (list(fetch_list), keys)
        runner = self._runners.get(keys)
        if runner is None:
            scope = self._runner.scope if self._runner is not None else None  # one scope per rank
            plan = self._fetch_plan(keys) if keys else self.plan
            if self.backend == "native":
                from autopar.runtime.native import NativeRunner

                runner = NativeRunner(plan, list(keys), scope)
            elif plan.pipeline is not None:
                from autopar.runtime.pipeline_runner import PipelineRunner

                runner = PipelineRunner(plan, list(keys), scope)
            else:
                runner = RankRunner(plan, list(keys), scope)
            self._runners[keys] = runner
        self._runner = runner
        return runner

    def _fetch_plan(self, keys: tuple) -> RankPlan:
        """The plan that makes ``keys`` whole inside the program; when the native program
        cannot (uneven pieces to gather), the step's plan, whose pieces are then exchanged."""
        try:
            return self._plan_for(fetches=keys)
        except NativeUnsupported:
            return self.plan

    def run_startup(self) -> None:
        """Initialize this rank's parameters and states: the serial values, sliced. Every rank
        draws from rank 0's random generator state, so replicated copies are bit-identical
        whatever the seeding, and equal to a serial start-up run from that state."""
        use_generator_state(self.comm.all_gather_object(generator_state())[0])
        self._runner_for(()).run_startup()
        self._started = True

    def check_replicas(self) -> None:
        """Raise naming the first parameter / optimizer state whose copies differ across the
        ranks that should hold the same piece (compares digests, not arrays)."""
        if self._runner is None:
            raise AutoparError("call run_startup() first")
        mismatch = self._mismatch(self.comm.all_gather_object(self._copy_hashes(digest)))
        if mismatch:
            raise AutoparError(f"rank {self.rank}: {mismatch}")

    def _checking(self) -> bool:
        """Whether this step compares the copies: the first, then every ``check_every``-th."""
        every = self.check_every
        return every is not None and (self._steps == 1 or self._steps % every == 0)

    def _copy_hashes(self, hash_of: Any) -> dict[str, str]:
        """``hash_of`` each parameter / state copy this rank keeps, by name."""
        return {n: hash_of(self._runner.parameter_piece(n)) for n in self.plan.copies()}

    def _mismatch(self, everyone: Sequence[Mapping[str, str]]) -> str | None:
        """The first copy whose hashes (every rank's, by rank) differ where they must agree."""
        return first_mismatch(self.plan.values, {r: everyone[r] for r in self.plan.mesh.ranks})

    def run(self, feed: Mapping[str, Any], fetch_list: Sequence[Any] = ()) -> list[np.ndarray]:
        """One step on the global ``feed``; returns each fetch as a global array."""
        if not self._started:
            raise AutoparError("call run_startup() before run()")
        if not isinstance(feed, Mapping):
            raise AutoparError(f"feed must be a dict of feed name -> global array, got {type(feed).__name__}")
        missing = sorted(set(self.plan.values.named("feed")) - set(feed))
        if missing and self.backend == "native":
            raise AutoparError(f"feed has no array for {missing}: every feed of the program is needed each step")
        runner = self._runner_for(fetch_list)
        self._steps += 1
        if self._steps % TRIM_EVERY == 0:
            return_free_heap()
        if self.backend == "native":
            pieces = runner.run(self.plan.local_feeds(feed))
        else:
            runner.set_feeds(feed)
            in_scope = self._in_scope(runner)
            job = runner.run_until_collective()
            while job is not None:
                call = runner.scope_collective() if in_scope else None
                if call is not None and self.comm.run_in_scope(call):
                    runner.finish_collective(None)  # done on the scope's tensors
                else:
                    runner.finish_collective(self.comm.run(job, runner.collective_input()))
                job = runner.run_until_collective()
            pieces = runner.fetch_pieces()
        exchange = bool(runner.fetch_keys) and not runner.whole  # (else the program made every fetch whole)
        if self._checking():  # the copies' checksums ride in the step's exchange (one of their own without one)
            everyone = self.comm.all_gather_object((pieces if exchange else None, self._copy_hashes(checksum)))
            mismatch = self._mismatch([sums for _, sums in everyone])
            if mismatch:
                raise AutoparError(
                    f"rank {self.rank}, step {self._steps}: {mismatch} (the periodic copy check, Executor(check_every=...))"
                )
            everyone = [got for got, _ in everyone]
        elif exchange:
            everyone = self.comm.all_gather_object(pieces)
        infos = [self.plan.values.info(key) for key in runner.fetch_keys]
        if not exchange:  # (each in the serial program's order: a zig-zag sequence put back)
            return [p if p is None else info.in_serial_order(p) for info, p in zip(infos, pieces)] if runner.fetch_keys else []
        out = []
        for i, info in enumerate(infos):
            by_rank = {r: everyone[r][i] for r in info.produced.mesh.ranks}
            out.append(info.in_serial_order(assemble(by_rank, info.produced, info.shape, info.dtype)))
        return out

    def _in_scope(self, runner: Any) -> bool:
        """Whether the communicator may perform the runner's collectives on its scope tensors
        (no numpy round trip): it can (``run_in_scope``), and the runner reads its collective
        inputs the plain way (a pipeline's runner picks them per micro-batch)."""
        return callable(getattr(self.comm, "run_in_scope", None)) and type(runner).collective_input is RankRunner.collective_input

    def timeline(self) -> Any:
        """The last step of a pipelined program as it ran on every rank: an
        :class:`autopar.schedule_timeline.Timeline` (each action's start and end, the bubble
        fraction, the peak number of stashed micro-batches); ``render_svg`` draws it.
        Every rank must call it (it is an exchange)."""
        from autopar.schedule_timeline import measured_timeline

        if self.plan.pipeline is None or self._runner is None:
            raise AutoparError("timeline(): the program is not pipelined, or no step ran yet")
        everyone = self.comm.all_gather_object(list(getattr(self._runner, "spans", [])))
        return measured_timeline({r: everyone[r] for r in self.plan.mesh.ranks})

    def save(self, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> None:
        """Save a checkpoint into the directory ``path``: every rank writes its own boxes of the
        parameters and optimizer states, the mesh's lowest rank the index (``metadata``, a
        JSON-able dict, goes in it). Atomic: until every rank has written, the previous
        checkpoint at ``path`` stays the one. Every rank calls it. Format: :mod:`autopar.checkpoint`."""
        if self._runner is None:
            raise AutoparError("call run_startup() before save()")
        from autopar.checkpoint import save_rank

        save_rank(path, self.plan, self._runner, self.comm.all_gather_object, metadata)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load a checkpoint saved on any mesh / annotation / strategy (after run_startup, before
        the next step): this rank reads only the files overlapping its pieces. Returns the
        metadata given to save. Every rank calls it; on any rank's error none changes its state."""
        if self._runner is None:
            raise AutoparError("call run_startup() before load(): the loaded values replace the start-up ones")
        from autopar.checkpoint import load_rank

        return load_rank(path, self.plan, self._runner, self.comm.all_gather_object)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter as a full array (gathered from all ranks)."""
        if self._runner is None:
            raise AutoparError("call run_startup() first")
        names = self.plan.values.named("parameter")
        mine = {n: self._runner.parameter_piece(n) for n in self.plan.held(("parameter",))}
        everyone = self.comm.all_gather_object(mine)
        out = {}
        for name, key in names.items():
            info = self.plan.values.info(key)
            pieces = {r: everyone[r][name] for r in info.placement.mesh.ranks}
            out[name] = assemble(pieces, info.placement, info.shape)
        return out


def _shared_memory_host(world: int) -> bool:
    """A CPU job whose ranks can all use shared memory (:func:`autopar.runtime.shm.available`)."""
    from autopar.runtime import shm
    from autopar.runtime.device import current_device

    return current_device().kind == "cpu" and shm.available(world)


def _host_communicator(rank: int, world: int) -> Any:
    """Shared memory when every rank runs on this host (:mod:`autopar.runtime.shm`: a collective
    in tens of microseconds, any sub-group), else gloo's process group."""
    from autopar.runtime import shm

    if shm.available(world):
        return shm.SharedMemoryCommunicator(rank, world)
    from autopar.runtime.gloo import GlooCommunicator

    return GlooCommunicator(rank, world)


TRIM_EVERY = 1000  # steps between returning the freed heap to the OS


@functools.cache
def _malloc_trim() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc


def return_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: give the heap's free pages back to the OS. A fast step loop
    frees what Paddle's threads allocated later than it allocates, so glibc keeps ever more
    freed heap above what is in use (measured, host backend, 0.7 ms steps: resident memory
    +1.0-1.8 MB over 4500 steps with the heap in use flat; -8 KiB with a trim). About a
    millisecond, every :data:`TRIM_EVERY` steps."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
