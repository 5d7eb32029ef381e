"""Real processes: examples equal serial under the launcher; failures are clean and fast; the
same scripts run under ``python -m paddle.distributed.launch`` (one node, and two "nodes" on
127.0.0.1). tests/multiproc/test_faults.py has every fault on both backends.

Each case starts 2-4 processes (``import paddle`` ~1.5 s each on this machine).
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autopar.launch import free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def launch(nproc, *args, timeout=240, extra=()):
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", str(nproc), *extra, *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_equal_serial(result, nproc):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "max |loss - serial|" in line]
    assert len(lines) == nproc, result.stdout[-3000:]


@pytest.mark.parametrize(
    "nproc, args",
    [
        (2, ["examples/simple_net.py", "--mode", "dp", "--backend", "host"]),
        (2, ["examples/simple_net.py", "--mode", "mp", "--backend", "host"]),
        (4, ["examples/simple_net.py", "--mode", "dp_mp", "--backend", "host"]),
        (2, ["examples/simple_net.py", "--mode", "mp", "--backend", "native"]),
        (2, ["examples/alexnet.py", "--ranks", "2"]),
        (4, ["examples/alexnet.py", "--ranks", "4"]),
        (2, ["examples/linear_net.py"]),
        (2, ["examples/gpt_block.py", "--mode", "mp"]),
    ],
    ids=["simple-dp2-host", "simple-mp2-host", "simple-dp2xmp2-host", "simple-mp2-native",
         "alexnet-2", "alexnet-2x2", "linear-adam-dp2", "gpt-megatron-mp2"],
)  # fmt: skip
def test_examples_equal_serial(nproc, args):
    """(simple_net dp on 2 native processes is test_paddles_own_log_lines_are_shown_only_when_asked's
    quiet run: the same command, checked equal to serial there.)"""
    assert_equal_serial(launch(nproc, *args), nproc)


def write(tmp_path, body):
    """A script that can import the examples (the project root on its path)."""
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(body))
    return script


def test_every_collective_kind_equal_serial(tmp_path):
    """reduce_scatter, all_to_all, all_reduce, all_gather in real processes; on native the
    lowering turns reduce_scatter into all_reduce + slice and all_to_all into all_gather + slice.
    Both backends in one launch (host first), each rank printing one line per backend."""
    script = write(
        tmp_path,
        """
        import sys, warnings
        warnings.filterwarnings("ignore")
        from autopar.testing.compare import train_and_compare
        from autopar.testing.models import reshard_chain
        for backend in sys.argv[1:]:
            net, dist = reshard_chain(2)
            train_and_compare(net, dist, steps=5, backend=backend, label="reshard chain")
        """,
    )
    result = launch(2, script, "host", "native")
    assert_equal_serial(result, 2 * 2)
    for backend in ("host", "native"):
        assert result.stdout.count(f"({backend} backend): max |loss - serial|") == 2, result.stdout[-3000:]


def test_a_crashing_rank_stops_the_others_quickly(tmp_path):
    script = write(
        tmp_path,
        """
        import os, sys, time
        rank = int(os.environ["PADDLE_TRAINER_ID"])
        with open(os.path.join(os.path.dirname(__file__), f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        if rank == 1:
            time.sleep(0.5)
            sys.exit(7)
        time.sleep(120)
        """,
    )
    start = time.time()
    result = launch(3, script, timeout=60)
    assert result.returncode == 7
    assert time.time() - start < 15
    assert "rank 1 exited with code 7" in result.stdout
    for rank in range(3):
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], (
            f"rank {rank} orphaned"
        )


def test_a_stuck_collective_times_out_naming_rank_and_op(tmp_path):
    script = write(
        tmp_path,
        """
        import os, warnings
        warnings.filterwarnings("ignore")
        from examples.simple_net import build
        import autopar
        net, dist = build("dp")
        exe = autopar.Executor(dist, backend="host")
        exe.run_startup()
        if exe.rank == 0:
            import time; time.sleep(60)  # rank 0 never joins the gradient all_reduce
        from autopar.testing.serial import random_feeds
        exe.run(random_feeds(net.feeds, 1)[0], fetch_list=[net.loss])
        """,
    )
    start = time.time()
    result = launch(2, script, timeout=120, extra=["--timeout", "8"])
    assert result.returncode != 0
    assert time.time() - start < 60
    assert "rank 1:" in result.stdout and "did not finish within 8 s" in result.stdout, result.stdout[-2000:]


def test_mesh_larger_than_nproc_is_refused(tmp_path):
    script = write(
        tmp_path,
        """
        import sys, warnings
        warnings.filterwarnings("ignore")
        from examples.simple_net import build
        import autopar
        net, dist = build("dp_mp")
        try:
            autopar.Executor(dist)
        except autopar.AutoparError as err:
            print("refused:", err)
            sys.exit(3)
        """,
    )
    result = launch(2, script, timeout=60)
    assert result.returncode == 3
    assert "needs 4 processes, only 2 were started" in result.stdout


# ---- the same scripts under Paddle's own launcher ---------------------------------------------
def paddle_launch(log_dir, *args):
    """``python -m paddle.distributed.launch`` with gloo, logs in ``log_dir``, not yet waited for."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(log_dir), *map(str, args)]
    env = dict(os.environ, PADDLE_DISTRI_BACKEND="gloo")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def results(log_dir):
    return [
        line
        for log in sorted(Path(log_dir).glob("workerlog.*"))
        for line in log.read_text().splitlines()
        if "max |loss - serial|" in line
    ]


def test_example_runs_under_paddles_launcher(tmp_path):
    """One node, two processes (auto picks the host backend: its collectives go through shared
    memory on one node)."""
    proc = paddle_launch(tmp_path, "--nproc_per_node", 2, "examples/simple_net.py", "--mode", "dp")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    lines = results(tmp_path)
    assert sorted(line.split()[1] for line in lines) == ["0", "1"], out[-3000:]
    assert all("(host backend)" in line for line in lines)


def test_example_runs_as_two_nodes_on_one_host(tmp_path):
    """Two launches, one per "node" (``--nnodes 2 --rank r``, the master on 127.0.0.1), host backend."""
    master = f"127.0.0.1:{free_ports(1)[0]}"
    args = [
        "--master",
        master,
        "--nnodes",
        2,
        "--nproc_per_node",
        1,
        "examples/simple_net.py",
        "--mode",
        "dp",
        "--backend",
        "host",
    ]
    procs = [paddle_launch(tmp_path / f"node{r}", "--rank", r, *args) for r in range(2)]
    outs = [proc.communicate(timeout=240)[0] for proc in procs]
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-3000:]
    lines = results(tmp_path / "node0") + results(tmp_path / "node1")
    assert sorted(line.split()[1] for line in lines) == ["0", "1"], outs[0][-2000:] + outs[1][-2000:]
    assert all("(host backend)" in line for line in lines)


def test_paddles_own_log_lines_are_shown_only_when_asked():
    """A two-rank example prints no Paddle (glog) line by default — "New Executor is Running",
    tcp_store, "not support input out tensor" — and shows them with --verbose (issue 36, item 3)."""
    import re

    glog = re.compile(r"^\[rank \d+\] [IWEF]\d{4} \d\d:\d\d:\d\d")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")}
    args = ["examples/simple_net.py", "--mode", "dp", "--backend", "native"]
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2"]
    quiet = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert_equal_serial(quiet, 2)
    assert not [line for line in quiet.stdout.splitlines() if glog.match(line)], quiet.stdout[-3000:]
    loud = subprocess.run([*cmd, "--verbose", *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert_equal_serial(loud, 2)
    assert [line for line in loud.stdout.splitlines() if glog.match(line)], loud.stdout[-3000:]
