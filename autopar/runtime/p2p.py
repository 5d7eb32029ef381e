"""Point-to-point messages between the ranks of a CPU job: the host backend's pipeline
transport (stage: runtime).

A send returns at once (buffered, as the schedule's verifier assumes); a recv takes the
message its sender stamped with the same tag (the collective's key: value, plan step,
micro-batch), the k-th recv of a tag the k-th send of it. Not the k-th message on the link:
the order a rank sends in is not the order its peer receives in when a stage boundary is
crossed several times within a phase (measured: a cut inside a residual block, 1F1B, 2
micro-batches: rank 0 sends the forward of micro-batch 1 before the backward reply of
micro-batch 0, which rank 1 waits for first — a FIFO link gave it micro-batch 1's activation,
silently). The simulator matches by the same rule (:class:`Inbox`).

Measured on gloo and the TCP store: gloo's process-group send blocks until the receiver posts
its recv (1F1B's steady state deadlocks), and every TCP-store request costs ~40 ms (83 ms per
ping-pong of two messages). So each rank listens on a socket; addresses are exchanged once
through the store; a sender writes length-prefixed (tag, array) messages on its connection
(TCP_NODELAY); a thread per incoming connection files them in the rank's :class:`Inbox`, so
sends never wait for the receiver and a recv waits only for its message.
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

_HEADER = struct.Struct("!Q")


class Inbox:
    """Arrived messages by (sender, tag), each a FIFO (one tag is sent again every step).
    Thread-safe: socket reader threads put, the rank's thread takes."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, Hashable], collections.deque] = {}
        self.changed = threading.Condition()

    def put(self, sender: int, tag: Hashable, message: Any) -> None:
        with self.changed:
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
            tag, array = pickle.loads(stream.read(size))
            self.inbox.put(int(sender), tag, array)

    def send(self, receiver: int, array: np.ndarray, tag: Hashable) -> None:
        """Send ``array`` stamped ``tag`` (picklable: it crosses the process) to ``receiver``."""
        conn = self.outgoing.get(receiver)
        if conn is None:
            host, port = bytes(self.store.get(f"autopar/p2p/address/{receiver}")).decode().rsplit(":", 1)
            conn = self.outgoing[receiver] = socket.create_connection((host, int(port)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HEADER.pack(self.rank))
        data = pickle.dumps((tag, np.require(array, requirements="C")), protocol=pickle.HIGHEST_PROTOCOL)
        conn.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, sender: int, tag: Hashable, timeout: float) -> np.ndarray:
        """The next array ``sender`` sent stamped ``tag`` (whatever else arrived before it)."""
        return self.inbox.take(sender, tag, timeout)


_LINKS: Links | None = None  # this process's links, made on first use


def process_links(rank: int, store: Any) -> Links:
    """This process's links (one per process, whichever communicator asks first)."""
    global _LINKS
    if _LINKS is None:
        _LINKS = Links(rank, store)
    return _LINKS


def send_or_recv(rank: int, store: Any, job: Any, x: np.ndarray, timeout: float) -> np.ndarray | None:
    """A pipeline send (returns None at once: buffered) or recv (the sender's array stamped
    with the collective's key: value, micro-batch — not the next message on the link)."""
    from autopar.collective_kinds import kind_of

    sender, receiver = job.group
    links = process_links(rank, store)
    if kind_of(job.kind).sends:
        links.send(receiver, x, job.key)
        return None
    return links.recv(sender, job.key, timeout)
