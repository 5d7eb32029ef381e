"""``python -m autopar.launch --nproc N script.py [args...]``: one process per rank.

Each process gets the PADDLE_* variables Paddle's own launcher sets (trainer id, count,
endpoints, master) with free local ports, and gloo as the CPU backend. Output lines are
prefixed ``[rank r]``. If a rank exits non-zero, the others are stopped within seconds and
the launcher exits non-zero naming the rank; Ctrl-C / SIGTERM stop every rank; no process
outlives the launcher (each rank runs in its own process group, killed as a group).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def rank_environment(rank: int, nproc: int, ports: Sequence[int], timeout: float | None) -> dict[str, str]:
    endpoints = [f"127.0.0.1:{p}" for p in ports[1:]]
    env = dict(os.environ)
    env.update(
        PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(nproc), PADDLE_RANK_IN_NODE=str(rank),
        PADDLE_TRAINER_ENDPOINTS=",".join(endpoints), PADDLE_CURRENT_ENDPOINT=endpoints[rank],
        PADDLE_MASTER=f"127.0.0.1:{ports[0]}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]),
        PADDLE_DISTRI_BACKEND="gloo", PADDLE_GLOBAL_SIZE=str(nproc), PADDLE_LOCAL_SIZE=str(nproc),
        RANK=str(rank), WORLD_SIZE=str(nproc), PYTHONUNBUFFERED="1",
    )  # fmt: skip
    if timeout is not None:
        env["AUTOPAR_COLLECTIVE_TIMEOUT"] = str(timeout)
    return env


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[rank {rank}] {line.decode(errors='replace')}")
        out.flush()


def launch(command: Sequence[str], nproc: int, timeout: float | None = None, grace: float = 3.0, out=None) -> int:
    """Run ``command`` (argv) as ``nproc`` ranks; return 0 only if every rank succeeds."""
    out = out or sys.stdout
    ports = free_ports(nproc + 1)
    procs: list[subprocess.Popen] = []
    pumps = []
    for rank in range(nproc):
        proc = subprocess.Popen(
            list(command), env=rank_environment(rank, nproc, ports, timeout),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(rank, proc.stdout, out), daemon=True)
        pump.start()
        pumps.append(pump)
        if rank == 0:
            time.sleep(0.3)  # let rank 0 open the TCP store: later ranks otherwise retry slowly

    def stop_all(*_: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        for proc in procs:
            with _quiet():
                proc.wait(max(0.0, deadline - time.time()))
        for proc in procs:
            if proc.poll() is None:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    previous = {sig: signal.signal(sig, lambda *a: (stop_all(), sys.exit(130))) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, proc in enumerate(procs):
                code = proc.poll()
                if code not in (None, 0) and failed is None:
                    failed = (rank, code)
            if failed is not None:
                break
            time.sleep(0.1)
        if failed is None:
            failed = next(((r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0), None)
    finally:
        stop_all()
        for pump in pumps:
            pump.join(timeout=1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is not None:
        rank, code = failed
        out.write(f"autopar.launch: rank {rank} exited with code {code}; stopped the other ranks\n")
        out.flush()
        return code if code > 0 else 1
    return 0


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, subprocess.TimeoutExpired, PermissionError))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (processes) to start")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a stuck collective stops its rank")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return launch([sys.executable, args.script, *args.args], args.nproc, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
