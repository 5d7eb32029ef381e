"""Point-to-point messages between the ranks of a CPU job: the host backend's pipeline
transport (stage: runtime).

A send returns at once (buffered, as the schedule's verifier assumes); a pipeline recv takes
the *next* message on its link (sender -> receiver), in the order it was sent, as NCCL's send /
recv do, and checks that it is the transfer its RECV action names (:func:`check_message`: a
check, not a search: a message of another key is an error naming both keys, the link and the
RECV). The compiler put every rank's recvs in link order and verified them so
(:meth:`autopar.rank_plan.RankPlan.in_link_order`): a stage boundary crossed several times
within a phase (a cut inside a residual block, 1F1B) is received in the order it is sent. The
simulator takes messages by the same rule (:class:`Inbox`).

A stage's own collectives among its ranks (``gloo.py``'s group exchange) share the links and
are matched by key instead (:meth:`Links.recv`): every member sends before it receives, so
their order on the link says nothing.

Measured on gloo and the TCP store: gloo's process-group send blocks until the receiver posts
its recv (1F1B's steady state deadlocks), and every TCP-store request costs ~40 ms (83 ms per
ping-pong of two messages). So each rank listens on a socket; addresses are exchanged once
through the store; a sender writes length-prefixed (tag, array, in order) messages on its
connection (TCP_NODELAY); a thread per incoming connection files them in the rank's
:class:`Inbox`, so sends never wait for the receiver and a recv waits only for its message.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from autopar.errors import AutoparError

_HEADER = struct.Struct("!Q")


class Inbox:
    """Arrived messages: pipeline transfers per link in arrival order (``ordered``), a stage's
    group exchanges by (sender, tag), each a FIFO (one tag is sent again every step).
    Thread-safe: socket reader threads put, the rank's thread takes."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, Hashable], collections.deque] = {}
        self.links: dict[int, collections.deque] = {}  # sender -> (tag, message) in the order sent
        self.changed = threading.Condition()

    def put(self, sender: int, tag: Hashable, message: Any, ordered: bool = False) -> None:
        with self.changed:
            if ordered:
                self.links.setdefault(sender, collections.deque()).append((tag, message))
            else:
                self.messages.setdefault((sender, tag), collections.deque()).append(message)
            self.changed.notify_all()

    def ready(self, sender: int, tag: Hashable) -> bool:
        with self.changed:
            return bool(self.messages.get((sender, tag)))

    def take(self, sender: int, tag: Hashable, timeout: float) -> Any:
        """The oldest message from ``sender`` stamped ``tag``; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self.messages.get((sender, tag)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no message {tag} from rank {sender} within {timeout:.0f} s")
                self.changed.wait(left)
            found = self.messages[(sender, tag)]
            message = found.popleft()
            if not found:
                del self.messages[(sender, tag)]  # tags are many (per micro-batch): keep the dict small
            return message

    def arrived(self, sender: int) -> bool:
        """Whether a pipeline message from ``sender`` waits on its link."""
        with self.changed:
            return bool(self.links.get(sender))

    def next(self, sender: int, timeout: float) -> tuple[Hashable, Any]:
        """The next pipeline message on the link from ``sender`` as (tag, message), whatever
        its tag; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self.links.get(sender):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no message on the link from rank {sender} within {timeout:.0f} s")
                self.changed.wait(left)
            return self.links[sender].popleft()


def check_message(job: Any, tag: Hashable) -> None:
    """Refuse the next message on a link when it is not the one the RECV ``job`` (a recv
    collective, stamped with its micro-batch) waits for: the ranks' schedules disagree on the
    link's order, which the compiler's link order (verified) rules out."""
    if tag == job.key:
        return
    sender, receiver = job.group
    raise AutoparError(
        f"rank {receiver}: RECV[{job.value or job.key} mb{job.key.micro_batch} {sender}->{receiver}] waits for the "
        f"message of key {job.key}, but the next message on link rank {sender} -> rank {receiver} has key {tag}: "
        "the ranks' schedules take this link in different orders (rank plans put in link order at compile agree)"
    )


class Links:
    """This rank's outgoing connections and its inbox of arrived messages (one per process)."""

    def __init__(self, rank: int, store: Any) -> None:
        self.rank, self.store = rank, store
        # this rank's host as the launcher names it (other nodes connect to it), any free port
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        self.server = socket.create_server((host, 0))
        host, port = self.server.getsockname()
        store.set(f"autopar/p2p/address/{rank}", f"{host}:{port}".encode())
        self.inbox = Inbox()
        self.outgoing: dict[int, socket.socket] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        (sender,) = _HEADER.unpack(stream.read(_HEADER.size))
        while True:
            head = stream.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return
            (size,) = _HEADER.unpack(head)
            tag, array, ordered = pickle.loads(stream.read(size))
            self.inbox.put(int(sender), tag, array, ordered)

    def send(self, receiver: int, array: np.ndarray, tag: Hashable, ordered: bool = False) -> None:
        """Send ``array`` stamped ``tag`` (picklable: it crosses the process) to ``receiver``;
        ``ordered``: a pipeline transfer, taken in link order (:meth:`recv_next`)."""
        conn = self.outgoing.get(receiver)
        if conn is None:
            host, port = bytes(self.store.get(f"autopar/p2p/address/{receiver}")).decode().rsplit(":", 1)
            conn = self.outgoing[receiver] = socket.create_connection((host, int(port)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HEADER.pack(self.rank))
        data = pickle.dumps((tag, np.require(array, requirements="C"), ordered), protocol=pickle.HIGHEST_PROTOCOL)
        conn.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, sender: int, tag: Hashable, timeout: float) -> np.ndarray:
        """The next array ``sender`` sent stamped ``tag`` (a group exchange: whatever else
        arrived before it)."""
        return self.inbox.take(sender, tag, timeout)

    def recv_next(self, job: Any, timeout: float) -> np.ndarray:
        """The next pipeline message on the link of the recv ``job``, which must be its
        transfer (:func:`check_message`)."""
        tag, array = self.inbox.next(job.group[0], timeout)
        check_message(job, tag)
        return array


_LINKS: Links | None = None  # this process's links, made on first use


def process_links(rank: int, store: Any) -> Links:
    """This process's links (one per process, whichever communicator asks first)."""
    global _LINKS
    if _LINKS is None:
        _LINKS = Links(rank, store)
    return _LINKS


def send_or_recv(rank: int, store: Any, job: Any, x: np.ndarray, timeout: float) -> np.ndarray | None:
    """A pipeline send (returns None at once: buffered) or recv (the next message on the link,
    checked to be the one stamped with the collective's key: value, micro-batch)."""
    from autopar.collective_kinds import kind_of

    links = process_links(rank, store)
    if kind_of(job.kind).sends:
        links.send(job.group[1], x, job.key, ordered=True)
        return None
    return links.recv_next(job, timeout)
