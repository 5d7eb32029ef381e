"""Checkpoints of Paddle AMP O2 programs (bf16 parameters, fp32 master weights
``<param>_fp32_master_0``): the format carries bfloat16 as its bits, tagged; a save -> load
across a mesh change gives every rank's scope the same bits in a bfloat16 tensor, and the fp32
masters (states, placed like their parameters) the same float32 bits.

The mesh-change tests write the states with the start-up of each rank's program as it is after
reshard planning (``dist.rank_plan(rank, after="reshard_planning")``): a checkpoint needs the
placements and the scope, not a step (a bf16 step runs only through the twin). Every saved tensor
is first overwritten with distinct random values (bf16 bits of random floats; float32 masters
whose low mantissa bits a trip through bf16 would lose), so a load that leaves the fresh start-up
values, rounds, or reorders boxes fails.

Training, through the numerics twin (autopar.testing.amp): O2 AdamW on dp=2 (its collectives
move fp32 values) and O2 SGD on a 2-stage pipeline (its transfers move bf16 activations as they
are) train 2 steps, save, resume on one rank: bit for bit the serial twin resumed from the same
checkpoint, and within the twin's precision floor of the uninterrupted serial twin. O2 SGD on
dp = 2 (bf16 gradients all-reduced) resumes on mp = 2 (a bf16 row-parallel all_reduce) with
every piece loaded bit for bit, within the floor of the uninterrupted serial twin."""

import functools
import json

import numpy as np
import paddle
import pytest

import autopar
import autopar.checkpoint as checkpoint
from autopar.errors import AutoparError
from autopar.runtime.simulator import runner_for, start_ranks
from autopar.testing.amp import (
    Amp,
    amp_mlp,
    as_float32,
    measured_floor,
    run_serial_twin,
    state_names,
    twin_clone,
    twinned,
)
from autopar.testing.serial import random_feeds

WIDTHS = (8, 16, 4)


def compiled(ranks, how, zero=0, level="O2"):
    """``how``: "mp" (linear1 column-, linear2 row-parallel), "dp" (x split), or None."""
    seed = amp_mlp(Amp(level), batch=4, widths=WIDTHS)
    mesh = autopar.ProcessMesh(list(range(ranks)), [how or "x"])
    if how == "mp":
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear1"].bias, mesh, ["mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    elif how == "dp":
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    strategy = autopar.Strategy(zero_stage=zero)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def started(dist):
    """Each rank's plan (as reshard planning leaves it) and runner, start-up run."""
    plans = {rank: dist.rank_plan(rank, after="reshard_planning") for rank in dist.mesh.ranks}
    runners = {rank: runner_for(plan, []) for rank, plan in plans.items()}
    start_ranks(runners)
    return plans, runners


def saved_infos(plans):
    values = next(iter(plans.values())).values
    return {name: values.info(key) for kind in ("parameter", "state") for name, key in values.named(kind).items()}


def distinct_state(infos, seed=0):
    """A full array per saved tensor in the dtype its scope holds: bf16 as uint16 bits."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, info in sorted(infos.items()):
        values = rng.standard_normal(info.shape).astype(np.float32) + np.float32(1.0)
        if info.dtype == "bfloat16":
            out[name] = (values.view(np.uint32) >> 16).astype(np.uint16)
        else:
            assert info.dtype == "float32", (name, info.dtype)
            out[name] = values
    return out


def write_state(plans, runners, state):
    for rank, runner in runners.items():
        for name, info in saved_infos(plans).items():
            if rank in info.placement.mesh.ranks:
                runner.write(name, state[name][info.placement.local_slices(info.shape, rank)])


def assert_holds(plans, runners, state):
    """Every rank's scope holds its piece of ``state``, bit for bit, in the program's dtype."""
    checked = 0
    for rank, runner in runners.items():
        for name, info in saved_infos(plans).items():
            if rank not in info.placement.mesh.ranks:
                continue
            tensor = runner.scope.find_var(name).get_tensor()
            assert str(tensor._dtype()) == f"paddle.{info.dtype}", (rank, name)
            want = state[name][info.placement.local_slices(info.shape, rank)]
            got = np.array(tensor)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (rank, name)
            checked += 1
    assert checked


MASTER = "_fp32_master_0"
# (mesh A, mesh B, how A places each master beside its parameter: "alike", or "zero": an
# optimizer state ZeRO-1/2 shards over dp while the bf16 parameter stays replicated)
CASES = {
    "mp2->one-rank": (lambda: compiled(2, "mp"), lambda: compiled(1, None), "alike"),
    "zero3-dp2->mp2": (lambda: compiled(2, "dp", zero=3), lambda: compiled(2, "mp"), "alike"),
    "zero2-dp2->zero3-dp4": (lambda: compiled(2, "dp", zero=2), lambda: compiled(4, "dp", zero=3), "zero"),
    "one-rank->zero1-dp4": (lambda: compiled(1, None), lambda: compiled(4, "dp", zero=1), "alike"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_parameters_and_fp32_masters_survive_a_mesh_change_bit_for_bit(tmp_path, case):
    (_, dist_a), (_, dist_b), placed = CASES[case][0](), CASES[case][1](), CASES[case][2]
    plans_a, runners_a = started(dist_a)
    state = distinct_state(saved_infos(plans_a))
    write_state(plans_a, runners_a, state)
    checkpoint.save_ranks(tmp_path / "ckpt", plans_a, runners_a)

    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert index["version"] == 2
    infos = saved_infos(plans_a)
    parameters = sorted(n for n, i in infos.items() if i.kind == "parameter")
    assert len(parameters) == 4
    for name in parameters:
        master = index["tensors"][name + MASTER]
        assert (index["tensors"][name]["dtype"], index["tensors"][name]["stored_as"]) == ("bfloat16", "uint16")
        assert (master["kind"], master["dtype"], master["stored_as"]) == ("state", "float32", "float32")
        assert master["placement"] == str(infos[name + MASTER].placement)  # as the compiler placed it
        if placed == "alike":
            assert master["placement"] == index["tensors"][name]["placement"]
            assert [b["offsets"] for b in master["boxes"]] == [b["offsets"] for b in index["tensors"][name]["boxes"]]
        else:
            assert (index["tensors"][name]["placement"], master["placement"]) == ("[R]", "[S(0)]")

    plans_b, runners_b = started(dist_b)
    with pytest.raises(AssertionError):  # the fresh start-up holds other values
        assert_holds(plans_b, runners_b, state)
    checkpoint.load_ranks(tmp_path / "ckpt", plans_b, runners_b)
    assert_holds(plans_b, runners_b, state)


def test_numpy_alone_reads_bf16_as_float32_values_from_its_bits(tmp_path):
    """The recipe of autopar/checkpoint.py's docstring: uint16 files, tagged bfloat16."""
    _, dist = compiled(2, "mp")
    plans, runners = started(dist)
    state = distinct_state(saved_infos(plans), seed=3)
    write_state(plans, runners, state)
    path = tmp_path / "ckpt"
    checkpoint.save_ranks(path, plans, runners)
    index = json.loads((path / "index.json").read_text())
    weight = "linear_0.w_0"
    tensor = index["tensors"][weight]
    assert tensor["placement"] == "[S(1)]" and len(tensor["boxes"]) == 2
    full = np.empty(tensor["shape"], tensor["stored_as"])
    for box in tensor["boxes"]:
        assert np.load(path / box["file"]).dtype == np.uint16
        full[tuple(slice(o, o + n) for o, n in zip(box["offsets"], box["shape"]))] = np.load(path / box["file"])
    assert full.tobytes() == state[weight].tobytes()
    values = (full.astype(np.uint32) << 16).view(np.float32)
    main = paddle.static.Program()
    with paddle.static.program_guard(main, paddle.static.Program()):  # Paddle's own bf16 -> f32 cast
        bits = paddle.static.data("bits", list(full.shape), "bfloat16")
        cast = bits.astype("float32")
    (want,) = paddle.static.Executor(paddle.CPUPlace()).run(main, feed={"bits": full}, fetch_list=[cast])
    np.testing.assert_array_equal(values, want)


def test_the_full_state_gives_paddles_serial_o2_program_its_bf16_bits(tmp_path):
    """load_full -> paddle.static.set_program_state and export_paddle -> paddle.static.load: the
    serial O2 program's scope holds bf16 parameters and fp32 masters with the saved bits."""
    _, dist = compiled(2, "dp", zero=2)
    plans, runners = started(dist)
    state = distinct_state(saved_infos(plans), seed=5)
    write_state(plans, runners, state)
    path = tmp_path / "ckpt"
    checkpoint.save_ranks(path, plans, runners)
    full = checkpoint.load_full(path)
    assert full.keys() == state.keys()
    prefix = tmp_path / "paddle" / "model"
    checkpoint.export_paddle(path, prefix)
    serial = amp_mlp(Amp("O2"), batch=4, widths=WIDTHS)
    for how in ("set_program_state", "static.load"):
        scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(scope):
            exe.run(serial.startup)
            if how == "set_program_state":
                paddle.static.set_program_state(serial.main, full)
            else:
                paddle.static.load(serial.main, str(prefix))
        for name, want in state.items():
            tensor = scope.find_var(name).get_tensor()
            expected = "paddle.bfloat16" if name.endswith((".w_0", ".b_0")) else "paddle.float32"
            assert str(tensor._dtype()) == expected, (how, name)
            assert np.array(tensor).tobytes() == want.tobytes(), (how, name)


def test_o2_round_trip_through_the_simulator_on_one_rank(tmp_path):
    """The public path: ``autopar.simulate(dist, [], [], save_to=)`` then ``load_from=`` (no step:
    a bf16 training step needs the numerics twin)."""
    _, dist = compiled(1, None)
    path = tmp_path / "ckpt"
    saved = autopar.simulate(dist, [], [], save_to=path)
    full = checkpoint.load_full(path)
    for name, want in saved.parameters.items():
        assert want.dtype == np.uint16 and full[name].tobytes() == want.tobytes(), name
    masters = [n for n in full if n.endswith(MASTER)]
    assert len(masters) == 4
    for name in masters:  # O2's start-up makes each master the f32 value of its bf16 parameter
        bits = full[name.removesuffix(MASTER)]
        np.testing.assert_array_equal(full[name], (bits.astype(np.uint32) << 16).view(np.float32))
    loaded = autopar.simulate(dist, [], [], load_from=path)
    for name, want in saved.parameters.items():
        assert loaded.parameters[name].tobytes() == want.tobytes(), name


# ---- refusals --------------------------------------------------------------------------
def test_an_o2_checkpoint_into_an_o1_program_is_refused_by_dtype(tmp_path):
    _, o2 = compiled(1, None)
    path = tmp_path / "ckpt"
    autopar.simulate(o2, [], [], save_to=path)
    _, o1 = compiled(1, None, level="O1")
    with pytest.raises(
        AutoparError, match=r"tensor 'linear_0.b_0' has dtype bfloat16, the program's parameter has float32"
    ):
        autopar.simulate(o1, [], [], load_from=path)


def test_a_save_or_load_never_converts_bf16_values(tmp_path, monkeypatch):
    """A runner handing out a bf16 tensor as float32 values is refused: the format keeps the bits;
    a load never turns a bf16 scope tensor into another dtype."""
    _, dist = compiled(1, None)
    plans, runners = started(dist)
    real = runners[0].parameter_piece

    def as_float32(name):  # what a runner converting bf16 to float32 values would hand out
        piece = real(name)
        return (piece.astype(np.uint32) << 16).view(np.float32) if piece.dtype == np.uint16 else piece

    monkeypatch.setattr(runners[0], "parameter_piece", as_float32)
    with pytest.raises(
        AutoparError,
        match=r"hands out 'linear_0.b_0' as a float32 array; a bfloat16 tensor is saved from a uint16 array",
    ):
        checkpoint.save_ranks(tmp_path / "ckpt", plans, runners)
    assert not (tmp_path / "ckpt" / "index.json").exists()
    with pytest.raises(AutoparError, match=r"holds 'linear_0.w_0' as bfloat16, the loaded piece would make it float32"):
        checkpoint.install(runners[0], "linear_0.w_0", as_float32("linear_0.w_0"))
    assert str(runners[0].scope.find_var("linear_0.w_0").get_tensor()._dtype()) == "paddle.bfloat16"


def test_a_dtype_the_format_cannot_hold_is_refused_by_name(tmp_path):
    """float8_e4m3fn: numpy lacks it and the format holds no bits of it."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        label = paddle.static.data("label", [4, 1], "int64")
        scale = paddle.static.data("fp8_scale", [1], "float8_e4m3fn")
        scale.persistable = True
        with paddle.static.program_guard(startup):
            paddle._pir_ops.set_persistable_value(paddle.full([1], 1.0, "float32").astype("float8_e4m3fn"), "fp8_scale")
        logits = paddle.nn.Linear(8, 4)(x) * scale.astype("float32")
        paddle.optimizer.SGD(0.1).minimize(paddle.nn.functional.cross_entropy(logits, label).mean())
    dist = autopar.compile(main, autopar.ProcessMesh([0, 1], ["dp"]), startup_program=startup)
    with pytest.raises(
        AutoparError, match=r"state 'fp8_scale': dtype float8_e4m3fn cannot be held by the checkpoint format"
    ):
        autopar.simulate(dist, [], [], save_to=tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "index.json").exists()


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """Version 1 (before bfloat16) differs only by the version and no "stored_as": it loads as
    it did; a version this autopar does not know is refused by number."""
    _, dist = compiled(2, "mp", level="O1")  # O1: float32 parameters, what version 1 could hold
    plans, runners = started(dist)
    state = distinct_state(saved_infos(plans), seed=9)
    write_state(plans, runners, state)
    path = tmp_path / "ckpt"
    checkpoint.save_ranks(path, plans, runners)
    index = json.loads((path / "index.json").read_text())
    index["version"] = 1
    for tensor in index["tensors"].values():
        del tensor["stored_as"]
    (path / "index.json").write_text(json.dumps(index))
    plans_b, runners_b = started(compiled(1, None, level="O1")[1])
    checkpoint.load_ranks(path, plans_b, runners_b)
    assert_holds(plans_b, runners_b, state)
    index["version"] = 3
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(AutoparError, match=r"has format version 3; this autopar reads versions 1, 2"):
        checkpoint.read_index(path)


def test_a_file_is_checked_against_the_stored_dtype_of_its_tagged_dtype(tmp_path):
    """An index saying bfloat16 over a float32 master's files: named with the stored dtype."""
    _, dist = compiled(1, None)
    path = tmp_path / "ckpt"
    autopar.simulate(dist, [], [], save_to=path)
    index = json.loads((path / "index.json").read_text())
    index["tensors"]["linear_0.w_0" + MASTER]["dtype"] = "bfloat16"
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        AutoparError,
        match=r"tensor 'linear_0.w_0_fp32_master_0', file .* holds dtype float32, the index says bfloat16 \(stored as uint16\)",
    ):
        checkpoint.load_full(path)


# ---- training, resumed on another mesh (the numerics twin) -------------------------------
TRAIN_WIDTHS = (8, 16, 16, 4)  # the twin's tests' MLP (tests/equivalence/test_mixed_precision.py)


def trained(amp, how):
    """``amp_mlp`` on 2 ranks (``how``: "dp", "mp": linear1 column- and linear2 row-parallel, or
    "pp": 2 micro-batches) or on one rank (None)."""
    mesh = autopar.ProcessMesh([0, 1] if how else [0], [how or "x"])
    build = functools.partial(amp_mlp, widths=TRAIN_WIDTHS, batch=12, stages=mesh if how == "pp" else None)
    seed = build(amp)
    strategy = autopar.Strategy()
    if how == "dp":
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    elif how == "mp":
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    elif how == "pp":
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    return build, seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def serial_twin_from(seed, path, feeds):
    """The serial twin of ``seed`` resumed from the checkpoint at ``path`` (``load_full`` into
    Paddle's own program after its start-up): its losses on ``feeds`` and its state after."""
    twin, value_in_twin = twin_clone(seed.main, [seed.loss])
    loss = value_in_twin(seed.loss)
    scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(seed.startup)
        paddle.static.set_program_state(twin, checkpoint.load_full(path))
        losses = [exe.run(twin, feed=feed, fetch_list=[loss])[0] for feed in feeds]
    return losses, {name: np.array(scope.find_var(name).get_tensor()) for name in state_names(seed.main)}


@pytest.mark.parametrize(
    "amp, how", [(Amp("O2", optimizer="adamw"), "dp"), (Amp("O2", optimizer="sgd"), "pp")], ids=str
)
def test_o2_training_saved_on_two_ranks_resumes_on_one(tmp_path, amp, how):
    """2 steps on dp=2 (AdamW) or a 2-stage pipeline (SGD), saved; loaded on one rank, 2 more
    steps. The resumed steps equal, bit for bit, the serial twin resumed from the same
    checkpoint (losses, bf16 parameters, fp32 masters, moments); the 4 steps equal the
    uninterrupted serial twin within twice the precision floor, as the twin's tests hold
    distributed runs (autopar.testing.amp.assert_twin_equals_serial)."""
    build, seed, first = trained(amp, how)
    _, resumed_seed, second = trained(amp, None)
    feeds = random_feeds(seed.feeds, 4, classes=4)
    path, again = tmp_path / "ckpt", tmp_path / "after"
    start = paddle.get_rng_state()
    before = autopar.simulate(twinned(first), feeds[:2], [seed.loss], save_to=path)
    after = autopar.simulate(twinned(second), feeds[2:], [resumed_seed.loss], load_from=path, save_to=again)

    losses, state = serial_twin_from(resumed_seed, path, feeds[2:])
    assert [np.asarray(got[0]).tobytes() for got in after.fetches] == [np.asarray(x).tobytes() for x in losses]
    final = checkpoint.load_full(again)
    assert final.keys() == state.keys() and sum(name.endswith(MASTER) for name in final) == 6
    for name, want in state.items():
        assert final[name].tobytes() == want.tobytes(), name

    floor = measured_floor(build, amp, feeds)
    paddle.set_rng_state(start)
    serial = run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, before.fetches + after.fetches)):
        assert abs(float(got[0]) - float(want[0])) <= 2 * max(floor.losses), f"loss at step {step}"
    for name, bound in floor.parameters.items():
        assert np.max(np.abs(as_float32(final[name]) - serial.parameters[name])) <= 2 * bound, name
        master = final[name + MASTER]
        assert np.max(np.abs(master - serial.parameters[name + MASTER])) <= 2 * bound, name + MASTER


def test_o2_sgd_saved_on_dp2_resumes_on_mp2(tmp_path):
    """The bf16 collectives on both sides: 2 steps of O2 SGD on dp = 2 (bf16 gradients all-reduced),
    saved, resumed on mp = 2 (a bf16 row-parallel all_reduce), 2 more steps: every rank's bf16
    parameter pieces and fp32 masters loaded bit for bit (checked through a save right after the
    load), and the 4 steps within twice the precision floor of the uninterrupted serial twin."""
    amp = Amp("O2", optimizer="sgd")
    build, seed, first = trained(amp, "dp")
    _, resumed_seed, second = trained(amp, "mp")
    feeds = random_feeds(seed.feeds, 4, classes=4)
    path, loaded, again = tmp_path / "ckpt", tmp_path / "loaded", tmp_path / "after"
    start = paddle.get_rng_state()
    before = autopar.simulate(twinned(first), feeds[:2], [seed.loss], save_to=path)
    autopar.simulate(twinned(second), [], [], load_from=path, save_to=loaded)
    saved, reloaded = checkpoint.load_full(path), checkpoint.load_full(loaded)
    assert saved.keys() == reloaded.keys() and sum(name.endswith(MASTER) for name in saved) == 6
    for name, want in saved.items():
        assert reloaded[name].tobytes() == want.tobytes(), name
    index = checkpoint.read_index(loaded)
    assert index.tensors["linear_0.w_0"].placement == index.tensors["linear_0.w_0" + MASTER].placement == "[S(1)]"
    after = autopar.simulate(twinned(second), feeds[2:], [resumed_seed.loss], load_from=path, save_to=again)

    floor = measured_floor(build, amp, feeds)
    paddle.set_rng_state(start)
    serial = run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, before.fetches + after.fetches)):
        assert abs(float(got[0]) - float(want[0])) <= 2 * max(floor.losses), f"loss at step {step}"
    final = checkpoint.load_full(again)
    for name, bound in floor.parameters.items():
        assert np.max(np.abs(as_float32(final[name]) - serial.parameters[name])) <= 2 * bound, name
        assert np.max(np.abs(final[name + MASTER] - serial.parameters[name + MASTER])) <= 2 * bound, name + MASTER


class _Alone:
    """The communicator of a one-rank job."""

    def run(self, job, x):
        raise AssertionError(f"a one-rank job ran {job}")

    def all_gather_object(self, obj):
        return [obj]


def test_the_executors_own_save_and_load_of_an_o2_program(tmp_path):
    """``Executor.save`` / ``Executor.load`` (a job's path: its exchanges) after a twinned step:
    the fresh executor gets the trained bf16 bits and fp32 masters, and its next step's loss is
    the trained executor's, bit for bit."""
    amp = Amp("O2", optimizer="sgd")
    _, seed, dist = trained(amp, None)
    feeds = random_feeds(seed.feeds, 2, classes=4)
    exe = autopar.Executor(twinned(dist), rank=0, backend="host", communicator=_Alone())
    exe.run_startup()
    exe.run(feeds[0], [seed.loss])
    trained_parameters = exe.parameters()
    exe.save(tmp_path / "ckpt", metadata={"step": 1})
    fresh = autopar.Executor(twinned(dist), rank=0, backend="host", communicator=_Alone())
    fresh.run_startup()
    assert any(fresh.parameters()[n].tobytes() != w.tobytes() for n, w in trained_parameters.items())
    assert fresh.load(tmp_path / "ckpt") == {"step": 1}
    for name, want in trained_parameters.items():
        assert want.dtype == np.uint16 and fresh.parameters()[name].tobytes() == want.tobytes(), name
    saved = checkpoint.load_full(tmp_path / "ckpt")
    assert sum(name.endswith(MASTER) for name in saved) == 6
    fresh.save(tmp_path / "again")
    for name, want in checkpoint.load_full(tmp_path / "again").items():
        assert saved[name].tobytes() == want.tobytes(), name
    (want,), (got,) = exe.run(feeds[1], [seed.loss]), fresh.run(feeds[1], [seed.loss])
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
