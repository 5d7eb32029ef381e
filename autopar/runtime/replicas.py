"""Replicated values must be the same on every rank (stage: runtime).

Every rank runs its own start-up program. Unless every rank draws from the same random
generator state, the replicated copies of a parameter differ from rank to rank — silently:
the step still runs. :func:`agreed_start` makes every rank start from rank 0's generator
state (so every copy is bit-identical, and equal to a serial start-up run from that state:
:func:`generator_state` on rank 0, :func:`use_generator_state` everywhere before start-up);
:func:`first_mismatch` finds a value whose copies differ anyway (the check behind
``Executor.check_replicas()`` and ``simulate``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from autopar.rank_plan import ValueTable


def generator_state() -> Any:
    """This process's random generator state for the current device (picklable)."""
    import paddle

    return paddle.get_rng_state()


def use_generator_state(state: Any) -> None:
    """Draw from ``state`` from now on (ranks that start from one state draw the same values)."""
    import paddle

    paddle.set_rng_state(state)


def digest(array: np.ndarray) -> str:
    array = np.require(array, requirements="C")
    return hashlib.blake2b(array.tobytes() + str((array.dtype, array.shape)).encode(), digest_size=16).hexdigest()


def checksum(array: np.ndarray) -> str:
    """A cheap bit-level checksum (CRC-32 of the bytes, with dtype and shape) for the periodic
    copy check of every step's exchange: a few GB/s, where :func:`digest` is a cryptographic hash."""
    array = np.require(array, requirements="C")
    return f"{zlib.crc32(array.reshape(-1).view(np.uint8)):08x}:{array.dtype}{array.shape}"


def first_mismatch(values: ValueTable, digests: Mapping[int, Mapping[str, str]]) -> str | None:
    """A message naming the first parameter / state (in name order) whose copies on ranks
    holding the same piece differ, or None; a whole value's copies on other pipeline stages
    are compared too. ``digests``: rank -> name -> digest."""
    names = {**values.named("parameter"), **values.named("state")}
    for name in sorted(names):
        info = values.info(names[name])
        if info.placement.is_partial:
            continue  # pending sums differ by design
        holders: dict[tuple, list[int]] = {}
        whole = not info.placement.sharded_mesh_dims()
        for rank in sorted(digests):
            if name not in digests[rank]:
                continue
            if rank in info.placement.mesh.ranks:
                piece = tuple((s.start, s.stop) for s in info.placement.local_slices(info.shape, rank))
            elif whole:  # another pipeline stage's copy (a parameter read on several stages)
                piece = tuple((0, size) for size in info.shape)
            else:
                continue
            holders.setdefault(piece, []).append(rank)
        for piece, ranks in holders.items():
            seen = {digests[r][name] for r in ranks}
            if len(seen) > 1:
                differ = [r for r in ranks if digests[r][name] != digests[ranks[0]][name]]
                where = "" if len(piece) == 0 else f" (piece {[list(p) for p in piece]})"
                return (
                    f"{name}{where} differs across the ranks that replicate it: rank {ranks[0]} vs ranks {differ} "
                    f"(placement {info.placement})"
                )
    return None
