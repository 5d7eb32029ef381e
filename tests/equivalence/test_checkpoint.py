"""Checkpoints in the simulator: train 2 steps on mesh A, save, load on mesh B, train 2 more =
4 serial steps (losses and parameters, rtol 1e-5, fp32), for A -> B across dp, mp, dp x mp,
ZeRO (uneven shards) and pipeline stages. Also: the files are plain .npy + index.json that
numpy alone reads, each box written once by the lowest rank holding it; the full state loads
into Paddle's serial program; a crash during save leaves the previous checkpoint loadable;
corrupted, truncated and missing files, missing tensors and shape / dtype mismatches are
AutoparErrors naming the tensor and the file."""

import hashlib
import json
from pathlib import Path

import numpy as np
import paddle
import pytest

import autopar
import autopar.checkpoint as checkpoint
from autopar.errors import AutoparError
from autopar.testing.models import annotate_megatron, gpt_block_program, simple_net
from autopar.testing.pipeline_models import staged_mlp
from autopar.testing.serial import random_feeds, run_serial

SIZES = (16, 32, 16, 10)


def _mesh(shape, names):
    return autopar.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), names)


def simple(shape, names, dp=None, mp=None, zero=0, optimizer="adam", sizes=SIZES, batch=8):
    """SimpleNet built afresh (same names every time: optimizer state names follow the program),
    x split over ``dp``, linear1 column- and linear2 row-parallel over ``mp``."""
    with paddle.utils.unique_name.guard():
        seed = simple_net(batch=batch, sizes=sizes, optimizer=optimizer)
    mesh = _mesh(shape, names)
    if dp:
        autopar.shard_tensor(seed.feeds["x"], mesh, [dp, None])
    if mp:
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, mp])
        autopar.shard_tensor(seed.layers["linear1"].bias, mesh, [mp])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, [mp, None])
    strategy = autopar.Strategy(zero_stage=zero)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def staged(optimizer="adam", micro_batches=2):
    with paddle.utils.unique_name.guard():
        mesh = autopar.ProcessMesh([0, 1], ["pp"])
        seed = staged_mlp(mesh, widths=SIZES, optimizer=optimizer)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule="1F1B"))
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def gpt(shape, names, dp=None):
    with paddle.utils.unique_name.guard():
        seed = gpt_block_program(batch=2, seq=4, hidden=16, heads=2, vocab=24, layers=1, optimizer="momentum")
    mesh = _mesh(shape, names)
    if dp:
        autopar.shard_tensor(seed.feeds["ids"], mesh, [dp, None])
    annotate_megatron(seed, mesh)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


def resume(tmp_path, first, second, classes=10, rtol=1e-5, atol=1e-6):
    """2 steps on ``first``, save; load on ``second``, 2 steps; compared with 4 serial steps."""
    (seed_a, dist_a), (seed_b, dist_b) = first, second
    feeds = random_feeds(seed_a.feeds, 4, classes=classes)
    path = tmp_path / "ckpt"
    start = paddle.get_rng_state()
    before = autopar.simulate(dist_a, feeds[:2], [seed_a.loss], save_to=path)
    after = autopar.simulate(dist_b, feeds[2:], [seed_b.loss], load_from=path)
    paddle.set_rng_state(start)  # the serial start-up draws from the state the ranks drew from
    serial = run_serial(seed_a.main, seed_a.startup, feeds, [seed_a.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, before.fetches + after.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, err_msg=f"loss at step {step}")
    assert serial.parameters.keys() == after.parameters.keys()
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(after.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)
    return path, before


CASES = {
    "dp2xmp2->mp4": (lambda: simple((2, 2), ["dp", "mp"], dp="dp", mp="mp"), lambda: simple((4,), ["mp"], mp="mp")),
    "dp4->dp2": (
        lambda: simple((4,), ["dp"], dp="dp", optimizer="momentum"),
        lambda: simple((2,), ["dp"], dp="dp", optimizer="momentum"),
    ),
    "mp2->dp2": (lambda: simple((2,), ["mp"], mp="mp"), lambda: simple((2,), ["dp"], dp="dp")),
    "zero2-dp2->dp4": (
        lambda: simple((2,), ["dp"], dp="dp", zero=2, sizes=(16, 33, 16, 10)),
        lambda: simple((4,), ["dp"], dp="dp", sizes=(16, 33, 16, 10)),
    ),
    "zero2-dp2->zero3-dp4": (
        lambda: simple((2,), ["dp"], dp="dp", zero=2, sizes=(16, 33, 16, 10)),
        lambda: simple((4,), ["dp"], dp="dp", zero=3, sizes=(16, 33, 16, 10)),
    ),
    "zero3-dp4->dp2": (
        lambda: simple((4,), ["dp"], dp="dp", zero=3, optimizer="momentum"),
        lambda: simple((2,), ["dp"], dp="dp", optimizer="momentum"),
    ),
    "pp2->dp2": (lambda: staged(), lambda: simple((2,), ["dp"], dp="dp", batch=12)),
    "pp2->one-rank": (lambda: staged("momentum"), lambda: simple((1,), ["x"], optimizer="momentum", batch=12)),
    "dp2xmp2->pp2": (lambda: simple((2, 2), ["dp", "mp"], dp="dp", mp="mp", batch=12), lambda: staged(micro_batches=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_another_mesh_equals_serial(tmp_path, case):
    build_a, build_b = CASES[case]
    resume(tmp_path, build_a(), build_b())


def test_megatron_gpt_dp2xmp2_to_mp4(tmp_path):
    """3-d activations, embedding, layer_norm, Momentum (under Adam the k bias, whose true gradient
    is zero, follows rounding noise: no run equals serial there); the tolerance of plain dp x mp on this
    model (tests/equivalence/test_simulator.py): its reductions run in another order."""
    resume(tmp_path, gpt((2, 2), ["dp", "mp"], dp="dp"), gpt((4,), ["mp"]), classes=24, rtol=1e-4, atol=1e-5)


# ---- the format ----------------------------------------------------------------------------
def test_numpy_alone_reads_the_checkpoint_and_each_box_is_written_once(tmp_path):
    seed, dist = simple((2, 2), ["dp", "mp"], dp="dp", mp="mp", zero=1)
    path = tmp_path / "ckpt"
    result = autopar.simulate(dist, random_feeds(seed.feeds, 1), [seed.loss], save_to=path)
    index = json.loads((path / "index.json").read_text())
    assert index["format"] == "autopar-checkpoint" and index["version"] == 2
    assert index["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "mp"], "ranks": [0, 1, 2, 3]}
    full = {}
    for name, tensor in index["tensors"].items():
        array = np.full(tensor["shape"], np.nan, dtype=tensor["dtype"])
        for box in tensor["boxes"]:
            data = (path / box["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == box["sha256"] and len(data) == box["bytes"]
            array[tuple(slice(o, o + n) for o, n in zip(box["offsets"], box["shape"]))] = np.load(path / box["file"])
        assert not np.isnan(array).any(), name  # the boxes tile the tensor
        full[name] = array
    for name, want in result.parameters.items():
        np.testing.assert_array_equal(full[name], want)
    w1, w2 = seed.layers["linear1"].weight.name, seed.layers["linear2"].weight.name
    # column-parallel over mp: two boxes, by the lowest rank of each mp column (ranks 0 and 1)
    assert index["tensors"][w1]["placement"] == "[R,S(1)]"
    assert [(b["offsets"], b["rank"]) for b in index["tensors"][w1]["boxes"]] == [([0, 0], 0), ([0, 16], 1)]
    assert [b["rank"] for b in index["tensors"][w2]["boxes"]] == [0, 1]
    # ZeRO-1 shards the moments over dp inside the mp split: four boxes, one per rank
    moment = index["tensors"][f"{w1}_moment1_0"]
    assert moment["placement"] == "[S(0),S(1)]" and sorted(b["rank"] for b in moment["boxes"]) == [0, 1, 2, 3]
    assert [b["rank"] for b in index["tensors"]["learning_rate_0"]["boxes"]] == [0]  # replicated: once
    files = {b["file"] for t in index["tensors"].values() for b in t["boxes"]}
    assert {str(p.relative_to(path)) for p in path.rglob("*.npy")} == files


def test_pipeline_stages_write_their_own_tensors_only(tmp_path):
    seed, dist = staged()
    path = tmp_path / "ckpt"
    autopar.simulate(dist, random_feeds(seed.feeds, 1), [seed.loss], save_to=path)
    index = checkpoint.read_index(path)
    last = seed.layers["linear3"].weight.name
    assert [b.rank for b in index.tensors[last].boxes] == [1]  # stage 1's; rank 0's copy is stale
    assert [b.rank for b in index.tensors[seed.layers["linear1"].weight.name].boxes] == [0]
    # stage 1 reads the learning rate placed on stage 0: a load gives it the whole value too
    loaded = {name: box for name, _, box in checkpoint.load_targets(dist.rank_plan(1))}
    assert loaded["learning_rate_0"] == checkpoint.Box((), ()) and seed.layers["linear1"].weight.name not in loaded


def test_the_full_state_loads_into_paddles_serial_program(tmp_path):
    """load_full -> paddle.static.set_program_state, and export_paddle -> paddle.static.load:
    the serial program resumed from either runs steps 3 and 4 as 4 serial steps do."""
    seed, dist = simple((2, 2), ["dp", "mp"], dp="dp", mp="mp", zero=2)
    feeds = random_feeds(seed.feeds, 4)
    path = tmp_path / "ckpt"
    start = paddle.get_rng_state()
    autopar.simulate(dist, feeds[:2], [seed.loss], save_to=path)
    paddle.set_rng_state(start)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    state = checkpoint.load_full(path)
    prefix = tmp_path / "paddle" / "model"
    params_file, opt_file = checkpoint.export_paddle(path, prefix)
    assert params_file.exists() and opt_file.exists()
    for how in ("set_program_state", "static.load"):
        scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(scope):
            exe.run(seed.startup)
            if how == "set_program_state":
                paddle.static.set_program_state(seed.main, state)
            else:
                paddle.static.load(seed.main, str(prefix))
            losses = [exe.run(seed.main, feed=f, fetch_list=[seed.loss])[0] for f in feeds[2:]]
        for got, (want,) in zip(losses, serial.fetches[2:]):
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=how)
        for name, want in serial.parameters.items():
            np.testing.assert_allclose(
                np.array(scope.find_var(name).get_tensor()), want, rtol=1e-5, atol=1e-6, err_msg=how
            )


# ---- crashes -------------------------------------------------------------------------------
class Crash(BaseException):
    """Stands for the process dying: nothing catches it, nothing is cleaned up."""


def _saved(tmp_path):
    seed, dist = simple((2,), ["dp"], dp="dp", zero=2)
    feeds = random_feeds(seed.feeds, 3)
    path = tmp_path / "ckpt"
    first = autopar.simulate(dist, feeds[:1], [seed.loss], save_to=path)
    return seed, dist, feeds, path, first


def _assert_holds(path, parameters):
    state = checkpoint.load_full(path)
    for name, want in parameters.items():
        np.testing.assert_array_equal(state[name], want, err_msg=name)


@pytest.mark.parametrize("crash", [RuntimeError, Crash], ids=["exception", "process-death"])
def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    seed, dist, feeds, path, first = _saved(tmp_path)
    index_before = (path / "index.json").read_bytes()
    written = []
    real = checkpoint.write_npy

    def failing(target, array):
        if len(written) == 5:
            raise crash("disk gone after 5 files")
        written.append(target)
        return real(target, array)

    monkeypatch.setattr(checkpoint, "write_npy", failing)
    expected = AutoparError if crash is RuntimeError else Crash
    with pytest.raises(expected, match="disk gone after 5 files"):
        autopar.simulate(dist, feeds[1:], [seed.loss], save_to=path)
    monkeypatch.undo()
    assert written and (path / "index.json").read_bytes() == index_before
    partial = [p.name for p in path.iterdir() if p.name.endswith(".partial")]
    assert partial == ([] if crash is RuntimeError else [written[0].parent.name])  # an exception cleans up
    _assert_holds(path, first.parameters)
    again = autopar.simulate(dist, [], [], load_from=path, save_to=path)  # resumes, saves: leftovers go
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == [checkpoint.read_index(path).data]
    _assert_holds(path, again.parameters)


def test_a_crash_before_the_index_is_replaced_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    seed, dist, feeds, path, first = _saved(tmp_path)
    old = checkpoint.read_index(path).data

    def dies(*args):
        raise Crash("died while committing")

    monkeypatch.setattr(checkpoint, "write_index", dies)
    with pytest.raises(Crash):
        autopar.simulate(dist, feeds[1:], [seed.loss], save_to=path)
    monkeypatch.undo()
    assert checkpoint.read_index(path).data == old and len([p for p in path.iterdir() if p.is_dir()]) == 2
    _assert_holds(path, first.parameters)


# ---- damaged checkpoints and mismatches --------------------------------------------------
def _damage(path, name, how):
    index = json.loads((path / "index.json").read_text())
    file = path / index["tensors"][name]["boxes"][-1]["file"]
    data = bytearray(file.read_bytes())
    if how == "corrupted":
        data[-3] ^= 0xFF
        file.write_bytes(bytes(data))
    elif how == "truncated":
        file.write_bytes(bytes(data[: len(data) // 2]))
    else:
        file.unlink()
    return file


@pytest.mark.parametrize("how", ["corrupted", "truncated", "missing"])
def test_a_damaged_file_is_named_with_its_tensor(tmp_path, how):
    seed, dist, feeds, path, _ = _saved(tmp_path)
    name = f"{seed.layers['linear1'].weight.name}_moment2_0"
    file = _damage(path, name, how)
    with pytest.raises(AutoparError, match=rf"tensor '{name}', file {file} is {how}"):
        autopar.simulate(dist, feeds[1:], [seed.loss], load_from=path)
    with pytest.raises(AutoparError, match=how):
        checkpoint.load_full(path)


def test_missing_tensors_and_shape_or_dtype_mismatches_are_named(tmp_path):
    seed, dist, feeds, path, _ = _saved(tmp_path)
    _, wider = simple((2,), ["dp"], dp="dp", sizes=(16, 48, 16, 10))
    weight, bias = seed.layers["linear1"].weight.name, seed.layers["linear1"].bias.name
    with pytest.raises(
        AutoparError, match=rf"{path}/index.json: tensor '{bias}' has shape \[32\], the program's parameter has \[48\]"
    ):
        autopar.simulate(wider, [], [], load_from=path)
    _, momentum = simple((2,), ["dp"], dp="dp", optimizer="momentum")
    with pytest.raises(
        AutoparError,
        match=rf"checkpoint {path}/index.json has no tensor '{bias}_velocity_0': 6 tensors of the program are not in it",
    ):
        autopar.simulate(momentum, [], [], load_from=path)
    index = json.loads((path / "index.json").read_text())
    index["tensors"][weight]["dtype"] = "float64"
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        AutoparError, match=rf"tensor '{weight}' has dtype float64, the program's parameter has float32"
    ):
        autopar.simulate(dist, [], [], load_from=path)
    with pytest.raises(AutoparError, match=rf"tensor '{weight}', file .* holds dtype float32, the index says float64"):
        checkpoint.load_full(path)
    (path / "index.json").write_text("{not json")
    with pytest.raises(AutoparError, match="index.json cannot be read"):
        autopar.simulate(dist, [], [], load_from=path)


def test_bad_paths_and_arguments(tmp_path):
    seed, dist = simple((2,), ["dp"], dp="dp")
    with pytest.raises(AutoparError, match="no checkpoint at .*index.json does not exist"):
        autopar.simulate(dist, [], [], load_from=tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(AutoparError, match="exists and is not a directory"):
        autopar.simulate(dist, [], [], save_to=tmp_path / "file")
    with pytest.raises(AutoparError, match="a checkpoint path is a str or os.PathLike"):
        autopar.simulate(dist, [], [], save_to=3)
    for save in (True, False):
        exe = autopar.Executor(dist, rank=0, backend="host", communicator=_Alone())
        with pytest.raises(AutoparError, match="call run_startup"):
            exe.save(tmp_path / "x") if save else exe.load(tmp_path / "x")


# ---- the Executor's own save / load (one rank, in this process) ---------------------------
class _Alone:
    """The communicator of a one-rank job."""

    def run(self, job, x):
        raise AssertionError(f"a one-rank job ran {job}")

    def all_gather_object(self, obj):
        return [obj]


def test_executor_save_load_round_trip_metadata_and_a_failed_load_changes_nothing(tmp_path):
    seed, dist = simple((1,), ["x"])
    feeds = random_feeds(seed.feeds, 2)
    exe = autopar.Executor(dist, rank=0, backend="host", communicator=_Alone())
    exe.run_startup()
    exe.run(feeds[0], [seed.loss])
    trained = exe.parameters()
    exe.save(tmp_path / "ckpt", metadata={"step": 1, "note": "after one step"})
    with pytest.raises(AutoparError, match="metadata must be JSON-serializable"):
        exe.save(tmp_path / "ckpt", metadata={"when": object()})
    fresh = autopar.Executor(dist, rank=0, backend="host", communicator=_Alone())
    fresh.run_startup()
    started = fresh.parameters()
    _damage(tmp_path / "ckpt", seed.layers["linear2"].weight.name, "corrupted")
    with pytest.raises(
        AutoparError, match="load from .* failed \\(no rank's state was changed\\): rank 0: .* is corrupted"
    ):
        fresh.load(tmp_path / "ckpt")
    for name, want in started.items():
        np.testing.assert_array_equal(fresh.parameters()[name], want)
    exe.save(Path(tmp_path / "ckpt"), metadata={"step": 1})
    assert fresh.load(str(tmp_path / "ckpt")) == {"step": 1}
    for name, want in trained.items():
        np.testing.assert_array_equal(fresh.parameters()[name], want)
    np.testing.assert_array_equal(fresh.run(feeds[1], [seed.loss])[0], exe.run(feeds[1], [seed.loss])[0])
