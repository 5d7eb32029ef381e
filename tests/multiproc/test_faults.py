"""The launcher ends a broken job within seconds, naming the rank at fault and where it was.

Each fault runs on the host and the native backend side by side (two 2-rank jobs at once: the
waits overlap, the start-ups share the cores) through ``run_fault`` of
benchmarks/bench_launch_faults.py, which prints the same faults as a table. Rank 1
misbehaves; rank 0 waits for it. The launcher's rules themselves (``judge``) are checked on
hand-made views first, without processes.
"""

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autopar.launch import RankView, Verdict, interrupted, judge
from autopar.rank_status import Status

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0
BACKENDS = ("host", "native")
slow = [pytest.mark.multiproc, pytest.mark.slow]


@functools.cache
def _bench():
    """benchmarks/bench_launch_faults.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_launch_faults", ROOT / "benchmarks" / "bench_launch_faults.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_all(tmp_path, cases, timeout=TIMEOUT):
    """Every (fault, backend) of ``cases`` at once: (fault, backend) -> Outcome."""
    bench = _bench()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {
            case: pool.submit(bench.run_fault, *case, timeout, _dir(tmp_path / "-".join(case))) for case in cases
        }
        return {case: future.result() for case, future in futures.items()}


def both_backends(tmp_path, fault, timeout=TIMEOUT):
    """``fault`` on both backends at once: backend -> Outcome."""
    return {b: outcome for (_, b), outcome in run_all(tmp_path, [(fault, b) for b in BACKENDS], timeout).items()}


def _dir(path):
    path.mkdir()
    return path


def explain(outcome):
    return f"exit {outcome.code} after {outcome.seconds:.1f} s\n{outcome.stdout[-4000:]}"


# ---- the rules, on hand-made views (fast) -------------------------------------------------
def wait(seq, what, since=0.0, bounded=True, state="wait"):
    return Status(seq, state, what, bounded, since)


def test_status_record_round_trips_and_a_torn_read_is_ignored():
    status = wait(7, "all_reduce over [0, 1] of bucket 0", since=12.5, bounded=False)
    assert Status.decode(status.encode()) == status
    torn = status.encode()[:20] + wait(8, "exchange in run()").encode()[20:]
    assert Status.decode(torn) is None
    assert Status.decode(bytes(len(status.encode()))) is None


def test_a_wait_past_the_timeout_names_the_rank_that_never_arrived():
    views = [
        RankView(0, wait(2, "all_reduce over [0, 1]", since=0.0)),
        RankView(1, wait(1, "start-up", state="done", since=1.0)),
    ]
    assert judge(views, now=4.0, timeout=5) is None
    verdict = judge(views, now=6.0, timeout=5)
    assert verdict.code == 124
    assert verdict.message.startswith(
        "rank 0: all_reduce over [0, 1] did not finish within 5 s; rank 1 had not reached it"
    )
    assert "busy for 5 s after start-up" in verdict.message


def test_a_native_step_is_bounded_only_while_a_rank_lags():
    """A step also computes: every rank inside it for long is a long step, not a hang."""
    step = "step 3 of the native program (1 collective: all_reduce over [0, 1])"
    together = [RankView(r, wait(4, step, bounded=False)) for r in range(2)]
    assert judge(together, now=100.0, timeout=5) is None
    behind = [together[0], RankView(1, wait(3, "exchange in run()", state="done"))]
    assert judge(behind, now=100.0, timeout=5).message.startswith(f"rank 0: {step} did not finish within 5 s")


def test_a_clean_exit_that_strands_a_waiting_rank_is_the_cause():
    gone = RankView(1, wait(1, "start-up", state="done"), exit_code=0, exit_time=1.0)
    waiter = RankView(0, wait(2, "all_reduce over [0, 1]", since=1.5))
    assert judge([waiter, gone], now=1.6, timeout=5) == Verdict(
        1, "rank 1 exited early (code 0) while rank 0 waited in all_reduce over [0, 1]; stopped the other ranks"
    )
    finished = RankView(1, wait(2, "all_reduce over [0, 1]", state="done"), exit_code=0, exit_time=1.0)
    assert judge([waiter, finished], now=1.6, timeout=5) is None  # it took part in that wait: no blame


def test_the_rank_that_died_first_outside_a_wait_is_blamed_not_its_waiting_peer():
    """gloo fails the waiting rank when its peer's sockets close, which can be before the
    peer's process is gone: the launcher lets the peer's exit show (SETTLE) and blames it."""
    waiter = RankView(0, wait(2, "all_reduce over [0, 1]", state="failed"), exit_code=1, exit_time=10.0)
    peer = RankView(1, wait(1, "start-up", state="done"))
    assert judge([waiter, peer], now=10.2, timeout=5) is None
    dead = RankView(1, peer.status, exit_code=-9, exit_time=10.3)
    verdict = judge([waiter, dead], now=10.4, timeout=5)
    assert verdict == Verdict(137, "rank 1 was killed by SIGKILL after start-up; stopped the other ranks")


def test_success_and_interruption():
    done = [
        RankView(r, wait(3, "exchange in parameters()", state="done"), exit_code=0, exit_time=1.0) for r in range(2)
    ]
    assert judge(done, now=2.0, timeout=5) == Verdict(0)
    running = [RankView(0, wait(2, "all_reduce over [0, 1]")), RankView(1)]
    assert interrupted(signal.SIGINT, running) == Verdict(
        130,
        "interrupted by SIGINT; stopped rank 0 (in all_reduce over [0, 1]), rank 1 (before autopar.Executor start-up)",
    )


# ---- real jobs -----------------------------------------------------------------------------
COLLECTIVE = {"host": "all_reduce over [0, 1] of ", "native": "step 1 of the native program ("}


@pytest.mark.parametrize(
    "fault, code, expected",
    [
        ("raise", 1, ["rank 1 exited with code 1 after exchange in run_startup()"]),
        ("sigkill-rank", 137, ["rank 1 was killed by SIGKILL after exchange in run_startup()"]),
        ("exit0", 1, ["rank 1 exited early (code 0) while rank 0 waited in {collective}"]),
        (
            "hang-before-executor",
            124,
            ["rank 0: start-up (joining the job's TCP store at 127.0.0.1:", f"did not finish within {TIMEOUT:g} s",
             "rank 1 had not reached it (still before autopar.Executor start-up)"],
        ),
        (
            "hang-collective",
            124,
            ["rank 0: {collective}", f"did not finish within {TIMEOUT:g} s; rank 1 had not reached it (busy for",
             "after exchange in run_startup()"],
        ),
        (
            "hang-exchange",
            124,
            [f"rank 0: exchange in parameters() did not finish within {TIMEOUT:g} s; rank 1 had not reached it (busy for"],
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
@pytest.mark.multiproc
@pytest.mark.slow
def test_a_fault_stops_the_job_naming_the_rank_and_where(tmp_path, fault, code, expected):
    for backend, outcome in both_backends(tmp_path, fault).items():
        line = outcome.first_line
        assert outcome.code == code, f"{backend}: {explain(outcome)}"
        for fragment in expected:
            assert fragment.format(collective=COLLECTIVE[backend]) in line, f"{backend}: {line}\n{explain(outcome)}"
        assert len(outcome.launcher_lines) == 1, explain(outcome)
        assert outcome.survivors == [], f"{backend}: ranks {outcome.survivors} outlived the launcher"
        assert outcome.seconds < 45, f"{backend}: {explain(outcome)}"


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigint_or_sigterm_to_the_launcher_stops_every_rank_with_one_line(tmp_path):
    """While rank 0 waits in a collective. No Paddle FatalError block from the stopped ranks
    (their output after the stop is dropped). The four jobs run at once (--timeout 60)."""
    outcomes = run_all(tmp_path, [(name, b) for name in ("sigint", "sigterm") for b in BACKENDS])
    for (name, backend), outcome in outcomes.items():
        number = signal.Signals[name.upper()]
        assert outcome.code == 128 + number, f"{name} {backend}: {explain(outcome)}"
        assert outcome.launcher_lines == [outcome.first_line], explain(outcome)
        expected = f"autopar.launch: interrupted by {name.upper()}; stopped rank 0 (in {COLLECTIVE[backend]}"
        assert outcome.first_line.startswith(expected), outcome.first_line
        assert "rank 1 (after exchange in run_startup())" in outcome.first_line, outcome.first_line
        assert "FatalError" not in outcome.stdout and "Termination signal" not in outcome.stdout, explain(outcome)
        assert outcome.survivors == [], f"{name} {backend}: ranks {outcome.survivors} outlived the launcher"


@pytest.mark.multiproc
@pytest.mark.slow
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    for backend, outcome in both_backends(tmp_path, "sigkill-launcher").items():
        assert outcome.code == -signal.SIGKILL, f"{backend}: {explain(outcome)}"
        assert outcome.survivors == [], f"{backend}: ranks {outcome.survivors} outlived the SIGKILLed launcher"


def _under_paddle_launch(workdir, fault, backend):
    """The fault script under ``python -m paddle.distributed.launch`` (no autopar launcher)."""
    script = workdir / "rank_script.py"
    script.write_text(_bench().RANK_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(workdir / "log"),
    ]
    env = dict(os.environ, PADDLE_DISTRI_BACKEND="gloo", AUTOPAR_COLLECTIVE_TIMEOUT=str(TIMEOUT))
    start = time.monotonic()
    result = subprocess.run(
        [*cmd, str(script), fault, backend], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    return result, time.monotonic() - start, (workdir / "log" / "workerlog.0").read_text()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_rank_bounds_its_own_waits_under_paddles_launcher(tmp_path):
    """No autopar launcher to judge: rank 0's watchdog ends its exchange after the timeout."""
    with ThreadPoolExecutor(len(BACKENDS)) as pool:
        runs = {b: pool.submit(_under_paddle_launch, _dir(tmp_path / b), "hang_exchange", b) for b in BACKENDS}
        for backend, run in runs.items():
            result, seconds, log = run.result()
            assert result.returncode == 3, f"{backend}: {result.stdout[-3000:]}"
            assert f"autopar: rank 0: exchange in parameters() did not finish within {TIMEOUT:g} s; stopping" in log, (
                log[-3000:]
            )
            assert seconds < 60, f"{backend}: {seconds:.0f} s"
