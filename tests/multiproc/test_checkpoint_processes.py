"""Checkpoints in two real processes. Host backend: train 2 steps on dp=2 with ZeRO-2 (Adam
moments split over the processes, 33 rows: uneven), save; a save that fails on rank 1 raises
on both ranks and leaves the checkpoint as it was; a save during which rank 1 dies leaves it
too. A second job loads it on mp=2 and trains 2 more steps: losses and parameters equal 4
serial steps (rtol 1e-5); its own save then removes the dead save's leftovers. Native
backend: a save / load round trip (ZeRO-1 on dp=2)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.testing.processes import launch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    from pathlib import Path
    import numpy as np
    import paddle
    import autopar
    import autopar.checkpoint as checkpoint
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds, run_serial

    phase, path = sys.argv[1], Path(sys.argv[2])
    WRITE = checkpoint.write_npy

    def build(mode):
        with paddle.utils.unique_name.guard():  # the same names in both jobs
            seed = simple_net(batch=8, sizes=(16, 33, 16, 10), optimizer="adam")
        mesh = autopar.ProcessMesh([0, 1], [mode])
        if mode == "dp":
            autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
        else:
            autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
            autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
            autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
        strategy = autopar.Strategy(zero_stage=2 if mode == "dp" else 0)
        return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)

    def failing_on_rank_1(after, fail):
        count = [0]
        def write(target, array):
            if exe.rank == 1 and count[0] == after:
                fail()
            count[0] += 1
            return WRITE(target, array)
        return write

    seed, dist = build("dp" if phase == "train" else "mp")
    feeds = random_feeds(seed.feeds, 4, classes=10)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    exe = autopar.Executor(dist, backend="host")
    exe.run_startup()
    if phase == "train":
        for feed, (want,) in zip(feeds[:2], serial.fetches[:2]):
            np.testing.assert_allclose(exe.run(feed, [seed.loss])[0], want, rtol=1e-5)
        exe.save(path, metadata={"step": 2})
        index = (path / "index.json").read_bytes()

        def refuse():
            raise OSError(28, "No space left on device")

        checkpoint.write_npy = failing_on_rank_1(2, refuse)
        try:
            exe.save(path)
            raise SystemExit("the failed save did not raise")
        except autopar.AutoparError as err:
            assert "failed (the previous checkpoint is unchanged): rank 1: writing tensor" in str(err), err
            assert "No space left on device" in str(err), err
        assert (path / "index.json").read_bytes() == index
        assert not [p for p in path.iterdir() if p.name.endswith(".partial")]
        print("RESULT", exe.rank, "failed save raised everywhere, checkpoint unchanged", flush=True)
        exe.run(feeds[2], [seed.loss])  # a third step: the save rank 1 dies in would hold it
        checkpoint.write_npy = failing_on_rank_1(1, lambda: os._exit(3))
        exe.save(path)
        raise SystemExit("rank 1 did not die")
    else:
        assert len([p for p in path.iterdir() if p.name.endswith(".partial")]) == 1  # the dead save's files
        assert exe.load(path) == {"step": 2}
        losses = [exe.run(feed, [seed.loss])[0] for feed in feeds[2:]]
        for got, (want,) in zip(losses, serial.fetches[2:]):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        params = exe.parameters()
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        exe.save(path, metadata={"step": 4})
        assert [p.name for p in path.iterdir() if p.is_dir()] == [checkpoint.read_index(path).data]
        print("RESULT", exe.rank, "resumed on mp2 equal to serial", flush=True)
    """
)


def _launch(script, phase, path):
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc", "2", str(script), phase, str(path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_save_on_dp2_zero2_resume_on_mp2_in_two_processes(tmp_path):
    script = tmp_path / "checkpoint.py"
    script.write_text(SCRIPT)
    path = tmp_path / "ckpt"
    train = _launch(script, "train", path)
    log = train.stdout[-3000:] + train.stderr[-3000:]
    assert train.returncode != 0, log  # rank 1 died during the last save
    assert len([line for line in train.stdout.splitlines() if "RESULT" in line]) == 2, log
    assert "rank 1 exited with code 3" in log and "did not raise" not in log and "did not die" not in log, log
    assert json.loads((path / "index.json").read_text())["metadata"] == {"step": 2}
    resume = _launch(script, "resume", path)
    assert resume.returncode == 0, resume.stdout[-3000:] + resume.stderr[-3000:]
    assert len([line for line in resume.stdout.splitlines() if "RESULT" in line]) == 2, resume.stdout[-3000:]


NATIVE = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds

    seed = simple_net(batch=8, sizes=(16, 32, 16, 10), optimizer="adam")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=1))
    feeds = random_feeds(seed.feeds, 3, classes=10)
    exe = autopar.Executor(dist, backend="native")
    exe.run_startup()
    for feed in feeds[:2]:
        exe.run(feed, [seed.loss])
    exe.save(sys.argv[1])
    saved = exe.parameters()
    third = exe.run(feeds[2], [seed.loss])[0]
    exe.load(sys.argv[1])  # back to the state after step 2
    for name, want in saved.items():
        np.testing.assert_array_equal(exe.parameters()[name], want, err_msg=name)
    np.testing.assert_array_equal(exe.run(feeds[2], [seed.loss])[0], third)
    print("RESULT", exe.rank, "native round trip", flush=True)
    """
)


def test_native_backend_save_and_load_round_trip(tmp_path):
    results = launch(NATIVE, 2, tmp_path, [str(tmp_path / "ckpt")])
    assert len(results) == 2, results
