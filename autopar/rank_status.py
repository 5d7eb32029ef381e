"""Where each rank waits, as the launcher sees it (stage: runtime <-> launcher).

The runtime reports every wait (start-up, each collective, each exchange, each native step)
through :func:`waiting`: a fixed-size record in a per-rank status file
(``AUTOPAR_STATUS_FILE``, ~10 us per wait) that :mod:`autopar.launch` reads to name the rank
at fault. Each rank also bounds its own waits (``AUTOPAR_COLLECTIVE_TIMEOUT``) with a watchdog
thread, so the timeout holds under ``python -m paddle.distributed.launch`` too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from autopar.errors import AutoparError

STATUS_ENV = "AUTOPAR_STATUS_FILE"
TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
RECORD_BYTES = 512
WATCHDOG_MARGIN = 2.0  # under the launcher, its verdict (which knows every rank) comes first


def collective_timeout() -> float:
    """Seconds a rank may wait (``AUTOPAR_COLLECTIVE_TIMEOUT``, default 120)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise AutoparError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


# ---- the rank's side: where it waits, and its own watchdog ---------------------------------
@dataclass(frozen=True, slots=True)
class Status:
    """A rank's last report. ``seq`` counts the waits it entered; ``state`` is "wait" (inside
    wait ``seq``), "done" (left it) or "failed" (it raised). ``bounded``: the timeout bounds the
    wait by itself (a native step also computes, so it is bounded only while another rank has
    not reached it). ``since``: ``time.monotonic()`` of the change, one clock for the host."""

    seq: int
    state: str
    what: str
    bounded: bool = True
    since: float = 0.0

    def encode(self) -> bytes:
        """A fixed-size record: crc32, then tab-separated fields (a few us: one per wait edge)."""
        what = self.what[:300].replace("\t", " ").replace("\n", " ")
        data = f"{self.seq}\t{self.state}\t{int(self.bounded)}\t{self.since:.6f}\t{what}".encode()[: RECORD_BYTES - 9]
        return (b"%08x " % zlib.crc32(data) + data).ljust(RECORD_BYTES)

    @classmethod
    def decode(cls, record: bytes) -> Status | None:
        """The status in ``record``, or None if there is none yet or the read was torn (the
        launcher reads while the rank writes: the checksum tells)."""
        record = record.rstrip(b" \0")
        try:
            crc, data = int(record[:8], 16), record[9:]
            if zlib.crc32(data) != crc:
                return None
            seq, state, bounded, since, what = data.decode(errors="replace").split("\t", 4)
            return cls(int(seq), state, what, bounded == "1", float(since))
        except ValueError:
            return None


class RankReporter:
    """This process's reports to the launcher and the watchdog on its bounded waits."""

    def __init__(self, rank: int, path: str | None, timeout: float, margin: float = 0.0) -> None:
        self.rank, self.timeout, self.margin, self.seq = rank, timeout, margin, 0
        self._fd = _open_status(path)
        self._armed: tuple[float, str, float] | None = None  # (deadline, what, timeout)
        self._watchdog: threading.Thread | None = None

    @contextlib.contextmanager
    def wait(self, what: str, bounded: bool = True, timeout: float | None = None) -> Iterator[None]:
        """Report wait ``what`` while the body runs; a bounded one ends the process after
        ``timeout`` (the rank's by default) with a line naming the rank and the wait."""
        self.seq += 1
        self._report("wait", what, bounded)
        limit = self.timeout if timeout is None else timeout
        self._arm((time.monotonic() + limit + self.margin, what, limit) if bounded else None)
        try:
            yield
        except BaseException:
            self._armed = None
            self._report("failed", what, bounded)
            raise
        self._armed = None
        self._report("done", what, bounded)

    def _report(self, state: str, what: str, bounded: bool) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, Status(self.seq, state, what, bounded, time.monotonic()).encode(), 0)

    def _arm(self, armed: tuple[float, str, float] | None) -> None:
        self._armed = armed
        if armed is not None and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="autopar-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        """Polls the armed deadline (an attribute write per wait, no lock on the fast path)."""
        while True:
            armed = self._armed
            left = 0.25 if armed is None else armed[0] - time.monotonic()
            if left > 0:
                time.sleep(min(left, 0.25))
            elif self._armed is armed:
                sys.stderr.write(
                    f"autopar: rank {self.rank}: {armed[1]} did not finish within {armed[2]:g} s; stopping\n"
                )
                sys.stderr.flush()
                os._exit(3)


def _open_status(path: str | None) -> int | None:
    """The launcher's status file for this rank (None: no launcher, or the file is gone)."""
    try:
        return os.open(path, os.O_WRONLY) if path else None
    except OSError:
        return None


_REPORTER: RankReporter | None = None


def reporter() -> RankReporter:
    """This process's reporter, made from the environment on first use."""
    global _REPORTER
    if _REPORTER is None:
        path = os.environ.get(STATUS_ENV) or None
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
        _REPORTER = RankReporter(rank, path, collective_timeout(), WATCHDOG_MARGIN if path else 0.0)
    return _REPORTER


def waiting(what: str, bounded: bool = True, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
    """``with waiting("all_reduce over [0, 1]"): ...`` around anything that waits for other ranks."""
    return reporter().wait(what, bounded, timeout)
