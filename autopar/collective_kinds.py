"""Each collective kind in one place: what it computes, how every backend runs it, what it
costs (stage: plan reshards -> runtime).

One class per :class:`~autopar.collective.CollectiveKind`, registered in :data:`KINDS`:

- ``perform``: its meaning on numpy arrays, one output per group member (the simulator runs it;
  every backend is tested against it);
- ``coefficients``: ``(steps, bytes)`` of its ring (or tree) algorithm, time = steps·α + bytes·β;
  ``exchange``: what each rank sends and combines when a world exchange runs it for a sub-group;
- ``emulated_by``: the kind gloo runs instead (then the own piece is sliced locally);
- ``host_op``: the Paddle op carrying it in a host-form rank program (the runtime performs it);
- ``native_op``: its lowering for the native backend (None: the host op runs as it is);
- ``eager``: how the host backend runs it over the whole world through Paddle's process group;
- what the passes ask instead of naming a kind: ``reduces``, ``gathers``, ``makes_whole``,
  ``sends`` / ``receives``, ``crosses_meshes``, ``in_plans``, ``gradient_sync``, ``zero_bucket``,
  ``decomposed`` / ``sliced`` (what it is made of, what it makes with a slice), ``slices`` /
  ``makes_partial`` (the local steps);
- ``calibration``: how the gloo calibration times it (tools/calibrate.py).

Adding a kind is adding one class here: every pass, backend and price reads this table.

Low precision: a Collective's ``dtype`` says what its arrays hold. A ``bfloat16`` value lives in
numpy as its ``uint16`` bits (as Paddle's scope hands it over and takes it back); kinds that only
move data move the bits unchanged. A reduction of a low-precision value (``bfloat16``,
``float16``) combines the members one by one in group order, each combination done in float32
and rounded to the low precision (round to nearest even) — what a ring's per-hop reduction in
that precision computes (:func:`autopar.low_precision.reduce`); an average divides that sum by
the member count, rounded once more. ``perform``, ``perform_into`` and ``eager`` all compute it, so
the simulator, shared memory and gloo give bit-identical results; gloo never sums
low-precision values itself (``in_place`` is None for them; ``eager`` exchanges the inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, ClassVar

import numpy as np

from autopar.collective import Collective, CollectiveKind
from autopar.dist_attr import shard_bounds
from autopar.errors import AutoparError, NativeUnsupported
from autopar.low_precision import is_low
from autopar.low_precision import reduce as reduce_low
from autopar.pieces import REDUCERS
from autopar.placement import Partial, Placement, Replicate, Shard

REDUCE_CODES = {"sum": 0, "max": 1, "min": 2, "prod": 3, "avg": 4}  # Paddle's reduce_type attribute


def own_piece(x: np.ndarray, axis: int, parts: int, index: int) -> np.ndarray:
    """Piece ``index`` of ``parts`` along ``axis`` (the bounds every pass and backend use), a copy."""
    return np.array(_piece_view(x, axis, parts, index))


def _piece_view(x: np.ndarray, axis: int, parts: int, index: int) -> np.ndarray:
    lo, hi = shard_bounds(x.shape[axis], parts, index)
    return x[(slice(None),) * (axis % max(x.ndim, 1)) + (slice(lo, hi),)]


def _reduce(arrays: list[np.ndarray], reduce: str, dtype: str = "float32") -> np.ndarray:
    """The members' reduction; ``dtype``: the Collective's (a low-precision one has its own rule,
    see the module docstring)."""
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise AutoparError(f"reduction over pieces of different shapes {sorted(shapes)}")
    if is_low(dtype):
        return reduce_low(arrays, reduce, dtype)
    if arrays[0].dtype == np.uint16:
        raise AutoparError(f"a {dtype} reduction got uint16 arrays (bfloat16 bits): the Collective's dtype must say bfloat16")
    return REDUCERS[reduce](np.stack(arrays), axis=0).astype(arrays[0].dtype)


def _log2(p: int) -> int:
    return int(np.ceil(np.log2(p))) if p > 1 else 0


def _even(comm: Collective) -> bool:
    """Whether every member contributes a piece of the same size (what Paddle's gather needs)."""
    return len({comm.src.local_shape(comm.shape, r)[comm.axis] for r in comm.group}) == 1


def _paddle_own_slice(x: Any, axis: int, parts: int, index: int) -> Any:
    import paddle

    lo, hi = shard_bounds(x.shape[axis], parts, index)
    return paddle._C_ops.slice(x, [axis], [lo], [hi], [1], [])


def _paddle_all_reduce(x: Any, ring: int, reduce: str, parts: int) -> Any:
    """gloo has no average: a sum, then a scale by 1/|group|."""
    import paddle

    if reduce == "avg":
        return paddle._C_ops.scale(paddle._C_ops.all_reduce(x, ring, REDUCE_CODES["sum"]), 1.0 / parts, 0.0, True)
    return paddle._C_ops.all_reduce(x, ring, REDUCE_CODES[reduce])


def _paddle_gather_along(x: Any, axis: int, ring: int, parts: int) -> Any:
    import paddle

    stacked = paddle._C_ops.all_gather(x, ring, parts)
    if axis == 0:
        return stacked
    return paddle._C_ops.concat(paddle._C_ops.split_with_num(stacked, parts, 0), axis)


def _uneven_refused(comm: Collective) -> None:
    if not _even(comm):
        raise NativeUnsupported(
            f"native backend: {comm.kind} of {comm.value} gathers uneven pieces {comm.src} (shape {list(comm.shape)}; "
            f"{comm.reason}); use the host backend (backend='auto' does)"
        )


class Kind:
    """A collective kind (subclass per kind; see the module docstring)."""

    kind: ClassVar[CollectiveKind]
    reduces: ClassVar[bool] = False  # takes a reduce op (sum, avg, max, min)
    emulated_by: ClassVar[CollectiveKind | None] = None  # what gloo runs instead, then the own piece
    tree: ClassVar[bool] = False  # has a tree algorithm (NCCL's all_reduce, broadcast)
    sized_by_input: ClassVar[bool] = False  # its byte count is the input's (nccl-tests' convention), else the output's
    gathers: ClassVar[bool] = False  # its output is the group's pieces joined (the input is 1/p of it)
    makes_whole: ClassVar[bool] = False  # makes a piece or a partial value whole on every member
    sends: ClassVar[bool] = False  # a rank program's sending half of a point-to-point move
    receives: ClassVar[bool] = False  # ... and its receiving half
    crosses_meshes: ClassVar[bool] = False  # moves a value between meshes (a pipeline's stages)
    in_plans: ClassVar[bool] = True  # a planner step can have it (else only a rank program carries it)
    gradient_sync: ClassVar[bool] = False  # a data-parallel gradient sync: gradient buckets fuse it, fetches ride it
    zero_bucket: ClassVar[bool] = False  # ZeRO buckets fuse it (gradients scattered, parameters gathered)
    decomposed: ClassVar[tuple[CollectiveKind, ...]] = ()  # the same result as these kinds over the same mesh dims
    sliced: ClassVar[CollectiveKind | None] = None  # what it and a slice of the own piece (same mesh dims) make
    slices: ClassVar[bool] = False  # the local step keeping the own piece
    makes_partial: ClassVar[bool] = False  # the local step making a whole value partial
    calibration_sizes: ClassVar[tuple[int, ...]] = ()  # extra sizes the gloo calibration times it at
    # the planner's move: the placement a step of this kind takes a mesh dim from, and to (None: the
    # planner makes no such step; cost_model/planner.py builds its edges from these)
    move: ClassVar[tuple[type[Placement], type[Placement]] | None] = None
    # gloo has no such collective: the host backend runs it by an exchange even over the whole world
    # (``eager``), so a ``world_exchange`` profile prices it as one (cost_model/comm.py)
    exchanged: ClassVar[bool] = False
    # the kind that sends it uneven (trimmed rows, counts first) when it moves a dropless
    # dispatch buffer (autopar/dropless.py); None: always sent as it is
    sent_uneven_as: ClassVar[CollectiveKind | None] = None

    def perform(self, job: Collective, pieces: list[np.ndarray]) -> list[np.ndarray | None]:
        raise AutoparError(f"the runtime cannot perform {self.kind}")

    def perform_for(self, job: Collective, pieces: list[np.ndarray], index: int) -> np.ndarray | None:
        """Member ``index``'s output alone (bit-equal to :meth:`perform`'s): what a rank that
        sees every input computes for itself."""
        return self.perform(job, pieces)[index]

    def perform_into(self, job: Collective, out: np.ndarray, inputs: dict[int, np.ndarray]) -> bool:
        """Write this rank's output straight into ``out`` (an output tensor's memory, shaped as
        the input) without a fresh array, bit-equal to :meth:`perform`; whether it could."""
        return False

    def posted(self, job: Collective, x: np.ndarray, index: int) -> np.ndarray:
        """What member ``index`` puts on the wire for ``job`` (every backend exchanges these):
        its input, unless the kind has a packed wire form (the uneven all_to_all)."""
        return x

    def received(self, job: Collective, posted: list[np.ndarray], x: np.ndarray, index: int) -> np.ndarray | None:
        """Member ``index``'s output from every member's :meth:`posted` message (``x``: its own
        input), bit-equal to :meth:`perform`'s."""
        return self.perform_for(job, posted, index)

    def wire_bytes(self, job: Collective, message: np.ndarray, index: int) -> int | None:
        """Bytes of member ``index``'s posted ``message`` meant for the other members (what a
        runtime counts as sent, :mod:`autopar.runtime.wire`); None: not counted for this kind."""
        return None

    def axes(self, tensor_dims: Sequence[int]) -> tuple[int, int]:
        """``(axis, split_axis)`` of a Collective for a planner step moving ``tensor_dims``."""
        return (tensor_dims[0] if tensor_dims else 0), 0

    def piece_axis(self, job: Collective) -> int:
        """The axis an emulation takes its own piece along."""
        return job.axis

    def coefficients(self, p: int, nbytes: float, algorithm: str = "ring") -> tuple[float, float]:
        raise AutoparError(f"{self.kind} has no price")

    def exchange(self, p: int, nbytes: float) -> tuple[float, float]:
        """``(bytes each rank sends, bytes it combines)`` when a world exchange runs it."""
        return nbytes, p * nbytes

    def emulation_bytes(self, p: int, nbytes: float) -> tuple[float, float]:
        """``(bytes its emulation moves, bytes copied locally for the own piece)``."""
        raise AutoparError(f"{self.kind} is not emulated")

    def local_time(self, nbytes: float, reduce: str | None, cluster: Any) -> tuple[float, float]:
        """A local step's ``(bytes, seconds)`` (no data leaves the rank)."""
        raise AutoparError(f"{self.kind} is not a local step")

    def host_op(self, comm: Collective, x: Any, ring: int) -> Any:
        raise AutoparError(f"no op carries {self.kind} in a rank program yet (reshard of {comm.value})")

    def native_op(self, comm: Collective, x: Any, ring: int, rank: int) -> Any | None:
        raise NativeUnsupported(f"the native backend cannot run {self.kind} (from {comm.value}); use the host backend")

    def eager(self, job: Collective, x: np.ndarray, backend: Any) -> np.ndarray:
        """The world collective through Paddle's process group; ``backend`` lends a reusable
        eager tensor (``buffer(x)``) and an all-gather of every rank's array (``gathered(x)``,
        rank -> array)."""
        raise AutoparError(f"the host backend cannot run {self.kind} over the world")

    def in_place(self, job: Collective) -> Any:
        """``run(process_group, tensor) -> task`` performing ``job`` in place on a world
        process group's tensor, or None when the kind (or its reduce op) cannot."""
        return None

    def calibration(self, paddle: Any, dist: Any, count: int, rank: int, world: int) -> Any:
        """A closure running it once over the world through Paddle's process group (gloo), its
        comm.py size ``count`` float32 elements: what tools/calibrate.py times."""
        raise ValueError(self.kind.value)


class AllReduce(Kind):
    kind = CollectiveKind.ALL_REDUCE
    move = (Partial, Replicate)
    reduces = True
    tree = True
    sized_by_input = True
    makes_whole = True
    gradient_sync = True
    decomposed = (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER)
    sliced = CollectiveKind.REDUCE_SCATTER

    def calibration(self, paddle, dist, count, rank, world):
        x = paddle.ones([count], dtype="float32")
        return lambda: dist.all_reduce(x)

    def perform(self, job, pieces):
        out = _reduce(pieces, job.reduce, job.dtype)
        return [out] * len(pieces)

    def coefficients(self, p, nbytes, algorithm="ring"):
        if algorithm == "tree":
            return 2.0 * _log2(p), 2.0 * nbytes
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.all_reduce(x, ring, REDUCE_CODES[comm.reduce])

    def native_op(self, comm, x, ring, rank):
        return None if comm.reduce != "avg" else _paddle_all_reduce(x, ring, comm.reduce, len(comm.group))

    def eager(self, job, x, backend):
        import paddle.distributed as pdist

        if is_low(job.dtype):  # (gloo would sum in its own order and precision)
            return _exchanged(job, x, backend)
        if job.reduce not in ("sum", "avg", "max", "min"):
            raise AutoparError(f"the host backend cannot all_reduce with {job.reduce!r} over the world")
        tensor = backend.buffer(x)
        op = {"sum": pdist.ReduceOp.SUM, "avg": pdist.ReduceOp.SUM, "max": pdist.ReduceOp.MAX, "min": pdist.ReduceOp.MIN}
        pdist.all_reduce(tensor, op=op[job.reduce])
        out = tensor.numpy()
        return out / len(job.group) if job.reduce == "avg" else out

    def perform_into(self, job, out, inputs):
        # the members combined one by one in group order: what _reduce's stacked reduction
        # computes, bit for bit (tests/unit/test_shared_memory_comm.py)
        if is_low(job.dtype):
            out[...] = _reduce([inputs[r] for r in job.group], job.reduce, job.dtype)
            return True
        combine = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}.get(job.reduce)
        if combine is None:
            return False
        first, *rest = job.group
        out[...] = inputs[first]
        for rank in rest:
            combine(out, inputs[rank], out=out)
        if job.reduce == "avg":
            np.divide(out, len(job.group), out=out)
        return True

    def in_place(self, job):
        from paddle.base import core

        name = {"sum": "SUM", "max": "MAX", "min": "MIN"}.get(job.reduce)
        if name is None or is_low(job.dtype):
            return None
        return lambda group, tensor: group.all_reduce(tensor, getattr(core.ReduceOp, name), True)


class AllGather(Kind):
    kind = CollectiveKind.ALL_GATHER
    move = (Shard, Replicate)
    gathers = True
    makes_whole = True
    zero_bucket = True
    calibration_sizes = (192 << 20,)  # what an emulated all_to_all of 48 MiB over 4 ranks gathers

    def calibration(self, paddle, dist, count, rank, world):  # nbytes = gathered output
        piece = paddle.ones([count // world], dtype="float32")
        return lambda: dist.all_gather([], piece)

    def perform(self, job, pieces):
        out = np.concatenate(pieces, axis=job.axis)
        return [out] * len(pieces)

    def coefficients(self, p, nbytes, algorithm="ring"):
        return float(p - 1), (p - 1) / p * nbytes

    def exchange(self, p, nbytes):
        return nbytes / p, nbytes  # each rank sends its piece of the gathered output

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.all_gather(x, ring, len(comm.group))

    def native_op(self, comm, x, ring, rank):
        _uneven_refused(comm)
        return None if comm.axis == 0 else _paddle_gather_along(x, comm.axis, ring, len(comm.group))

    def eager(self, job, x, backend):
        by_rank = backend.gathered(x)
        return np.concatenate([by_rank[r] for r in job.group], axis=job.axis)


class ReduceScatter(Kind):
    kind = CollectiveKind.REDUCE_SCATTER
    move = (Partial, Shard)
    reduces = True
    emulated_by = CollectiveKind.ALL_REDUCE
    sized_by_input = True
    zero_bucket = True

    def calibration(self, paddle, dist, count, rank, world):  # emulated: all_reduce of the input, keep the own chunk
        x = paddle.ones([count], dtype="float32")
        chunk = count // world
        return lambda: dist.all_reduce(x) or x[rank * chunk : (rank + 1) * chunk].clone()

    def emulation_bytes(self, p, nbytes):
        return nbytes, nbytes / p  # all_reduce of the input, then the own chunk

    def perform(self, job, pieces):
        total = _reduce(pieces, job.reduce, job.dtype)
        return [own_piece(total, job.axis, len(pieces), i) for i in range(len(pieces))]

    def perform_for(self, job, pieces, index):  # the own piece of each input, reduced: 1/p of the work
        return _reduce([_piece_view(p, job.axis, len(pieces), index) for p in pieces], job.reduce, job.dtype)

    def coefficients(self, p, nbytes, algorithm="ring"):
        return float(p - 1), (p - 1) / p * nbytes

    def host_op(self, comm, x, ring):
        import paddle

        try:
            return paddle._C_ops.reduce_scatter(x, ring, len(comm.group))
        except ValueError:
            # uneven or non-leading scatter: Paddle's op cannot even be built; the Collective
            # value carries the semantics and the runtime or backend lowering performs it.
            return paddle._C_ops.assign(x)

    def native_op(self, comm, x, ring, rank):
        parts = len(comm.group)
        return _paddle_own_slice(_paddle_all_reduce(x, ring, comm.reduce, parts), comm.axis, parts, comm.group.index(rank))


class AllToAll(Kind):
    kind = CollectiveKind.ALL_TO_ALL
    sent_uneven_as = CollectiveKind.ALL_TO_ALL_V
    move = (Shard, Shard)
    emulated_by = CollectiveKind.ALL_GATHER
    sized_by_input = True

    def calibration(self, paddle, dist, count, rank, world):  # emulated: all_gather every buffer, keep the own column
        send = paddle.ones([count], dtype="float32")
        chunk = count // world

        def run():
            parts: list = []
            dist.all_gather(parts, send)
            return paddle.concat([p[rank * chunk : (rank + 1) * chunk] for p in parts])

        return run

    def emulation_bytes(self, p, nbytes):
        return nbytes * p, nbytes  # all_gather of every rank's whole send buffer, then the own pieces

    def exchange(self, p, nbytes):
        return nbytes, nbytes

    def perform(self, job, pieces):
        return [self.perform_for(job, pieces, i) for i in range(len(pieces))]

    def perform_for(self, job, pieces, index):
        return np.concatenate([_piece_view(p, job.split_axis, len(pieces), index) for p in pieces], axis=job.axis)

    def axes(self, tensor_dims):
        return tensor_dims[0], tensor_dims[-1]  # gathered along the first, split along the last

    def wire_bytes(self, job, message, index):  # the pieces cut for the other members
        p = len(job.group)
        return sum(_piece_view(message, job.split_axis, p, j).nbytes for j in range(p) if j != index)

    def piece_axis(self, job):
        return job.split_axis

    def coefficients(self, p, nbytes, algorithm="ring"):
        return float(p - 1), (p - 1) / p * nbytes

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.all_to_all(x, ring)

    def native_op(self, comm, x, ring, rank):
        _uneven_refused(comm)
        parts = len(comm.group)
        gathered = _paddle_gather_along(x, comm.axis, ring, parts)
        return _paddle_own_slice(gathered, comm.split_axis, parts, comm.group.index(rank))


def _exchange_calibration(dist: Any, count: int) -> Callable[[], object]:
    """What a calibration times for a kind the host backend runs as an exchange: every rank's
    ``count`` floats to every rank."""
    mine = np.ones(count, np.float32)
    return lambda: dist.all_gather_object([], mine)


def _exchanged(job: Collective, x: np.ndarray, backend: Any) -> np.ndarray:
    """A world collective the host backend runs as an exchange: every rank's array to every rank
    (``backend.gathered``), then this rank's output by the reference meaning."""
    by_rank = backend.gathered(x)
    index = job.group.index(backend.rank)
    return KINDS[job.kind].perform_for(job, [by_rank[r] for r in job.group], index)


class Permute(Kind):
    """A ring shift over the group: member ``i`` sends its input to member ``(i + shift) % p`` and
    receives member ``(i - shift) % p``'s (JAX's ``ppermute`` by a fixed shift; ring attention
    passes its key / value blocks on with it). Every member sends and receives one message at
    once: one step of its input's bytes."""

    kind = CollectiveKind.PERMUTE
    sized_by_input = True
    exchanged = True

    def calibration(self, paddle, dist, count, rank, world):
        return _exchange_calibration(dist, count)

    def perform(self, job, pieces):
        p = len(pieces)
        return [pieces[(i - job.shift) % p] for i in range(p)]

    def perform_for(self, job, pieces, index):
        return pieces[(index - job.shift) % len(pieces)]

    def coefficients(self, p, nbytes, algorithm="ring"):
        return 1.0, float(nbytes)

    def exchange(self, p, nbytes):
        return nbytes, nbytes  # each rank sends its input, keeps one received input

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.assign(x)  # a carrier: the runtime performs the Collective it names

    def eager(self, job, x, backend):
        return _exchanged(job, x, backend)


class AllToAllV(Kind):
    """An all_to_all with a size per (sender, receiver) pair (MPI's ``Alltoallv``; MoE's token
    dispatch): member ``i`` cuts its input along ``split_axis`` into ``splits[i]`` (in group order)
    and member ``j`` joins the ``j``-th pieces of every member along ``axis``. ``nbytes`` is the
    busiest member's traffic: the larger of what leaves it and what arrives (:meth:`traffic`).

    With ``trim_axis`` (the uneven all_to_all of a dropless dispatch buffer, counts found at run
    time): the pieces are even, as all_to_all's, but each slab of a piece (an expert of a group)
    goes out only up to its last row along ``trim_axis`` holding a non-zero byte (raw bytes:
    ``-0.0`` and NaN are sent), and the receiver fills the rest with zeros. The result is all_to_all's for any data; what it saves depends on
    the data (a dispatch buffer's experts fill a prefix of their capacity, GShard's cumsum
    slots; the rows of empty slots stay zero through bias-free experts and in the gradients).
    The wire form (:meth:`posted`), the counts first: the pieces' shapes (``int64 [p, ndim]``),
    then per piece for another member the row count of each of its slabs (one per index of the
    dims before ``trim_axis``: an expert of a group, whose filled slots are a prefix of its
    capacity; ``int64``), then those rows, raw."""

    kind = CollectiveKind.ALL_TO_ALL_V
    sized_by_input = True
    exchanged = True

    def calibration(self, paddle, dist, count, rank, world):
        return _exchange_calibration(dist, count)

    @staticmethod
    def _pieces(job: Collective, x: np.ndarray, sender: int) -> list[np.ndarray]:
        p = len(job.group)
        sizes = job.splits[sender] if job.splits else [hi - lo for lo, hi in (shard_bounds(x.shape[job.split_axis], p, j) for j in range(p))]
        if sum(sizes) != x.shape[job.split_axis]:
            raise AutoparError(
                f"all_to_all_v of {job.value}: member {job.group[sender]} sends {list(sizes)} (sum {sum(sizes)}) "
                f"along dim {job.split_axis} of an input of shape {list(x.shape)}"
            )
        return np.split(x, np.cumsum(sizes)[:-1], axis=job.split_axis)

    def perform(self, job, pieces):
        return [self.perform_for(job, pieces, i) for i in range(len(pieces))]

    def perform_for(self, job, pieces, index):
        return np.concatenate([self._pieces(job, x, i)[index] for i, x in enumerate(pieces)], axis=job.axis)

    def axes(self, tensor_dims):
        return tensor_dims[0], tensor_dims[-1]  # (planned only as all_to_all's uneven form: its dims)

    def posted(self, job, x, index):
        if job.trim_axis is None:
            return x
        pieces = self._pieces(job, x, index)
        shapes = np.array([piece.shape for piece in pieces], dtype=np.int64)
        parts = [shapes.view(np.uint8).ravel()]
        for j, piece in enumerate(pieces):
            if j != index:  # (its own piece stays)
                parts += _trimmed(piece, job.trim_axis)
        return np.concatenate(parts)

    def received(self, job, posted, x, index):
        if job.trim_axis is None:
            return self.perform_for(job, posted, index)
        pieces = [self._pieces(job, x, index)[index] if i == index else _untrimmed(message, i, index, len(job.group), x, job.trim_axis)
                  for i, message in enumerate(posted)]  # fmt: skip
        return np.concatenate(pieces, axis=job.axis)

    def wire_bytes(self, job, message, index):
        if job.trim_axis is not None:  # (the packed message: counts, then the others' trimmed pieces)
            return int(message.nbytes)
        return sum(piece.nbytes for j, piece in enumerate(self._pieces(job, message, index)) if j != index)

    @staticmethod
    def traffic(splits: Sequence[Sequence[int]], bytes_per_count: float) -> float:
        """The busiest member's bytes: max over members of what it sends others and what others
        send it (its own piece stays): the ``nbytes`` the price reads."""
        p = len(splits)
        sent = [sum(splits[i][j] for j in range(p) if j != i) for i in range(p)]
        received = [sum(splits[i][j] for i in range(p) if i != j) for j in range(p)]
        return max([*sent, *received], default=0) * float(bytes_per_count)

    def coefficients(self, p, nbytes, algorithm="ring"):
        return float(p - 1), float(nbytes)  # pairwise exchange: p - 1 steps, the busiest member's bytes

    def exchange(self, p, nbytes):
        return nbytes, nbytes

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.assign(x)  # a carrier, typed to this rank's output by the emitter

    def native_op(self, comm, x, ring, rank):
        raise NativeUnsupported(
            f"native backend: all_to_all_v of {comm.value} ({comm.reason.split(':')[0]}) has no static gloo kernel "
            "(counts exchanged at run time); use the host backend (backend='auto' does), or "
            "Strategy(uneven_all_to_all=False) for the padded all_to_all"
        )

    def eager(self, job, x, backend):
        index = job.group.index(backend.rank)
        by_rank = backend.gathered(self.posted(job, x, index))
        return self.received(job, [by_rank[r] for r in job.group], x, index)


def _slabs(shape: Sequence[int], axis: int) -> tuple[int, int, int]:
    """A piece as ``[slabs, rows, row]``: the dims before ``axis`` (each slab: one expert of one
    group), the rows along it (the capacity), the values of a row."""
    return int(np.prod(shape[:axis], dtype=np.int64)), int(shape[axis]), int(np.prod(shape[axis + 1 :], dtype=np.int64))


def _trimmed(piece: np.ndarray, axis: int) -> list[np.ndarray]:
    """``piece``'s wire form: each slab's count of rows up to its last one holding a non-zero byte
    (``int64``), then those rows, raw bytes."""
    slabs, rows, row = _slabs(piece.shape, axis)
    values = np.ascontiguousarray(piece).reshape(slabs, rows, row)
    raw = values.view(np.uint8).reshape(slabs, rows, -1).any(axis=2) if values.size else np.zeros((slabs, rows), bool)
    counts = np.where(raw.any(axis=1), rows - np.argmax(raw[:, ::-1], axis=1), 0).astype(np.int64)
    return [counts.view(np.uint8), *(values[s, : counts[s]].view(np.uint8).ravel() for s in range(slabs))]


def _untrimmed(message: np.ndarray, sender: int, index: int, p: int, x: np.ndarray, axis: int) -> np.ndarray:
    """Member ``index``'s piece out of member ``sender``'s packed message, each slab zero-filled
    past its count."""
    shapes = message[: p * x.ndim * 8].view(np.int64).reshape(p, x.ndim)
    at = shapes.nbytes
    for j, shape in enumerate(shapes):
        if j == sender:
            continue
        slabs, rows, row = _slabs(shape, axis)
        counts = message[at : at + 8 * slabs].view(np.int64)
        at += 8 * slabs
        if j == index:
            out = np.zeros((slabs, rows, row), dtype=x.dtype)
            for s, count in enumerate(counts):
                size = int(count) * row * x.itemsize
                out[s, :count] = message[at : at + size].view(x.dtype).reshape(int(count), row)
                at += size
            return out.reshape(tuple(shape))
        at += int(counts.sum()) * row * x.itemsize
    raise AutoparError(f"all_to_all_v: member {sender}'s message holds no piece for member {index}")


class Broadcast(Kind):
    kind = CollectiveKind.BROADCAST
    tree = True
    crosses_meshes = True

    def calibration(self, paddle, dist, count, rank, world):
        x = paddle.ones([count], dtype="float32")
        return lambda: dist.broadcast(x, src=0)

    def perform(self, job, pieces):
        return [pieces[job.root]] * len(pieces)

    def coefficients(self, p, nbytes, algorithm="ring"):
        if algorithm == "tree":
            return float(_log2(p)), _log2(p) * float(nbytes)
        return float(p - 1), float(nbytes)

    def exchange(self, p, nbytes):
        return nbytes, 0.0

    def host_op(self, comm, x, ring):
        import paddle

        return paddle._C_ops.broadcast(x, ring, comm.root)

    def eager(self, job, x, backend):
        import paddle.distributed as pdist

        if is_low(job.dtype):  # (bits through an exchange, not a gloo tensor of that dtype)
            return _exchanged(job, x, backend)
        tensor = backend.buffer(x)
        pdist.broadcast(tensor, src=job.group[job.root])
        return tensor.numpy()

    def in_place(self, job):
        if is_low(job.dtype):
            return None
        return lambda group, tensor: group.broadcast(tensor, job.group[job.root], True)


class PointToPoint(Kind):
    """``send_recv`` as the planner prices it; a rank program carries ``send`` (sender) or
    ``recv`` (receiver): the receiver's output is the sender's input."""

    kind = CollectiveKind.SEND_RECV
    crosses_meshes = True

    def calibration(self, paddle, dist, count, rank, world):
        # pairs 0 -> 1, 2 -> 3, ... at once (every rank takes part: gloo's tags stay in step)
        x = paddle.ones([count], dtype="float32")
        if rank % 2 == 0:
            return (lambda: dist.send(x, dst=rank + 1)) if rank + 1 < world else (lambda: None)
        return lambda: dist.recv(x, src=rank - 1)

    def perform(self, job, pieces):
        return [None, pieces[0]]

    def coefficients(self, p, nbytes, algorithm="ring"):
        return 1.0, float(nbytes)

    def exchange(self, p, nbytes):
        return nbytes, 0.0

    def native_op(self, comm, x, ring, rank):
        raise NativeUnsupported(
            "native backend: a pipeline's send / recv and its schedule run on the host backend "
            "(static gloo programs have no send / recv kernel); use backend='host' or 'auto'"
        )


class Send(PointToPoint):
    kind = CollectiveKind.SEND
    sends = True
    in_plans = False


class Recv(PointToPoint):
    kind = CollectiveKind.RECV
    receives = True
    in_plans = False


class Local(Kind):
    """Slice and make-partial: no data leaves the rank (emitted as local ops, never a Collective)."""

    def coefficients(self, p, nbytes, algorithm="ring"):
        return 0.0, 0.0

    emitted_ops: int = 0  # the ops local_op adds to a rank program (with their constant operands)

    def ops_added(self, step: Any, rank: int, group: tuple[int, ...]) -> int:
        """How many ops :meth:`local_op` adds on ``rank`` (pricing counts them: each op costs its launch)."""
        return self.emitted_ops

    def local_op(self, step: Any, x: Any, shape: tuple[int, ...], rank: int, group: tuple[int, ...]) -> Any:
        """The op that makes ``rank``'s new piece from ``x`` (``x`` itself: nothing to do)."""
        raise NotImplementedError


class Slice(Local):
    kind = CollectiveKind.SLICE
    move = (Replicate, Shard)
    slices = True
    emitted_ops = 3  # slice and its starts / ends

    def local_time(self, nbytes, reduce, cluster):
        return nbytes, 2.0 * nbytes / cluster.device.memory_bandwidth  # read + write of the new piece

    def local_op(self, step, x, shape, rank, group):
        """This rank's new piece out of the piece it holds (bounds from the global split)."""
        import paddle

        old = step.src.local_slices(shape, rank)
        new = step.dst.local_slices(shape, rank)
        axes = [t for t in range(len(shape)) if old[t] != new[t]]
        starts = [new[t].start - old[t].start for t in axes]
        ends = [new[t].stop - old[t].start for t in axes]
        return paddle._C_ops.slice(x, axes, starts, ends, [1] * len(axes), [])


class MakePartial(Local):
    kind = CollectiveKind.MAKE_PARTIAL
    move = (Replicate, Partial)
    makes_partial = True
    emitted_ops = 2  # scale and its factor (on the ranks whose copy is zeroed)

    def local_time(self, nbytes, reduce, cluster):
        if reduce in ("max", "min", "avg"):  # every rank keeps its copy
            return 0, 0.0
        return nbytes, nbytes / cluster.device.memory_bandwidth  # all copies but one zeroed

    def ops_added(self, step, rank, group):
        return 0 if self._keeps(step, rank, group) else self.emitted_ops

    @staticmethod
    def _keeps(step: Any, rank: int, group: tuple[int, ...]) -> bool:
        """Whether ``rank`` keeps its copy (sum: one copy is kept, the others zeroed)."""
        return step.reduce in ("max", "min", "avg") or rank == group[0]

    def local_op(self, step, x, shape, rank, group):
        if self._keeps(step, rank, group):
            return x
        import paddle

        return paddle._C_ops.scale(x, 0.0, 0.0, True)


KINDS: dict[CollectiveKind, Kind] = {cls.kind: cls() for cls in (
    AllReduce, AllGather, ReduceScatter, AllToAll, Permute, AllToAllV, Broadcast, PointToPoint, Send, Recv, Slice,
    MakePartial,
)}  # fmt: skip


def kind_of(kind: str | CollectiveKind) -> Kind:
    """The entry of ``kind`` (a CollectiveKind or its name)."""
    try:
        return KINDS[CollectiveKind(kind)]
    except ValueError:
        raise AutoparError(f"unknown collective kind {kind!r}; expected one of {[k.value for k in KINDS]}") from None


def perform(job: Collective, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Every receiving member's output of ``job`` given every member's input."""
    group = list(job.group)
    missing = [r for r in group if r not in inputs]
    if missing:
        raise AutoparError(f"{job.kind} over {group}: no input from ranks {missing}")
    outputs = KINDS[job.kind].perform(job, [np.asarray(inputs[r]) for r in group])
    return {r: out for r, out in zip(group, outputs) if out is not None}


def perform_for(job: Collective, inputs: dict[int, np.ndarray], rank: int) -> np.ndarray | None:
    """``rank``'s output of ``job`` given every member's input (only its own is computed)."""
    group = list(job.group)
    missing = [r for r in group if r not in inputs]
    if missing:
        raise AutoparError(f"{job.kind} over {group}: no input from ranks {missing}")
    return KINDS[job.kind].perform_for(job, [np.asarray(inputs[r]) for r in group], group.index(rank))


def posted(job: Collective, x: np.ndarray, rank: int) -> np.ndarray:
    """What ``rank`` puts on the wire for ``job`` (its input, or the kind's packed form)."""
    return KINDS[job.kind].posted(job, np.asarray(x), job.group.index(rank))


def received(job: Collective, messages: dict[int, np.ndarray], x: np.ndarray, rank: int) -> np.ndarray | None:
    """``rank``'s output of ``job`` from every member's :func:`posted` message (``x``: its input)."""
    group = list(job.group)
    missing = [r for r in group if r not in messages]
    if missing:
        raise AutoparError(f"{job.kind} over {group}: no message from ranks {missing}")
    return KINDS[job.kind].received(job, [np.asarray(messages[r]) for r in group], np.asarray(x), group.index(rank))


def wire_bytes(job: Collective, message: np.ndarray, rank: int) -> int | None:
    """Bytes of ``rank``'s posted ``message`` meant for the other members (None: not counted)."""
    return KINDS[job.kind].wire_bytes(job, message, job.group.index(rank))


def emulated(job: Collective, rank: int, run: Any) -> np.ndarray:
    """``job`` run as its emulation (``run(emulating_job)`` gives the emulating kind's output),
    then this rank's own piece."""
    from dataclasses import replace

    entry = KINDS[job.kind]
    whole = run(replace(job, kind=entry.emulated_by))
    return own_piece(whole, entry.piece_axis(job), len(job.group), job.group.index(rank))


@cache
def uneven_form(kind: str | CollectiveKind) -> bool:
    """Whether ``kind`` is another kind's uneven form (its ``sent_uneven_as``): all_to_all_v."""
    return any(entry.sent_uneven_as is not None and entry.sent_uneven_as == kind for entry in KINDS.values())


@cache
def point_to_point(kind: str | CollectiveKind) -> bool:
    """(Cached, as :func:`local`: pricing a search asks it of every step of every plan.)"""
    return isinstance(KINDS[CollectiveKind(kind)], PointToPoint)


@cache
def local(kind: str | CollectiveKind) -> bool:
    """Whether ``kind`` moves no data off the rank (slice, make_partial)."""
    return isinstance(KINDS[CollectiveKind(kind)], Local)


def priced_kinds() -> Sequence[str]:
    """The kinds the cost model prices (the planner's step kinds that move data)."""
    return tuple(k.value for k, entry in KINDS.items() if not isinstance(entry, Local) and entry.in_plans)


def moves_from(source: type[Placement]) -> tuple[tuple[CollectiveKind, type[Placement]], ...]:
    """``(kind, target placement)`` of every planner move out of a ``source`` placement, in table order."""
    return tuple((k, entry.move[1]) for k, entry in KINDS.items() if entry.move is not None and entry.move[0] is source)


def step_kinds() -> tuple[CollectiveKind, ...]:
    """The kinds a planner step can have (all but a rank program's send / recv halves)."""
    return tuple(k for k, entry in KINDS.items() if entry.in_plans)


def composed(kinds: Sequence[str | CollectiveKind]) -> CollectiveKind | None:
    """The one kind whose ``decomposed`` is ``kinds`` (None: no kind is made of them)."""
    wanted = tuple(CollectiveKind(k) for k in kinds)
    return next((k for k, entry in KINDS.items() if entry.decomposed and entry.decomposed == wanted), None)
