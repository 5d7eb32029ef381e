"""Point-to-point messages between the ranks of a CPU job: the host backend's pipeline
transport (stage: runtime).

The schedule's verifier assumes buffered FIFO links: a send returns at once, the k-th recv on
a link takes the k-th send. Measured on gloo and the TCP store: gloo's process-group send
blocks until the receiver posts its recv (1F1B's steady state deadlocks), and every TCP-store
request costs ~40 ms (83 ms per ping-pong of two messages). So each rank listens on a socket;
addresses are exchanged once through the store; a sender writes length-prefixed messages on
its connection (TCP_NODELAY); a thread per incoming connection reads them into a queue per
sender, so sends never wait for the receiver and a recv waits only for its message.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import struct
import threading
from typing import Any

import numpy as np

_HEADER = struct.Struct("!Q")


class Links:
    """This rank's outgoing connections and incoming message queues (one per process)."""

    def __init__(self, rank: int, store: Any) -> None:
        self.rank, self.store = rank, store
        # this rank's host as the launcher names it (other nodes connect to it), any free port
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        self.server = socket.create_server((host, 0))
        host, port = self.server.getsockname()
        store.set(f"autopar/p2p/address/{rank}", f"{host}:{port}".encode())
        self.inbox: dict[int, queue.Queue] = {}
        self.outgoing: dict[int, socket.socket] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _queue(self, sender: int) -> queue.Queue:
        with self.lock:
            return self.inbox.setdefault(sender, queue.Queue())

    def _read(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        (sender,) = _HEADER.unpack(stream.read(_HEADER.size))
        inbox = self._queue(int(sender))
        while True:
            head = stream.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return
            (size,) = _HEADER.unpack(head)
            inbox.put(pickle.loads(stream.read(size)))

    def send(self, receiver: int, array: np.ndarray) -> None:
        conn = self.outgoing.get(receiver)
        if conn is None:
            host, port = bytes(self.store.get(f"autopar/p2p/address/{receiver}")).decode().rsplit(":", 1)
            conn = self.outgoing[receiver] = socket.create_connection((host, int(port)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HEADER.pack(self.rank))
        data = pickle.dumps(np.require(array, requirements="C"), protocol=pickle.HIGHEST_PROTOCOL)
        conn.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, sender: int, timeout: float) -> np.ndarray:
        try:
            return self._queue(sender).get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message from rank {sender} within {timeout:.0f} s") from None
