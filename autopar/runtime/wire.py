"""What the runtime puts on the wire, counted (stage: runtime).

Every backend that exchanges a collective's messages (the simulator, shared memory, gloo)
reports here the bytes each member's message carries for the other members
(:func:`autopar.collective_kinds.wire_bytes`: the all_to_all family, padded or trimmed), measured
on the arrays it sends, not priced. Nothing is kept unless a caller counts: ``with counting() as
log:`` around a run, then ``log.sent(...)``. Each process counts its own ranks (a real-process job:
its one rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from autopar.collective import Collective
from autopar.collective_kinds import wire_bytes


@dataclass(frozen=True, slots=True)
class Sent:
    """One member's message of one collective: ``nbytes`` meant for the other members."""

    rank: int
    kind: str
    value: str
    nbytes: int
    trimmed: bool  # the uneven all_to_all's packed form


@dataclass
class WireLog:
    records: list[Sent] = field(default_factory=list)

    def sent(self, rank: int | None = None, kind: str | None = None, trimmed: bool | None = None) -> int:
        """Bytes sent, summed over the records that match (None: any)."""
        return sum(
            s.nbytes for s in self.records
            if (rank is None or s.rank == rank) and (kind is None or s.kind == kind) and (trimmed is None or s.trimmed == trimmed)
        )  # fmt: skip

    def count(self, rank: int | None = None) -> int:
        return sum(1 for s in self.records if rank is None or s.rank == rank)


_LOGS: list[WireLog] = []


@contextmanager
def counting() -> Iterator[WireLog]:
    """Count what the collectives run inside the block send (nested blocks each count)."""
    log = WireLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def record(job: Collective, message: np.ndarray, rank: int) -> None:
    """``rank`` posted ``message`` for ``job``: counted by every open :func:`counting` block."""
    if not _LOGS:
        return
    nbytes = wire_bytes(job, message, rank)
    if nbytes is None:
        return
    sent = Sent(rank, str(job.kind), job.value, nbytes, job.trim_axis is not None)
    for log in _LOGS:
        log.records.append(sent)
