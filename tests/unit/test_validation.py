"""Every public entry refuses a wrong argument with an AutoparError naming the argument and the
expected form: never a raw KeyError / AttributeError / ValueError / RecursionError, a Paddle
error, or a crash. One test per failure the fuzzer found (issue 9), plus the forms around it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import paddle
import pytest

import autopar
from autopar.errors import AnnotationError, AnnotationWarning, AutoparError, MeshError, PlacementError
from autopar.testing.models import simple_net
from autopar.testing.serial import random_feeds

MESH = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
PAIR = autopar.ProcessMesh([0, 1], ["dp"])


def _dp_pair():
    net = simple_net(batch=4, sizes=(4, 2))
    autopar.shard_tensor(net.feeds["x"], PAIR, ["dp", None])
    return net, autopar.compile(net.main, PAIR, startup_program=net.startup)


# ---- ProcessMesh --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: autopar.ProcessMesh(["1"]), r"mesh entries must be integer ranks >= 0, got '1' \(str\)"),
        (lambda: autopar.ProcessMesh([[0, "ab"]]), r"mesh entries must be integer ranks >= 0, got 'ab'"),
        (lambda: autopar.ProcessMesh([0.0, 1.0]), r"mesh entries must be integer ranks >= 0, got 0.0 \(float\)"),
        (lambda: autopar.ProcessMesh([True, False]), r"got True \(bool\)"),
        (lambda: autopar.ProcessMesh(np.zeros((2, 2))), r"got np.float64\(0.0\)"),
        (
            lambda: autopar.ProcessMesh(shape=[2.0], process_ids=[0, 1]),
            r"shape= must be a list of integers >= 1, got \[2.0\]",
        ),
        (
            lambda: autopar.ProcessMesh(shape=[2], process_ids=[0, 1.5]),
            r"process_ids= must be integer ranks >= 0, got 1.5",
        ),
        (lambda: autopar.ProcessMesh(shape=2, process_ids=[0, 1]), r"shape= must be a list, got 2"),
        (lambda: autopar.ProcessMesh([0, 1], shape=[2]), r"a nested rank list or shape= and process_ids=, not both"),
        (
            lambda: autopar.ProcessMesh([[0, 1], [2, 3]], dim_names="dp"),
            r"dim_names must be a list of strings, one per mesh dim, got 'dp'",
        ),
        (lambda: autopar.ProcessMesh([0, 1], dim_names=[1]), r"distinct non-empty strings, got \[1\]"),
        (lambda: autopar.ProcessMesh([0, 1], dim_names=[["a"]]), r"distinct non-empty strings"),
        (lambda: autopar.ProcessMesh(eval("[" * 40 + "0" + "]" * 40)), r"nested more than 32 levels deep"),
        (lambda: autopar.ProcessMesh({0: 1}), r"mesh entries must be integer ranks >= 0, got \{0: 1\} \(dict\)"),
    ],
)
def test_process_mesh_refuses_what_it_would_coerce(make, message):
    with pytest.raises(MeshError, match=message):
        make()


def test_process_mesh_takes_numpy_integers():
    assert autopar.ProcessMesh(np.arange(4).reshape(2, 2), ["dp", "mp"]) == MESH
    assert autopar.ProcessMesh(shape=np.array([2, 2]), process_ids=np.arange(4), dim_names=["dp", "mp"]) == MESH
    assert MESH[np.int64(1)].ranks == (2, 3) and MESH.mesh_dim(np.int64(1)) == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: MESH["dp"], r"takes an int index into the first mesh dim, got 'dp'"),
        (lambda: MESH.contains([0, 1]), r"contains\(\) takes an autopar.ProcessMesh, got list"),
        (lambda: MESH.rank_at([1]), r"a list of 2 indices, got \[1\]"),
        (lambda: MESH.rank_at([0, 2]), r"coordinate \[0, 2\] is out of range"),
        (lambda: MESH.coordinate(1.0), r"rank 1.0 is not in"),
        (lambda: MESH.groups(1.5), r"mesh_dims must be a mesh dim name or index, or a list of them, got 1.5"),
    ],
)
def test_process_mesh_methods_name_a_wrong_argument(call, message):
    with pytest.raises(MeshError, match=message):
        call()


# ---- DistAttr and placements --------------------------------------------------------------


@pytest.mark.parametrize(
    "mapping, partial, message",
    [
        ("dp", None, r"dims_mapping must be a list with one entry per tensor dim .*got 'dp'"),
        ({0: 1}, None, r"dims_mapping must be a list"),
        (3, None, r"dims_mapping must be a list"),
        ([-2, None], None, r"dims_mapping entry must be a mesh dim name, index, None or -1.*got -2"),
        ([{0}, None], None, r"got \{0\}"),
        ([(0, -1), None], None, r"the tuple \(0, -1\) holds -1"),
        ([(0, 1.0), None], None, r"the tuple \(0, 1.0\) holds 1.0"),
        ([True, None], None, r"got True"),
        ([0, None], "mp", r"partial_dims must be a set of mesh dims .*got 'mp'"),
        ([0, None], 1, r"partial_dims must be a set of mesh dims"),
        ([0, None], {1.5}, r"partial_dims must be a set of mesh dims .*got the entry 1.5"),
        ([0, None], {True}, r"got the entry True"),
        ([0, None], [(-1, "sum")], r"partial_dims: a mesh dim is a name or an index >= 0, got -1"),
        ([0, None], {"pp"}, r"partial_dims: unknown mesh dim 'pp'"),
        ([0, None], [(1, "sum", 2)], r"got the entry \(1, 'sum', 2\)"),
        ([0, None], {1: ["sum"]}, r"unknown partial reduce kind \['sum'\]"),
    ],
)
def test_dist_attr_refuses_malformed_mappings(mapping, partial, message):
    with pytest.raises(PlacementError, match=message):
        autopar.DistAttr(MESH, mapping, partial)


def test_dist_attr_takes_names_and_numpy_indices():
    assert autopar.DistAttr(MESH, [np.int64(0), None], {"mp"}) == autopar.DistAttr(MESH, [0, -1], {1})
    assert autopar.DistAttr(MESH, [None, ["mp", "dp"]]).mapping == ((), (1, 0))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: autopar.DistAttr.parse(None, MESH, 2), r"DistAttr.parse takes the text form"),
        (lambda: autopar.DistAttr.parse("[R,R]", "mesh", 2), r"DistAttr.parse needs an autopar.ProcessMesh, got str"),
        (
            lambda: autopar.DistAttr.from_placements(MESH, "RR", 2),
            r"placements must be a list with one placement per mesh dim",
        ),
        (lambda: autopar.DistAttr.from_placements(MESH, [autopar.Replicate()] * 2, 2.0), r"ndim must be .* got 2.0"),
        (
            lambda: autopar.DistAttr.from_placements([0], [], 2),
            r"from_placements needs an autopar.ProcessMesh, got list",
        ),
        (
            lambda: autopar.DistAttr(MESH, [0, None]).local_shape([4.0, 2], 0),
            r"sizes \(ints >= 0, or -1 for unknown\), got \[4.0, 2\]",
        ),
        (lambda: autopar.DistAttr(MESH, [0, None]).local_shape("ab", 0), r"shape must be a list of sizes, got 'ab'"),
        (
            lambda: autopar.DistAttr(MESH, [0, None]).shard_index(2, 0),
            r"tensor dim 2 is out of range for dims_mapping \[0,-1\]",
        ),
        (lambda: autopar.placement.parse_placement(0), r"parse_placement takes the text form"),
    ],
)
def test_dist_attr_helpers_name_a_wrong_argument(call, message):
    with pytest.raises(PlacementError, match=message):
        call()


# ---- shard_tensor / compile ---------------------------------------------------------------


def test_annotation_on_a_sub_mesh_is_refused_at_compile():
    net = simple_net(batch=4, sizes=(4, 2))
    autopar.shard_tensor(net.feeds["x"], MESH[0], ["mp", None])
    with pytest.raises(
        AnnotationError,
        match=r"tensor 'x' is annotated on mesh\(mp=2\)\[0,1\] but compile was given mesh\(dp=2,mp=2\)\[0,1,2,3\]; "
        r"sub-mesh placements land with the pipeline",
    ):
        autopar.compile(net.main, MESH, startup_program=net.startup)


def test_annotation_on_the_same_ranks_under_other_names_is_refused_at_compile():
    net = simple_net(batch=4, sizes=(4, 2))
    autopar.shard_tensor(net.layers["linear1"].weight, autopar.ProcessMesh([[0, 1], [2, 3]], ["a", "b"]), [None, "b"])
    with pytest.raises(
        AnnotationError,
        match=r"tensor 'linear_\d+.w_0' is annotated on mesh\(a=2,b=2\).*annotate with the mesh given to compile",
    ):
        autopar.compile(net.main, MESH, startup_program=net.startup)


def test_shard_tensor_refuses_a_dist_attr_on_another_mesh_and_non_values():
    net = simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(
        PlacementError,
        match=r"tensor 'x': its DistAttr is on mesh\(dp=2\)\[0,1\] but shard_tensor was given mesh\(dp=2,mp=2\)",
    ):
        autopar.shard_tensor(net.feeds["x"], MESH, autopar.DistAttr(PAIR, [0, -1]))
    with pytest.raises(AnnotationError, match=r"expects a Value of a static PIR program, got ndarray"):
        autopar.shard_tensor(np.ones(3), MESH, [None])
    with pytest.raises(AnnotationError, match=r"needs an autopar.ProcessMesh, got list"):
        autopar.shard_tensor(net.feeds["x"], [0, 1], [None, None])
    with paddle.static.program_guard(net.main, net.startup):
        both = paddle.concat([net.feeds["x"], net.feeds["x"]]).get_defining_op().operand_source(0)
        with pytest.raises(
            AnnotationError, match=r"shard_tensor annotates tensors; builtin.combine output 0 .* is a vec\["
        ):
            autopar.shard_tensor(both, PAIR, [None])


def test_a_legacy_program_is_refused_naming_pir():
    with paddle.pir_utils.OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [4, 4], "float32")
            paddle.nn.Linear(4, 2)(x)
    with pytest.raises(
        AutoparError,
        match=r"program is a legacy \(non-PIR\) Program: build the program under PIR \(the default in Paddle 3\)",
    ):
        autopar.compile(main, PAIR)
    with pytest.raises(AnnotationError, match=r"a legacy static Variable: build the program under PIR"):
        autopar.shard_tensor(x, PAIR, [None, None])
    net = simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(AutoparError, match=r"startup_program is a legacy \(non-PIR\) Program"):
        autopar.compile(net.main, PAIR, startup_program=startup)


def test_a_startup_program_of_another_net_is_refused_naming_what_it_lacks():
    a, b = simple_net(batch=4, sizes=(4, 2)), simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(
        AutoparError,
        match=r"startup_program does not initialize 'learning_rate_\d+', 'linear_\d+.b_0', .* of the program",
    ):
        autopar.compile(a.main, PAIR, startup_program=b.startup)


def test_a_startup_program_of_the_same_names_but_other_shapes_is_refused():
    with paddle.utils.unique_name.guard():
        a = simple_net(batch=4, sizes=(4, 2))
    with paddle.utils.unique_name.guard():
        b = simple_net(batch=4, sizes=(4, 3))
    with pytest.raises(
        AutoparError,
        match=r"startup_program initializes 'linear_0\.w_0\S*' with shape \[4, 3\], the program declares \[4, 2\]",
    ):
        autopar.compile(a.main, PAIR, startup_program=b.startup)


def test_dynamic_shapes_are_refused_at_compile_and_at_annotation():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [-1, 4], "float32")
        paddle.mean(paddle.nn.Linear(4, 2)(x))
        with pytest.raises(
            AnnotationError, match=r"tensor 'x' of shape \[-1, 4\]: dim 0 has no static size and cannot be split"
        ):
            autopar.shard_tensor(x, PAIR, ["dp", None])
    with pytest.raises(AutoparError, match=r"tensor 'x' has shape \[-1, 4\]: autopar needs static shapes"):
        autopar.compile(main, PAIR, startup_program=startup)


def test_unknown_sizes_of_auxiliary_outputs_are_not_refused():
    """batch_norm's reserve space has shape [-1]: only feeds, parameters and states must be static."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 3, 6, 6], "float32")
        loss = paddle.mean(paddle.nn.BatchNorm2D(3)(x))
        paddle.optimizer.SGD(0.1).minimize(loss)
    autopar.shard_tensor(x, PAIR, ["dp", None, None, None])
    dist = autopar.compile(main, PAIR, startup_program=startup)
    assert any(-1 in v.shape for v in dist.graph.values.values())
    fetched = autopar.simulate(dist, [{"x": np.ones((4, 3, 6, 6), "float32")}], [loss]).fetches[0][0]
    assert np.isfinite(fetched)


def test_compile_refuses_a_callback_that_is_not_callable():
    net = simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(AutoparError, match=r"callback must be callable .* got str"):
        autopar.compile(net.main, PAIR, callback="dump")


def test_an_annotation_on_a_clone_s_original_is_reported():
    """Annotations belong to the program whose Value was annotated; a clone carries none. A
    parameter of the same name annotated in another live program is reported (a warning:
    compiling the clone unannotated on purpose is legal)."""
    net = simple_net(batch=4, sizes=(4, 2))
    autopar.shard_tensor(net.layers["linear1"].weight, PAIR, [None, "dp"])
    clone = net.main.clone()
    with pytest.warns(AnnotationWarning, match=r"parameters \['linear_\d+.w_0'\] were annotated in another program"):
        dist = autopar.compile(clone, PAIR, startup_program=net.startup)
    assert dist.dist_attr(net.layers["linear1"].weight.name).is_replicated
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopar.compile(net.main, PAIR, startup_program=net.startup)  # its own annotation: no warning


# ---- feeds and fetches --------------------------------------------------------------------


def test_a_feed_of_another_dtype_is_refused_by_name():
    net, dist = _dp_pair()
    feed = random_feeds(net.feeds, 1, classes=2)[0]
    feed["x"] = feed["x"].astype("float64")
    with pytest.raises(AutoparError, match=r"feed 'x' has dtype float64, the program declares float32"):
        autopar.simulate(dist, [feed], [net.loss])
    with pytest.raises(AutoparError, match=r"feed 'x' must be an array of shape \[4, 4\]"):
        dist.rank_plan(0).local_feeds({"x": [[1.0], [1.0, 2.0]]})
    with pytest.raises(AutoparError, match=r"feed keys are feed names \(str\), got 0 \(int\)"):
        dist.rank_plan(0).local_feeds({0: feed["x"]})


@pytest.mark.parametrize(
    "feeds, fetch_list, message",
    [
        (
            "dict",
            None,
            r"feeds must be a list of feed dicts, one per step; got one dict \(pass \[feed\] for one step\)",
        ),
        ("x", None, r"feeds must be a list of feed dicts, one per step; got str"),
        ([3], None, r"feeds\[0\] must be a dict of feed name -> global array, got int"),
        (None, "loss", r"fetch_list must be a list of Values or names, got Value"),
        (None, "x", r"fetch_list must be a list of Values or names, got str"),
        (
            None,
            [3],
            r"expected a Value of the compiled program or the name of a feed, parameter or state, got 3 \(int\)",
        ),
        (None, [None], r"got None \(NoneType\)"),
        (None, ["nothing"], r"no parameter, feed or state named 'nothing'"),
    ],
)
def test_simulate_names_a_wrong_feeds_or_fetch_list(feeds, fetch_list, message):
    net, dist = _dp_pair()
    feed = random_feeds(net.feeds, 1, classes=2)[0]
    feeds = feed if feeds == "dict" else ([feed] if feeds is None else feeds)
    fetch_list = net.loss if fetch_list == "loss" else ([net.loss] if fetch_list is None else fetch_list)
    with pytest.raises(AutoparError, match=message):
        autopar.simulate(dist, feeds, fetch_list)


def test_simulate_needs_a_distributed_program():
    net = simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(
        AutoparError, match=r"simulate needs the DistributedProgram autopar.compile returned, got Program"
    ):
        autopar.simulate(net.main, [], [])


def test_a_value_of_another_program_is_refused_without_touching_it():
    net, dist = _dp_pair()
    other = simple_net(batch=4, sizes=(4, 2))
    with pytest.raises(
        AutoparError, match=r"a Value that is not a value of the compiled program \(it belongs to another program"
    ):
        autopar.simulate(dist, random_feeds(net.feeds, 1, classes=2), [other.loss])
    with pytest.raises(AutoparError, match=r"a Value that is not a value of the compiled program"):
        dist.dist_attr(other.loss)


def test_a_value_of_a_garbage_collected_program_is_refused_not_crashed_on():
    """Printing such a Value follows freed memory (SIGSEGV): run it apart from the test process.

    The programs die after compile, so their freed values cannot share an address with a value
    of the compiled program (alive all along). A Value that died *before* the compiled program
    was built may: its address is then a live value of that program, and it resolves to it —
    a Value carries nothing but that address, so the two cannot be told apart."""
    script = textwrap.dedent(
        """
        import gc, warnings
        warnings.filterwarnings("ignore")
        import autopar
        from autopar.testing.models import simple_net
        from autopar.testing.serial import random_feeds

        def orphan():
            return simple_net(batch=4, sizes=(4, 2)).loss

        net = simple_net(batch=4, sizes=(4, 2))
        dist = autopar.compile(net.main, autopar.ProcessMesh([0, 1], ["dp"]), startup_program=net.startup)
        dead = [orphan() for _ in range(3)]
        gc.collect()
        for value in dead:
            for call in (lambda: autopar.simulate(dist, random_feeds(net.feeds, 1, classes=2), [value]),
                         lambda: dist.dist_attr(value)):
                try:
                    call()
                    print("accepted")
                except autopar.AutoparError as err:
                    print("refused:", str(err)[:60])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("refused: a Value that is not a value of the compiled program") == 6, result.stdout


def test_fetching_a_feed_returns_the_global_feed():
    net, dist = _dp_pair()
    feed = random_feeds(net.feeds, 1, classes=2)[0]
    fetched = autopar.simulate(dist, [feed], ["x", net.feeds["label"]]).fetches[0]
    np.testing.assert_array_equal(fetched[0], feed["x"])
    np.testing.assert_array_equal(fetched[1], feed["label"])


# ---- Executor -----------------------------------------------------------------------------


class _OneRank:
    """A communicator for a one-rank job in this process."""

    def run(self, job, x):
        raise AssertionError(f"a one-rank job has no collective, got {job}")

    def all_gather_object(self, obj):
        return [obj]


def _one_rank():
    net = simple_net(batch=4, sizes=(4, 2))
    return net, autopar.compile(net.main, autopar.ProcessMesh([0], ["dp"]), startup_program=net.startup)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda dist: autopar.Executor("dist", rank=0),
            r"Executor needs the DistributedProgram autopar.compile returned, got str",
        ),
        (
            lambda dist: autopar.Executor(dist, rank=0.0),
            r"rank must be an int \(or None: from the environment\), got 0.0",
        ),
        (lambda dist: autopar.Executor(dist, rank=True), r"rank must be an int .* got True"),
        (lambda dist: autopar.Executor(dist, rank=3, communicator=_OneRank()), r"rank 3 is not in mesh\(dp=1\)\[0\]"),
        (
            lambda dist: autopar.Executor(dist, rank=0, communicator=object()),
            r"communicator must have run\(job, x\) and all_gather_object\(obj\)",
        ),
        (lambda dist: autopar.Executor(dist, rank=0, backend="gpu", communicator=_OneRank()), r"unknown backend 'gpu'"),
        (
            lambda dist: autopar.Executor(dist, rank=0, backend="host"),
            r"the host backend needs a launched job \(PADDLE_TRAINER_ENDPOINTS is not set\)",
        ),
        (lambda dist: autopar.Executor(dist, rank=0, backend="native"), r"the native backend needs a launched job"),
    ],
)
def test_executor_names_a_wrong_argument(make, message, monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    _, dist = _one_rank()
    with pytest.raises(AutoparError, match=message):
        make(dist)


def test_executor_run_names_a_wrong_feed_or_fetch_list(monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    net, dist = _one_rank()
    exe = autopar.Executor(dist, rank=0, backend="host", communicator=_OneRank())
    feed = random_feeds(net.feeds, 1, classes=2)[0]
    with pytest.raises(AutoparError, match=r"call run_startup\(\) before run\(\)"):
        exe.run(feed, [net.loss])
    exe.run_startup()
    with pytest.raises(AutoparError, match=r"feed must be a dict of feed name -> global array, got list"):
        exe.run([feed], [net.loss])
    with pytest.raises(AutoparError, match=r"fetch_list must be a list of Values or names, got Value"):
        exe.run(feed, net.loss)
    with pytest.raises(AutoparError, match=r"feed 'label' has dtype int32, the program declares int64"):
        exe.run({**feed, "label": feed["label"].astype("int32")}, [net.loss])
    (loss,) = exe.run(feed, [net.loss])
    assert np.isfinite(loss) and set(exe.parameters()) == set(dist.values.named("parameter"))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "two")
    with pytest.raises(AutoparError, match=r"PADDLE_TRAINERS_NUM must be the number of processes, got 'two'"):
        autopar.Executor(dist, rank=0, backend="host", communicator=_OneRank())


def test_a_garbage_rank_in_the_environment_is_named(monkeypatch):
    from autopar.runtime.executor import rank_from_env

    monkeypatch.setenv("PADDLE_TRAINER_ID", "one")
    with pytest.raises(autopar.AutoparError, match="PADDLE_TRAINER_ID \\(or RANK\\) must be this process's rank, got 'one'"):
        rank_from_env()


def test_a_paddle_mesh_is_told_how_to_convert():
    import paddle.distributed as pdist

    from autopar.local_map import local_map

    paddle_mesh = pdist.ProcessMesh([0, 1], dim_names=["ep"])
    with pytest.raises(AnnotationError, match=r"got ProcessMesh \(paddle.distributed's\): convert it with autopar.ProcessMesh.from_paddle\(mesh\)"):
        local_map(lambda x: x, [[autopar.Shard(0)]], [[autopar.Shard(0)]], paddle_mesh)
    assert autopar.ProcessMesh.from_paddle(paddle_mesh) == autopar.ProcessMesh([0, 1], ["ep"])
