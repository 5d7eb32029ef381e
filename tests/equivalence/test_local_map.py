"""``autopar.local_map`` (autopar/local_map.py): ``fn`` run per rank on its shards has a serial
meaning — ``fn`` applied to each shard in turn, the results concatenated (``Shard``) or summed
(``Partial``) — and the compiled program computes exactly it, moving nothing for the region:
each rank keeps its own copy of ``fn``, the split and the assembly are views. Under a pipeline,
the copies run on the sub-meshes of their stage; with ``groups`` (a multiple of the
micro-batches) the serial program is what the micro-batches run. Refusals by name: a pending sum
on an input, a shard that does not divide, a collective inside ``fn``, a value of one sub-mesh
read on the mesh without being assembled, a local region under micro-batches without groups."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import AnnotationError, AutoparError
from autopar.local_map import global_mesh_tensor, local_map, split_mesh, sub_mesh_tensors
from autopar.testing.models import SeedProgram, _static, make_optimizer
from autopar.testing.serial import assert_simulation_equals_serial, run_serial

M = autopar.ProcessMesh
MESHES = {"ep2": M([0, 1], ["ep"]), "ep4": M([0, 1, 2, 3], ["ep"]), "dp x ep": M([[0, 1], [2, 3]], ["dp", "ep"])}
S, R, P = autopar.Shard, autopar.Replicate, autopar.Partial


def centred(mesh, rows=8, width=6, train=True, annotated=True, optimizer="sgd"):
    """A Linear whose output is centred per shard of rows (a per-group statistic: the mean of
    the group's rows) and, beside it, each group's column sums of squares summed over groups."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [rows, width], "float32")
        lin = paddle.nn.Linear(width, width)
        for p in lin.parameters() if annotated else ():
            autopar.shard_tensor(p, mesh, [None] * len(p.shape))

        def fn(t):
            h = lin(t)
            return h - h.mean(axis=0, keepdim=True), (h * h).sum(axis=0)

        split = [S(0)] * mesh.ndim
        out, squares = local_map(fn, [split], [split, [P()] * mesh.ndim], mesh)(x)
        loss = out.pow(2).mean() + squares.mean()
        if train:
            make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"x": x}, loss, {"lin": lin}), out, squares


def test_the_serial_program_is_fn_per_shard_assembled():
    """Run serially, the program is the meaning: numpy applies fn to each shard in turn."""
    mesh = MESHES["ep4"]
    seed, out, squares = centred(mesh, train=False)
    x = np.random.default_rng(0).standard_normal((8, 6)).astype("float32")
    got_out, got_squares = run_serial(seed.main, seed.startup, [{"x": x}], [out, squares]).fetches[0]
    w, b = (run_serial(seed.main, seed.startup, [{"x": x}], [p]).fetches[0][0] for p in seed.layers["lin"].parameters())
    shards = [(s @ w + b) for s in np.split(x, 4)]
    np.testing.assert_allclose(got_out, np.concatenate([h - h.mean(axis=0) for h in shards]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_squares, sum((h * h).sum(axis=0) for h in shards), rtol=1e-5)


@pytest.mark.parametrize("name", list(MESHES))
def test_local_map_equals_serial_and_moves_nothing_for_its_region(name):
    mesh = MESHES[name]
    seed, _, _ = centred(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert_simulation_equals_serial(seed, dist)
    assert [c.kind.value for c in dist.comm_ops(0)] == ["all_reduce"]  # the Linear's gradients (one bucket), nothing else
    ops = [op.name() for op in dist.rank_plan(0).program.global_block().ops]
    serial = [op.name() for op in seed.main.global_block().ops]
    assert serial.count("pd_op.matmul") == mesh.size and ops.count("pd_op.matmul") == 1  # one copy per rank


def test_a_parameter_every_copy_reads_is_held_by_the_mesh():
    """Unannotated, the Linear every copy reads is placed on the mesh (before: on the sub-mesh of
    one copy, whose update then read the gradient summed over all copies across meshes)."""
    mesh = MESHES["dp x ep"]
    seed, _, _ = centred(mesh, annotated=False, optimizer="momentum")
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert {dist.dist_attr(p).mesh for p in seed.layers["lin"].parameters()} == {mesh}
    assert_simulation_equals_serial(seed, dist)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([(2,), (4,), (2, 2)]), st.integers(1, 3))
def test_random_shard_counts_equal_serial(shape, rows_per_shard):
    """Any number of shards (1-d and 2-d meshes) and rows per shard: equal to serial."""
    names = ["ep"] if len(shape) == 1 else ["dp", "ep"]
    mesh = M(np.arange(int(np.prod(shape))).reshape(shape).tolist(), names)
    seed, _, _ = centred(mesh, rows=rows_per_shard * mesh.size * 2)
    assert_simulation_equals_serial(seed, autopar.compile(seed.main, mesh, startup_program=seed.startup), steps=2)


def _experts(mesh, per_rank=1, width=4, rows=8):
    """Paddle's expert pattern: a buffer split by expert over ``ep``, each piece through its own
    Linear placed on its sub-mesh, the pieces joined back."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 5
    subs = split_mesh(mesh, "ep")
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [len(subs) * per_rank, rows, width], "float32")
        experts = [paddle.nn.Linear(width, width) for _ in range(len(subs) * per_rank)]
        for e, expert in enumerate(experts):
            for p in expert.parameters():
                autopar.shard_tensor(p, subs[e // per_rank], [None] * len(p.shape))
        by_expert = [S(0) if n == "ep" else S(1) for n in mesh.dim_names]
        outs = []
        for i, rows_i in enumerate(sub_mesh_tensors(x, mesh, by_expert, "ep")):
            outs.append(experts[i](rows_i))
        loss = global_mesh_tensor(outs, mesh, by_expert, "ep").pow(2).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    return SeedProgram(main, startup, {"x": x}, loss, {})


@pytest.mark.parametrize("name", ["ep2", "dp x ep"])
def test_experts_on_sub_meshes_compile_without_a_pipeline_and_equal_serial(name):
    mesh = MESHES[name]
    seed = _experts(mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    assert dist.strategy.pipeline is None
    assert_simulation_equals_serial(seed, dist)
    groups = {c.group for c in dist.comm_ops(0)}
    assert groups == ({(0, 2)} if name == "dp x ep" else set())  # each expert's gradient over its holders only


def test_a_pending_sum_on_an_input_is_refused_by_name():
    mesh = MESHES["ep2"]
    paddle, main, startup = _static()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        with pytest.raises(AnnotationError, match=r"local_map input 'x' is pending a sum over \['ep'\]"):
            local_map(lambda t: t * 2, [[P()]], [[S(0)]], mesh)(x)


def test_a_shard_that_does_not_divide_is_refused_by_name():
    mesh = MESHES["ep4"]
    paddle, main, startup = _static()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [6, 2], "float32")
        with pytest.raises(AnnotationError, match=r"sub_mesh_tensors of 'x': dim 0 \(6\) does not divide into 4 shards"):
            local_map(lambda t: t * 2, [[S(0)]], [[S(0)]], mesh)(x)


def test_a_collective_inside_fn_is_refused_by_name():
    """Copies over ep on a dp x ep mesh run on two ranks each; a weight split over dp read whole
    by a softmax inside fn would need an all_gather inside the local region."""
    mesh = MESHES["dp x ep"]
    paddle, main, startup = _static()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        w = paddle.create_parameter([6, 4], "float32")
        autopar.shard_tensor(w, mesh, [None, "dp"])
        out = local_map(lambda t: paddle.nn.functional.softmax(t @ w, axis=1), [[R(), S(0)]], [[R(), S(0)]], mesh)(x)
        paddle.optimizer.SGD(0.1).minimize(out.mean())
    with pytest.raises(AutoparError, match=r"autopar.local_map: pd_op.softmax#\d+ inside fn reads .* that needs a all_gather"):
        autopar.compile(main, mesh, startup_program=startup)


def test_a_sub_mesh_value_read_on_the_mesh_unassembled_is_refused_by_name():
    mesh = MESHES["ep2"]
    paddle, main, startup = _static()
    subs = split_mesh(mesh, "ep")
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        a, b = sub_mesh_tensors(x, mesh, [S(0)], "ep")
        loss = (a * b).mean()  # shard 0 times shard 1: no rank holds both
        paddle.optimizer.SGD(0.1).minimize(loss)
    assert [s.ranks for s in subs] == [(0,), (1,)]
    with pytest.raises(AutoparError, match=r"pd_op.multiply#\d+ runs on mesh\(ep=2\)\[0,1\] but reads values held by its sub-meshes"):
        autopar.compile(main, mesh, startup_program=startup)


PP_EP = M([[0, 1], [2, 3]], ["pp", "ep"])


def staged(groups, rows=16, width=6, train=True):
    """A Linear, then a local_map of ``centred``'s fn with ``groups`` groups per copy (fn keeps
    the leading groups dim: its statistics are over each group's rows): two layers to cut."""
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [rows, width], "float32")
        pre, lin = paddle.nn.Linear(width, width), paddle.nn.Linear(width, width)

        def fn(t):
            h = lin(t)
            return h - h.mean(axis=-2, keepdim=True), (h * h).sum(axis=-2)

        split = [R(), S(0)]
        out, squares = local_map(fn, [split], [split, [R(), P()]], PP_EP, groups=groups)(pre(x))
        loss = out.pow(2).mean() + squares.mean()
        if train:
            make_optimizer("sgd").minimize(loss)
    return SeedProgram(main, startup, {"x": x}, loss, {"pre": pre, "lin": lin}), out, squares


def test_groups_are_read_group_major():
    """With groups=2 on 2 copies, copy j runs fn on the j-th piece of each of the 2 groups of
    rows at once: numpy applies fn to the 4 chunks (group k, copy j) in turn. The summed output
    keeps the groups dim: group k's is the sum over its chunks, rows 8k to 8k+7 (read copy-major
    it would be rows 4k to 4k+3 and 8+4k to 8+4k+3)."""
    seed, out, squares = staged(groups=2, train=False)
    x = np.random.default_rng(0).standard_normal((16, 6)).astype("float32")
    h, got_squares = run_serial(seed.main, seed.startup, [{"x": x}], [out, squares]).fetches[0]
    pre_w, pre_b, w, b = (
        run_serial(seed.main, seed.startup, [{"x": x}], [p]).fetches[0][0] for name in ("pre", "lin") for p in seed.layers[name].parameters()
    )  # fmt: skip
    chunks = [(c @ pre_w + pre_b) @ w + b for c in np.split(x, 4)]  # group-major: rows of (group 0: copy 0, copy 1), (group 1: ...)
    np.testing.assert_allclose(h, np.concatenate([c - c.mean(axis=0) for c in chunks]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_squares, [(chunks[2 * k] ** 2).sum(0) + (chunks[2 * k + 1] ** 2).sum(0) for k in range(2)], rtol=1e-5)


@pytest.mark.parametrize(("groups", "micro_batches"), [(2, 2), (1, 1)])
def test_local_map_under_a_pipeline_equals_serial(groups, micro_batches):
    """pp x ep, 2 stages: the copies run on the sub-meshes of their stage (its ep ranks);
    with groups a multiple of the micro-batches (or one micro-batch), equal to serial."""
    seed, _, _ = staged(groups)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, stages=2))
    dist = autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)
    assert [m.ranks for m in dist.state.pipeline.meshes] == [(0, 1), (2, 3)]
    assert_simulation_equals_serial(seed, dist)


def test_local_map_under_a_pipeline_is_refused_by_name():
    """Under a pipeline whose stages no cut gives (PipelineConfig() without stages), the copies
    have no stage to run on: refused, naming the op, its sub-mesh and stages=n."""
    seed, _, _ = staged(groups=1)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=1))
    with pytest.raises(AnnotationError, match=r"autopar.local_map under a pipeline: pd_op\.\w+#\d+ runs on mesh\(pp=2\).*stages=n"):
        autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)


def test_local_map_under_micro_batches_without_groups_is_refused_by_name():
    seed, _, _ = staged(groups=1)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=2))
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op\.\w+#\d+ takes apart .* for an autopar\.local_map region.*local_map\(\.\.\., groups=q\)"):
        autopar.compile(seed.main, PP_EP, startup_program=seed.startup, strategy=strategy)


@pytest.mark.parametrize("name", ["ep2", "dp x ep"])
def test_a_plain_split_and_concat_around_experts_on_sub_meshes_are_views(name):
    """Paddle's way without the helpers: only the experts' parameters are placed on
    ``split_mesh(mesh, "ep")[i]``; the buffer is taken apart by ``paddle.split`` and put back by
    ``paddle.concat``. Each piece is read on the sub-mesh of its shard, so both are views: no
    collective moves the buffer (before, the split gathered it whole)."""
    mesh = MESHES[name]
    paddle, main, startup = _static()
    main.random_seed = startup.random_seed = 5
    subs = split_mesh(mesh, "ep")
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 8, 4], "float32")
        autopar.shard_tensor(x, mesh, [S(0) if n == "ep" else S(1) for n in mesh.dim_names])
        experts = [paddle.nn.Linear(4, 4) for _ in subs]
        for sub, expert in zip(subs, experts):
            for p in expert.parameters():
                autopar.shard_tensor(p, sub, [None] * len(p.shape))
        out = paddle.concat([expert(rows) for expert, rows in zip(experts, paddle.split(x, 2, axis=0))], axis=0)
        loss = out.pow(2).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    seed = SeedProgram(main, startup, {"x": x}, loss, {})
    dist = autopar.compile(main, mesh, startup_program=startup)
    assert_simulation_equals_serial(seed, dist)
    assert {c.kind.value for c in dist.comm_ops(0)} <= {"all_reduce"}  # at most the experts' gradients over dp
