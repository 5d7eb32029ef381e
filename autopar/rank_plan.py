"""RankPlan: everything one rank needs to run, and nothing else from the compiler
(stage: the per-rank contract between compile and runtime).

``dist.rank_plan(rank)`` builds it lazily (only that rank's program is cloned and
rewritten) and caches it. The Executor, the simulator and both backends take RankPlans: the
rank's program and startup, its ordered jobs (compute ranges and the :class:`Collective`
values between them), the communicator ids of its groups, and a :class:`ValueTable` saying
how each serial value is sliced (feeds), placed (fetches, parameters) and where the program
computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.collective import Collective
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError, removed_error
from autopar.index_feeds import IndexUse, check_index_feed
from autopar.learning_rate import LearningRateSchedule
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_OPS, SOURCE_OPS
from autopar.pipeline_lowering import Piece, RankAction, cut, link_ordered, lower, peers, verify_rank
from autopar.schedule import Action, Phase

if TYPE_CHECKING:
    from paddle.pir import Program

ValueKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """One serial value: ``placement`` is its final one, ``produced`` what its op makes
    (differs when an annotation reshards it right after the producer)."""

    key: ValueKey
    label: str
    kind: str  # "parameter", "feed", "state", "activation", ...
    shape: tuple[int, ...]
    dtype: str
    placement: DistAttr
    produced: DistAttr
    order: SequenceOrder | None = None  # the sequence in zig-zag order along some dims (None: serial order)

    def in_serial_order(self, array: np.ndarray) -> np.ndarray:
        """``array`` (this value as the program holds it, global) in the serial program's order."""
        return array if self.order is None else self.order.serial(array, self.label)

    def check_fetchable(self) -> None:
        """Refuse by name, before a step runs, a fetch that could not be returned in serial order."""
        if self.order is not None:
            self.order.refuse_unknown(self.label)


@dataclass(frozen=True, slots=True)
class SequenceOrder:
    """A value carrying the sequence in zig-zag order (``ContextParallel(balance="zigzag")``).
    Each of ``dims`` is ``(dim, extent, inner)``: the dim read as ``[outer, extent, inner]``
    (``outer`` / ``inner``: a batch or hidden dim flattened with the sequence, 1 when not), and
    along ``extent``, position ``p`` of the program's value holds serial position ``order[p]``
    (positions past the sequence, as a causal-mask buffer longer than it has, are in place).
    ``unknown``: why the order is not known — the value cannot be returned in serial order."""

    order: tuple[int, ...]
    dims: tuple[tuple[int, int, int], ...] = ()
    unknown: str = ""

    def refuse_unknown(self, label: str) -> None:
        """Refuse by name a value whose order is not known."""
        if self.unknown:
            raise AutoparError(
                f"{label} carries the sequence in the zig-zag order of ContextParallel(balance='zigzag') and where is not "
                f"known: {self.unknown}; it cannot be returned in serial order (fetch it with balance=None)"
            )

    def serial(self, array: np.ndarray, label: str) -> np.ndarray:
        """``array`` put back in serial order (refused by name where the order is not known)."""
        self.refuse_unknown(label)
        array = np.asarray(array)
        for dim, extent, inner in self.dims:
            shape = array.shape
            index = np.array([*self.order, *range(len(self.order), extent)])
            blocks = array.reshape(*shape[:dim], shape[dim] // (extent * inner), extent, inner, *shape[dim + 1 :])
            array = np.take(blocks, np.argsort(index), axis=dim + 1).reshape(shape)
        return array


class ValueTable:
    """Serial values by name or Value, as the runtime sees them (shared by every RankPlan)."""

    def __init__(
        self, by_name: Mapping[str, ValueKey], resolve: Any, infos: Mapping[ValueKey, ValueInfo], removed: Mapping[str, str] | None = None,
        index_uses: Mapping[str, tuple[IndexUse, ...]] | None = None,
    ) -> None:  # fmt: skip
        self._by_name = dict(by_name)
        self._resolve = resolve  # a serial program's Value -> key (None if not of this program)
        self._infos = infos
        self._removed = dict(removed or {})  # id of a Value removed as dead -> its label (autopar.rewrites.dead_ops)
        self.index_uses = dict(index_uses or {})  # feed name -> the index ops its elements reach (bounds checked per step)

    def key(self, item: Any) -> ValueKey:
        """The key of a feed / parameter / state name, or of a Value of the serial program.

        A Value is matched by its id (the address of its C++ value, read without following
        it) and nothing else is read from it before it matches: a Value whose program was
        garbage-collected points to freed memory, and printing it would crash the process.
        """
        import paddle

        if isinstance(item, str):
            key = self._by_name.get(item)
            if key is None:
                raise AutoparError(f"no parameter, feed or state named {item!r} in the compiled program")
            return key
        if not isinstance(item, paddle.pir.Value):
            raise AutoparError(
                f"expected a Value of the compiled program or the name of a feed, parameter or state, got {_describe(item)}"
            )
        key = self._resolve(item)
        if key is None and item.id in self._removed:
            raise removed_error(self._removed[item.id])
        if key is None:
            raise AutoparError(
                "a Value that is not a value of the compiled program (it belongs to another program, or to one "
                "that no longer exists): pass Values of the program given to compile, or feed / parameter names"
            )
        return key

    def info(self, key: ValueKey) -> ValueInfo:
        return self._infos[key]

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def named(self, kind: str) -> dict[str, ValueKey]:
        """Names of the values of ``kind`` ("parameter", "feed", "state")."""
        return {n: k for n, k in self._by_name.items() if self._infos[k].kind == kind}


def _feed_array(name: str, array: Any, info: ValueInfo) -> np.ndarray:
    """A global feed as a numpy array of the dtype the program declares (refused, never cast)."""
    try:
        array = np.asarray(array)
    except (ValueError, TypeError) as err:
        raise AutoparError(f"feed {name!r} must be an array of shape {list(info.shape)}, got {type(array).__name__}: {err}") from err
    try:
        declared = np.dtype(info.dtype)
    except TypeError:
        return array  # a dtype numpy does not know (bfloat16): Paddle checks it
    if array.dtype != declared:
        raise AutoparError(
            f"feed {name!r} has dtype {array.dtype}, the program declares {declared}: convert it (array.astype('{declared}'))"
        )
    return array


def _describe(item: Any) -> str:
    """A short, safe description of a user's argument for an error message."""
    text = reprlib.repr(item) if isinstance(item, (int, float, complex, bytes, type(None))) else ""
    return f"{text} ({type(item).__name__})" if text else type(item).__name__


@dataclass(frozen=True, slots=True)
class Compute:
    """Ops ``[start, stop)`` of the rank program, run by the Paddle executor."""

    start: int
    stop: int


@dataclass(frozen=True)
class PipelineRole:
    """What a pipelined rank runs: its stage's verified schedule, one micro-batch at a time.

    ``actions``: the rank's stage-level schedule (``1RECV_F0``, ``1F0``, ..., send / recv
    included, verified for the whole pipeline at compile). ``phases``: per op of the program,
    the :class:`~autopar.schedule.Phase` it runs in (``F0``, ``B1``, ...: once per micro-batch;
    ``OPT``: once per step). ``pieces`` and ``steps``: the executable schedule lowered from both
    (:mod:`autopar.pipeline_lowering`): the program cut per action, and the actions the runner
    walks, transfers named; :class:`RankPlan` fills them when it is built. ``feed_dims``: each
    feed's dim cut into micro-batches. ``summed``: values pending a sum over the micro-batches
    (losses, gradients): a fetch adds its micro-batches' pieces, the update reads the
    accumulated gradients.
    """

    stage: int
    actions: tuple[Action, ...]
    micro_batches: int
    phases: tuple[Phase, ...]
    feed_dims: Mapping[str, int]
    summed: frozenset[ValueKey]
    split: frozenset[ValueKey] = frozenset()  # values split over the micro-batches (not fetched)
    pieces: tuple[Piece, ...] = ()
    steps: tuple[RankAction, ...] = ()

    def cut_from_phases(self) -> bool:
        """Whether ``pieces`` cover the program's ops as ``phases`` place them (a role whose
        phases were edited since, as ``autopar.testing.faults`` does, must be lowered anew)."""
        covered = sum(len(piece.ops) for piece in self.pieces)
        return bool(self.steps) and covered == len(self.phases) and all(
            self.phases[op] == piece.phase for piece in self.pieces for op in piece.ops
        )  # fmt: skip

    def lowered(self, collectives: Sequence[tuple[Collective, int]], free: frozenset[int]) -> PipelineRole:
        """This role with its executable schedule: the program cut into pieces at its transfers
        and buckets (``free``: op positions every piece re-makes, see :func:`~autopar.pipeline_lowering.cut`),
        the schedule lowered onto them."""
        pieces = cut(self.phases, collectives, free)
        return dataclasses.replace(self, pieces=pieces, steps=lower(self.actions, pieces, self.micro_batches))

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks at the other end of this role's transfers."""
        return peers(self.steps)

    def in_link_order(self, rank: int, peer_steps: Mapping[int, Sequence[RankAction]]) -> PipelineRole:
        """This role with its recvs in the order its links carry the messages, from its peers'
        executable schedules (``peer_steps``), checked (:func:`~autopar.pipeline_lowering.link_ordered`):
        the host backend's links and NCCL's deliver in order, and a recv takes the next message."""
        steps = link_ordered(rank, {**peer_steps, rank: self.steps})
        verify_rank(rank, self.pieces, steps, self.micro_batches)
        return dataclasses.replace(self, steps=steps)


@dataclass(frozen=True)
class RankPlan:
    """One rank's contract (see the module docstring). ``backend``: the form of ``program``
    ("host": collectives are placeholders the runtime performs; "native": real ops)."""

    rank: int
    mesh: ProcessMesh
    backend: str
    program: Program
    startup: Program | None  # None when compile had no startup program
    collectives: tuple[tuple[Collective, int], ...]  # (value, position of the op carrying it), program order
    rings: Mapping[tuple[int, ...], int]  # groups this rank is in -> communicator id
    values: ValueTable
    op_positions: tuple[int, ...]  # serial op index -> position of its op in ``program``
    replaced: Mapping[ValueKey, tuple[int, int]]  # values read after a local correction op: (position, result)
    stages: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()
    fetches: tuple[ValueKey, ...] = ()  # values the program makes whole on every rank at the end of the step
    fetch_positions: tuple[tuple[int, int], ...] = ()  # where (op position, result), in ``fetches`` order
    pipeline: PipelineRole | None = None
    learning_rate: LearningRateSchedule | None = None  # written into the scope before each step

    def __post_init__(self) -> None:
        """A pipelined plan is built with its executable schedule (lowered here, once, when the
        compiler makes the plan; a plan rebuilt with a role whose pieces still match its phases
        keeps its steps, reordered or not; one whose phases were edited is lowered anew)."""
        role = self.pipeline
        if role is not None and not role.cut_from_phases():
            ops = self.program.global_block().ops
            free = frozenset(i for i, op in enumerate(ops) if op.name() in SOURCE_OPS or (op.name() in CONSTANT_OPS and op.num_operands() == 0))
            role = role.lowered(self.collectives, free)
            verify_rank(self.rank, role.pieces, role.steps, role.micro_batches)
            object.__setattr__(self, "pipeline", role)

    def in_link_order(self, peer_steps: Mapping[int, Sequence[RankAction]]) -> RankPlan:
        """This plan with its pipeline's recvs in link order (:meth:`PipelineRole.in_link_order`;
        ``peer_steps``: the executable schedules of the ranks it exchanges with). The compiler
        builds every rank plan so (``DistributedProgram.rank_plan``)."""
        if self.pipeline is None:
            return self
        return dataclasses.replace(self, pipeline=self.pipeline.in_link_order(self.rank, peer_steps))

    @property
    def world_size(self) -> int:
        return self.mesh.size

    @functools.cached_property
    def jobs(self) -> tuple[Compute | Collective, ...]:
        """Compute ranges and collectives in the order the rank runs them."""
        jobs: list[Compute | Collective] = []
        start = 0
        for collective, position in self.collectives:
            if position > start:
                jobs.append(Compute(start, position))
            jobs.append(collective)
            start = position + 1
        ops = len(self.program.global_block().ops)
        if start < ops:
            jobs.append(Compute(start, ops))
        return tuple(jobs)

    @functools.cached_property
    def scope_reads(self) -> frozenset[str]:
        """Names the program reads from the rank's scope: parameters, optimizer states, the
        learning rate (``builtin.parameter`` and persistable ``pd_op.data``)."""
        names = set()
        for op in self.program.global_block().ops:
            if op.name() == "builtin.parameter":
                names.add(str(op.attrs()["parameter_name"]))
            elif op.name() == "pd_op.data" and op.result(0).persistable:
                names.add(str(op.attrs()["name"]))
        return frozenset(names)

    def run_startup(self, scope: Any, executor: Any) -> None:
        """Run the start-up program into ``scope``, then drop what the rank neither holds nor
        reads: another pipeline stage's parameters and states, which the start-up still draws
        so that the generator stays in step with a serial start-up (values equal serial)."""
        import paddle

        if self.startup is None:
            raise AutoparError("compile was called without startup_program=; there is no startup to run")
        with paddle.static.scope_guard(scope):
            executor.run(self.startup)
        keep = self.scope_reads | set(self.held())
        scope.erase([n for n in scope.local_var_names() if n not in keep])

    def held(self, kinds: Sequence[str] = ("parameter", "state")) -> list[str]:
        """Names of the values of ``kinds`` placed on a mesh holding this rank (a pipeline rank
        holds its stage's parameters and states only: start-up stores no other stage's)."""
        return [n for kind in kinds for n, k in self.values.named(kind).items() if self.rank in self.values.info(k).placement.mesh.ranks]

    def copies(self) -> list[str]:
        """Names of the parameters and states this rank keeps in its scope: those it holds,
        and another stage's whole parameter its program reads (a tied embedding's copy)."""
        named = {**self.values.named("parameter"), **self.values.named("state")}
        return sorted(set(self.held()) | (self.scope_reads & set(named)))

    def position(self, key: ValueKey) -> tuple[int, int]:
        """Where the program computes the serial value ``key`` (as its producer makes it, after
        any local correction such as an uneven mean's scale)."""
        found = self.replaced.get(key)
        return found if found is not None else (self.op_positions[key[0]], key[1])

    def fetch_sites(self, keys: tuple[ValueKey, ...]) -> tuple[bool, list[tuple[int, int]]]:
        """Where the program holds each fetch of ``keys``, and whether whole: the plan built for
        exactly this fetch list made them whole (fetch_replication); otherwise each is read
        as its producer makes it, and the caller assembles the pieces."""
        whole = bool(keys) and self.fetches == tuple(keys)
        return whole, list(self.fetch_positions) if whole else [self.position(key) for key in keys]

    def local_feeds(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Each global feed sliced to this rank's piece (name, shape and dtype checked first)."""
        if not isinstance(feed, Mapping):
            raise AutoparError(f"feed must be a dict of feed name -> global array, got {type(feed).__name__}")
        feeds = self.values.named("feed")
        local = {}
        for name, array in feed.items():
            if not isinstance(name, str):
                raise AutoparError(f"feed keys are feed names (str), got {_describe(name)}; the program's feeds are {sorted(feeds)}")
            if name not in feeds:
                raise AutoparError(f"{name!r} is not a feed of the compiled program; its feeds are {sorted(feeds)}")
            info = self.values.info(feeds[name])
            array = _feed_array(name, array, info)
            if tuple(array.shape) != info.shape:
                raise AutoparError(f"feed {name!r} has shape {list(array.shape)}, the program declares {list(info.shape)}")
            check_index_feed(name, array, self.values.index_uses.get(name, ()))
            if self.rank in info.placement.mesh.ranks:
                local[name] = self._piece(info, array)
            elif name in self.program_feeds and not info.placement.sharded_mesh_dims():
                local[name] = array  # another stage's whole feed, read here too (a residual input, a mask)
        return local

    @functools.cached_property
    def program_feeds(self) -> frozenset[str]:
        """Names of the feeds this rank's program reads (``pd_op.data`` ops that are not scope reads)."""
        return frozenset(
            str(op.attrs()["name"]) for op in self.program.global_block().ops
            if op.name() == "pd_op.data" and not op.result(0).persistable
        )  # fmt: skip

    def _piece(self, info: ValueInfo, array: np.ndarray) -> np.ndarray:
        """This rank's piece of a global feed; a Partial feed is split as a pending reduction:
        along each partial mesh dim the group's first rank holds the value, the others the
        reduction's identity (zeros for sum; a copy for avg / max / min)."""
        piece = np.require(array[info.placement.local_slices(info.shape, self.rank)], requirements="C")
        coord = self.mesh.coordinate(self.rank)
        for mesh_dim, kind in info.placement.partial:
            if kind == "sum" and coord[mesh_dim] != 0:
                piece = np.zeros_like(piece)
        return piece
