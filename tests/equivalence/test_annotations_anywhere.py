"""Annotations on intermediates and Partial annotations compute what serial computes (each
was silently wrong before), or are refused by name; uneven means are exact in float64."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.errors import AnnotationError
from autopar.testing.serial import run_serial


def _net(batch, dtype="float32"):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, 6], dtype)
        l1, l2 = paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 4)
        h = paddle.nn.functional.relu(l1(x))
        out = paddle.sum(l2(h))
    return main, startup, x, h, (l1, l2), out


def _check(main, startup, mesh, out, batch, dtype="float32", rtol=1e-5):
    dist = autopar.compile(main, mesh, startup_program=startup)
    feeds = [{"x": np.random.default_rng(0).standard_normal((batch, 6)).astype(dtype)}]
    got = autopar.simulate(dist, feeds, [out]).fetches[0][0]
    want = run_serial(main, startup, feeds, [out]).fetches[0][0]
    np.testing.assert_allclose(got, want, rtol=rtol)
    return got, want


@pytest.mark.parametrize("ranks, batch", [(3, 3), (2, 4)])
def test_annotated_intermediate_feeds_a_row_parallel_layer(ranks, batch):
    """x split on the batch, h = relu(l1(x)) annotated replicated, l2 row-parallel: the slice
    before l2 must cut the gathered h, not the producer's batch piece."""
    main, startup, x, h, (l1, l2), out = _net(batch)
    mesh = autopar.ProcessMesh(list(range(ranks)), ["mp"])
    autopar.shard_tensor(x, mesh, ["mp", None])
    autopar.shard_tensor(h, mesh, [None, None])
    autopar.shard_tensor(l2.weight, mesh, ["mp", None])
    _check(main, startup, mesh, out, batch)


@pytest.mark.parametrize("kind", ["sum", "avg", "max", "min"])
def test_partial_feed_means_its_pieces_reduce_to_the_feed(kind):
    main, startup, x, h, _, out = _net(4)
    mesh = autopar.ProcessMesh([0, 1, 2], ["d"])
    autopar.shard_tensor(x, mesh, autopar.DistAttr(mesh, [-1, -1], {0: kind}))
    _check(main, startup, mesh, out, 4)


@pytest.mark.parametrize("kind", ["sum", "avg", "max", "min"])
def test_partial_intermediate_is_made_partial_after_its_producer(kind):
    main, startup, x, h, _, out = _net(4)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    autopar.shard_tensor(x, mesh, ["a", None])
    autopar.shard_tensor(h, mesh, autopar.DistAttr(mesh, [-1, -1], {1: kind}))
    _check(main, startup, mesh, out, 4)


def test_partial_parameter_and_non_commuting_partials_are_refused():
    main, startup, x, h, (l1, _), out = _net(4)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    autopar.shard_tensor(l1.weight, mesh, [autopar.Partial(), autopar.Replicate()])
    with pytest.raises(AnnotationError, match="parameter 'linear_\\d+.w_0' is annotated \\[P\\(sum\\),R\\]: a parameter cannot be Partial"):
        autopar.compile(main, mesh, startup_program=startup)
    main, startup, x, h, _, out = _net(4)
    autopar.shard_tensor(h, mesh, [autopar.Partial("max"), autopar.Partial("sum")])
    with pytest.raises(AnnotationError, match="pending max and sum reductions do not commute"):
        autopar.compile(main, mesh, startup_program=startup)


def test_sum_and_avg_partials_mix():
    main, startup, x, h, _, out = _net(4)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    autopar.shard_tensor(h, mesh, [autopar.Partial("avg"), autopar.Partial("sum")])
    _check(main, startup, mesh, out, 4)


def test_uneven_mean_weights_are_exact_in_float64():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [5, 6], "float64")
        out = paddle.mean(paddle.tanh(x) * 3.0)
    mesh = autopar.ProcessMesh([0, 1, 2], ["d"])
    autopar.shard_tensor(x, mesh, ["d", None])
    got, want = _check(main, startup, mesh, out, 5, dtype="float64", rtol=0)
    assert got.dtype == np.float64 and abs(float(got) - float(want)) <= 1e-15
