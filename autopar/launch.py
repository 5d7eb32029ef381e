"""``python -m autopar.launch --nproc N [--timeout S] script.py [args...]``: one process per rank.

Each process gets the PADDLE_* variables Paddle's own launcher sets (trainer id, count,
endpoints, master) with free local ports, and gloo as the CPU backend. Output lines are
prefixed ``[rank r]``. The job ends with one ``autopar.launch:`` line naming the rank at fault
and where it was when

- a rank exits non-zero or is killed (exit code: the rank's, or 128 + the signal);
- a rank exits 0 while another waits for it in a wait it never reached (exit code 1);
- a rank waits longer than ``--timeout`` (default ``$AUTOPAR_COLLECTIVE_TIMEOUT`` or 120 s) in
  start-up, a collective or an exchange; the line names the ranks that never arrived and what
  they did instead (exit code 124). A native-backend step runs its collectives inside gloo,
  where Python cannot interrupt it: it is bounded while another rank has not reached it, and
  gloo itself gives up on a collective after its fixed 30 s;
- the launcher gets SIGINT / SIGTERM (exit code 130 / 143).
The running ranks are then stopped as process groups (SIGTERM, SIGKILL after a grace period)
and their output from then on is dropped (Paddle answers SIGTERM with a FatalError block).
Ranks die with the launcher even when it is SIGKILLed (Linux: PR_SET_PDEATHSIG).

The launcher knows where each rank is because the runtime reports every wait through
:func:`autopar.rank_status.waiting`: a fixed-size record in a per-rank status file
(``AUTOPAR_STATUS_FILE``; ~10 us per wait, cheap beside a collective). Every rank meets
the same waits in the same order (start-up, each collective, each exchange, each native
step), so a rank whose count is behind has not reached the wait another rank is stuck in.
Each rank also bounds its own waits (``AUTOPAR_COLLECTIVE_TIMEOUT``) with a watchdog thread,
so the timeout holds under ``python -m paddle.distributed.launch`` too, wherever Python can
run (gloo, the TCP store and the executor release the GIL; Paddle's store creation does not).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.rank_status import (
    DEFAULT_TIMEOUT,
    RECORD_BYTES,
    STATUS_ENV,
    TIMEOUT_ENV,
    Status,
    collective_timeout,
)

SETTLE = 1.0  # a rank failing inside a wait may be the echo of a peer that is still exiting
EXIT_EARLY, EXIT_TIMEOUT = 1, 124
PR_SET_PDEATHSIG = 1


# ---- the launcher's judgement: pure functions of what it sees ------------------------------
@dataclass(frozen=True, slots=True)
class RankView:
    """One rank as the launcher sees it: its last report (None: none yet, so it has not
    reached autopar.Executor's start-up) and its exit (code None while it runs; negative:
    killed by that signal)."""

    rank: int
    status: Status | None = None
    exit_code: int | None = None
    exit_time: float | None = None

    @property
    def seq(self) -> int:
        return self.status.seq if self.status is not None else 0

    @property
    def in_wait(self) -> bool:
        return self.status is not None and self.status.state in ("wait", "failed")


@dataclass(frozen=True, slots=True)
class Verdict:
    """How the job ends: the launcher's exit code and its one line (empty on success)."""

    code: int
    message: str = ""


def judge(views: Sequence[RankView], now: float, timeout: float) -> Verdict | None:
    """The launcher's rules, in order: a failed rank ends the job; so does a clean exit that
    leaves another rank waiting for it; so does a wait past the timeout; every rank done
    cleanly is success; otherwise keep going (None)."""
    failed = [v for v in views if v.exit_code not in (None, 0)]
    if failed:
        culprit = _culprit(failed)
        if culprit.in_wait and now - culprit.exit_time < SETTLE and any(v.exit_code is None for v in views):
            return None  # it may have failed because a peer died: let that peer's exit show
        return _early_exit(views, [culprit]) or _failure(culprit, views, now)
    waiters = [v for v in views if v.exit_code is None and v.status is not None and v.status.state == "wait"]
    verdict = _early_exit(views, waiters) or _stall(views, now, timeout)
    if verdict is None and all(v.exit_code == 0 for v in views):
        return Verdict(0)
    return verdict


def _culprit(failed: Sequence[RankView]) -> RankView:
    """The failure that came first, but a rank failing inside a wait just after another rank
    died failed because of it (gloo reports the closed connection): the other is blamed."""
    ordered = sorted(failed, key=lambda v: v.exit_time or 0.0)
    first = ordered[0]
    if first.in_wait:
        for view in ordered[1:]:
            if not view.in_wait and (view.exit_time or 0.0) - (first.exit_time or 0.0) < SETTLE:
                return view
    return first


def _early_exit(views: Sequence[RankView], waiters: Sequence[RankView]) -> Verdict | None:
    """A rank that exited 0 before reaching the wait another rank is in: that wait cannot end."""
    clean = sorted((v for v in views if v.exit_code == 0), key=lambda v: v.exit_time or 0.0)
    for waiter in waiters:
        if not waiter.in_wait:
            continue
        for gone in clean:
            if gone.seq < waiter.seq:
                return Verdict(
                    EXIT_EARLY,
                    f"rank {gone.rank} exited early (code 0) while rank {waiter.rank} waited in "
                    f"{waiter.status.what}; stopped the other ranks",
                )
    return None


def _failure(culprit: RankView, views: Sequence[RankView], now: float) -> Verdict:
    code = culprit.exit_code or 1
    how = f"exited with code {code}" if code > 0 else f"was killed by {_signal_name(-code)}"
    message = f"rank {culprit.rank} {how} {_where(culprit.status)}"
    late = _laggards(culprit, views, now) if culprit.in_wait else ""
    message += f"; {late}" if late else ""
    return Verdict(code if code > 0 else 128 - code, message + "; stopped the other ranks")


def _stall(views: Sequence[RankView], now: float, timeout: float) -> Verdict | None:
    """The longest wait past ``timeout`` that a late rank explains (or that is bounded alone)."""
    stuck = [v for v in views if v.exit_code is None and v.status is not None and v.status.state == "wait"]
    for view in sorted(stuck, key=lambda v: v.status.since):
        if now - view.status.since <= timeout:
            break
        late = _laggards(view, views, now)
        if late or view.status.bounded:
            cause = late or "every rank reached it"
            return Verdict(
                EXIT_TIMEOUT,
                f"rank {view.rank}: {view.status.what} did not finish within {timeout:g} s; {cause}; stopped all ranks",
            )
    return None


def _laggards(waiter: RankView, views: Sequence[RankView], now: float) -> str:
    """What the ranks that have not reached ``waiter``'s wait do instead (three named at most)."""
    late = [v for v in views if v.rank != waiter.rank and v.seq < waiter.seq]
    named = "; ".join(f"rank {v.rank} had not reached it ({_doing(v, now)})" for v in late[:3])
    return named + (f"; {len(late) - 3} more ranks had not reached it" if len(late) > 3 else "")


def _where(status: Status | None) -> str:
    if status is None:
        return "before autopar.Executor start-up"
    return f"{'in' if status.state in ('wait', 'failed') else 'after'} {status.what}"


def _doing(view: RankView, now: float) -> str:
    status = view.status
    if view.exit_code is not None:
        return f"exited with code {view.exit_code} {_where(status)}"
    if status is None:
        return "still before autopar.Executor start-up"
    age = now - status.since
    if status.state == "wait":
        return f"waiting {age:.0f} s in {status.what}"
    if status.state == "failed":
        return f"failing in {status.what}"
    return f"busy for {age:.0f} s after {status.what}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def interrupted(number: int, views: Sequence[RankView]) -> Verdict:
    """The launcher got SIGINT / SIGTERM: say which ranks it stops and where they were."""
    running = [f"rank {v.rank} ({_where(v.status)})" for v in views if v.exit_code is None]
    stopped = ", ".join(running[:4]) + (f" and {len(running) - 4} more" if len(running) > 4 else "")
    return Verdict(128 + number, f"interrupted by {_signal_name(number)}; stopped {stopped or 'no running rank'}")


# ---- the launcher's processes ---------------------------------------------------------------
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


def rank_environment(rank: int, nproc: int, ports: Sequence[int], timeout: float | None, verbose: bool = False) -> dict[str, str]:
    """The rank's environment: the launcher's, the ``PADDLE_*`` variables, and Paddle's C++ log
    kept to errors (``GLOG_minloglevel=2``: no "New Executor is Running", tcp_store or
    "not support input out tensor" lines, several per rank) unless the user set ``GLOG_v`` /
    ``GLOG_minloglevel`` themselves; ``verbose``: ``GLOG_minloglevel=0``, glog's default, which
    also tells the Executor to leave the level alone (:mod:`autopar.runtime.paddle_log`)."""
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
        env[TIMEOUT_ENV] = str(timeout)
    if not {"GLOG_v", "GLOG_minloglevel"} & set(os.environ):
        env["GLOG_minloglevel"] = "0" if verbose else "2"  # 0 (glog's default) also tells the Executor to leave it
    return env


def _die_with_launcher() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGKILL the rank when the launcher dies, even by a
    SIGKILL no handler sees (Linux PR_SET_PDEATHSIG; None elsewhere). prctl is looked up here,
    before fork: the child only calls it. The signal follows the thread that forked, so
    launch() must not return before its ranks end (it does not)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


class _Job:
    """The ranks' processes, their output pumps, exit times and status files."""

    def __init__(self, command: Sequence[str], nproc: int, timeout: float, out, verbose: bool = False) -> None:
        self.command, self.nproc, self.timeout, self.out, self.verbose = list(command), nproc, timeout, out, verbose
        self.dir = tempfile.mkdtemp(prefix="autopar-launch-")
        self.procs: list[subprocess.Popen] = []
        self.fds: list[int] = []
        self.status: list[Status | None] = [None] * nproc
        self.exits: dict[int, tuple[int, float]] = {}
        self.muted = [threading.Event() for _ in range(nproc)]
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()

    def start(self) -> None:
        ports = free_ports(self.nproc + 1)
        hook = _die_with_launcher()
        for rank in range(self.nproc):
            path = os.path.join(self.dir, f"rank{rank}")
            with open(path, "wb") as f:
                f.write(bytes(RECORD_BYTES))
            self.fds.append(os.open(path, os.O_RDONLY))
            env = rank_environment(rank, self.nproc, ports, self.timeout, self.verbose)
            env[STATUS_ENV] = path
            self.procs.append(subprocess.Popen(
                self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=hook,
            ))  # fmt: skip
        for rank, proc in enumerate(self.procs):  # threads only after the forks: preexec_fn and threads do not mix
            self.pumps.append(self._thread(self._pump, rank, proc))
            self._thread(self._wait, rank, proc)

    def _thread(self, target: Callable, rank: int, proc: subprocess.Popen) -> threading.Thread:
        thread = threading.Thread(target=target, args=(rank, proc), daemon=True)
        thread.start()
        return thread

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        for line in iter(proc.stdout.readline, b""):
            if not self.muted[rank].is_set():
                with self.lock:
                    self.out.write(f"[rank {rank}] {line.decode(errors='replace')}")
                    self.out.flush()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.exits[rank] = (code, time.monotonic())

    def views(self) -> list[RankView]:
        """Every rank now; exits are read before reports, so an exited rank's report is final."""
        exits = dict(self.exits)
        for rank, fd in enumerate(self.fds):
            status = Status.decode(os.pread(fd, RECORD_BYTES, 0))
            if status is not None:  # else nothing yet, or a torn read: keep the last one
                self.status[rank] = status
        return [RankView(r, self.status[r], *exits.get(r, (None, None))) for r in range(len(self.fds))]

    def stop(self, grace: float) -> None:
        """SIGTERM to each running rank's process group, SIGKILL after ``grace``. Their output
        from then on is dropped: Paddle prints a FatalError block on SIGTERM."""
        running = [(rank, proc) for rank, proc in enumerate(self.procs) if rank not in self.exits]
        if not running:
            return
        time.sleep(0.1)  # let the pumps print what the ranks wrote before the stop
        for rank, proc in running:
            self.muted[rank].set()
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for _, proc in running:
            if proc.returncode is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=2.0)
        for fd in self.fds:
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, number)


def _catch_signals(caught: list[int]) -> dict[int, object]:
    """SIGINT / SIGTERM only note the signal: the supervising loop stops the ranks."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        sig: signal.signal(sig, lambda number, frame: caught.append(number)) for sig in (signal.SIGINT, signal.SIGTERM)
    }


def _supervise(job: _Job, timeout: float, caught: list[int]) -> Verdict:
    while True:
        views = job.views()
        verdict = interrupted(caught[0], views) if caught else judge(views, time.monotonic(), timeout)
        if verdict is not None:
            return verdict
        time.sleep(0.1)


def launch(
    command: Sequence[str], nproc: int, timeout: float | None = None, grace: float = 3.0, out=None, verbose: bool = False
) -> int:  # fmt: skip
    """Run ``command`` (argv) as ``nproc`` ranks; 0 only if every rank succeeds (the other exit
    codes: see the module docstring). ``timeout``: seconds any rank may wait for the others;
    ``verbose``: Paddle's own log lines too (:func:`rank_environment`)."""
    out = out or sys.stdout
    limit = collective_timeout() if timeout is None else float(timeout)
    if not limit > 0:
        raise AutoparError(f"timeout must be a positive number of seconds, got {timeout!r}")
    job = _Job(command, nproc, limit, out, verbose)
    caught: list[int] = []
    previous = _catch_signals(caught)
    try:
        job.start()
        verdict = _supervise(job, limit, caught)
    finally:
        job.stop(grace)
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if verdict.message:
        out.write(f"autopar.launch: {verdict.message}\n")
        out.flush()
    return verdict.code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (processes) to start")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help=f"seconds a rank may wait for the others (start-up, collectives, exchanges) before the job "
        f"is stopped (default: ${TIMEOUT_ENV} or {DEFAULT_TIMEOUT:g})",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", action="store_true",
        help="show Paddle's own log lines (kept to errors by default, unless GLOG_v / GLOG_minloglevel is set)",
    )  # fmt: skip
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be a positive number of seconds")
    try:
        timeout = collective_timeout() if args.timeout is None else args.timeout
    except AutoparError as err:
        parser.error(str(err))
    return launch([sys.executable, args.script, *args.args], args.nproc, timeout, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
