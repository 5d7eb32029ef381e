"""The host runtime's fast paths compute what the plain paths compute.

- :class:`PreparedProgram` (a program's interpreter built once; ops in order or on worker
  threads) against ``Executor.run``: losses and parameters
  bit-identical over several steps, new feeds honoured every step; the Paddle flags it sets
  for its runs are restored.
- The Executor performing collectives on the scope's tensors (``run_in_scope``) against the
  numpy round trip (``run``): the same losses and parameters; which path ran is counted.
- The gloo communicator's in-place all_reduce / broadcast (a stand-in world group).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

import autopar
from autopar.collective import CollectiveKind
from autopar.runtime.collectives import perform
from autopar.runtime.jobs import Segment
from autopar.runtime.prepared import PreparedProgram
from autopar.runtime.rank_runner import RankRunner
from autopar.testing.models import simple_net


def _feeds(steps: int, batch: int = 8, width: int = 16) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        {"x": rng.standard_normal((batch, width)).astype("float32"), "label": rng.integers(0, 10, (batch, 1)).astype("int64")}
        for _ in range(steps)
    ]


def _trained(run_step, net, scope) -> tuple[list[float], dict[str, np.ndarray]]:
    losses = [float(run_step(feed)) for feed in _feeds(4)]
    names = [p.name for layer in net.layers.values() for p in layer.parameters()]
    return losses, {n: np.array(scope.find_var(n).get_tensor()) for n in names}


@pytest.mark.parametrize("in_order", [True, False])
def test_prepared_program_equals_executor_run(in_order):
    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    place = paddle.CPUPlace()
    results = []
    for prepared in (False, True):
        scope, exe = paddle.static.Scope(), paddle.static.Executor(place)
        with paddle.static.scope_guard(scope):
            exe.run(net.startup)
        if prepared:
            program = PreparedProgram(net.main, scope, place, [net.loss], in_order=in_order)
            results.append(_trained(lambda feed, p=program: p.run(feed)[0], net, scope))
        else:

            def step(feed, scope=scope, exe=exe):
                with paddle.static.scope_guard(scope):
                    return exe.run(net.main, feed=feed, fetch_list=[net.loss])[0]

            results.append(_trained(step, net, scope))
    assert paddle.get_flags(["FLAGS_enable_pir_in_executor_trace_run"]) == {"FLAGS_enable_pir_in_executor_trace_run": False}
    (plain_losses, plain_params), (fast_losses, fast_params) = results
    assert fast_losses == plain_losses and len(set(fast_losses)) == len(fast_losses)  # new feeds every step
    assert plain_params.keys() == fast_params.keys() and len(plain_params) == 6
    for name, value in plain_params.items():
        np.testing.assert_array_equal(fast_params[name], value, err_msg=name)


def test_prepared_program_without_fetches_returns_nothing():
    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        paddle.static.Executor(paddle.CPUPlace()).run(net.startup)
    assert PreparedProgram(net.main, scope, paddle.CPUPlace()).run(_feeds(1)[0]) == []


class _InMemory:
    """A world of one process standing in for every rank: does the collectives in memory,
    through numpy or (``in_scope``) on the scope tensors."""

    def __init__(self, in_scope: bool) -> None:
        self.in_scope, self.calls = in_scope, {"run": 0, "run_in_scope": 0}

    def all_gather_object(self, obj):
        return [obj, obj]

    def run(self, job, x):
        self.calls["run"] += 1
        return perform(job, {r: x for r in job.group})[0]

    def run_in_scope(self, call):
        if not self.in_scope or call.collective.kind is not CollectiveKind.ALL_REDUCE:
            return False
        self.calls["run_in_scope"] += 1
        both = perform(call.collective, {r: np.array(call.source) for r in call.collective.group})[0]
        call.target.set(np.require(both, requirements="C"), paddle.CPUPlace())
        return True


def _dp_net():
    net = simple_net(batch=8, sizes=(16, 32, 16, 10))
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    return net, autopar.compile(net.main, mesh, startup_program=net.startup)


@pytest.mark.parametrize("fetch", [False, True], ids=["no-fetch", "loss"])
def test_collectives_in_scope_equal_numpy_round_trip(fetch):
    """Rank 0 of dp=2 with both ranks fed the same batch piece (an in-memory world): every
    all_reduce doubles a gradient sum; the in-scope path must give the same step as numpy's.
    The fetched loss rides in the gradients' bucket (no collective of its own)."""
    net, dist = _dp_net()
    results = []
    for in_scope in (False, True):
        comm = _InMemory(in_scope)
        exe = autopar.Executor(dist, rank=0, backend="host", communicator=comm)
        exe.run_startup()
        losses = [exe.run(feed, fetch_list=[net.loss] if fetch else []) for feed in _feeds(3)]
        assert isinstance(exe._runner, RankRunner)
        results.append((losses, exe._runner, comm.calls))
    (plain, plain_runner, plain_calls), (fast, fast_runner, fast_calls) = results
    kinds = ["segment" if isinstance(job, Segment) else job.collective.kind.value for job in fast_runner.host.jobs]
    assert kinds == ["segment", "all_reduce", "segment"]
    collectives = kinds.count("all_reduce") * 3
    assert plain_calls == {"run": collectives, "run_in_scope": 0}
    assert fast_calls == {"run": 0, "run_in_scope": collectives}
    assert [np.asarray(a).tolist() for a in fast] == [np.asarray(a).tolist() for a in plain]
    assert len(dist.values.named("parameter")) == 6
    for name in dist.values.named("parameter"):
        np.testing.assert_array_equal(fast_runner.read(name), plain_runner.read(name), err_msg=name)


class _DoublingGroup:
    """Stands in for the world process group of 2 ranks holding equal inputs: all_reduce(sum)
    doubles the tensor in place, broadcast keeps it; records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def all_reduce(self, tensor, op, sync_op):
        dense = tensor.get_tensor()
        self.calls.append(("all_reduce", list(dense.shape())))
        dense.set(np.array(dense) * 2, paddle.CPUPlace())  # same size: written into the shared memory
        return self

    def broadcast(self, tensor, src, sync_op):
        self.calls.append(("broadcast", list(tensor.get_tensor().shape())))
        return self

    def wait(self):
        return True


def _communicator():
    from autopar.paddle_mode import dygraph
    from autopar.runtime.gloo import GlooCommunicator

    comm = object.__new__(GlooCommunicator)  # no process group: the world group is a stand-in
    comm.rank, comm.world, comm.timeout, comm._buffers = 0, 2, 10.0, {}
    comm._world_group = _DoublingGroup()
    with dygraph():
        comm._view = paddle.to_tensor(np.zeros((1,), "float32"))
    return comm


def _call(shape, **changes):
    from autopar.runtime.jobs import ScopeCall

    _, dist = _dp_net()
    (job, _), *_ = dist.rank_plan(0, "host").collectives
    source, target = paddle.base.core.DenseTensor(), paddle.base.core.DenseTensor()
    array = np.random.default_rng(0).standard_normal(shape).astype("float32")
    source.set(array, paddle.CPUPlace())
    return ScopeCall(dataclasses.replace(job, **changes), source, target), array


@pytest.mark.parametrize("shape", [(3, 4), ()], ids=["matrix", "scalar"])
def test_gloo_all_reduces_in_the_output_variable(shape):
    comm = _communicator()
    call, array = _call(shape)
    assert comm.run_in_scope(call)
    assert comm._world_group.calls == [("all_reduce", list(shape))]
    assert list(call.target.shape()) == list(shape)
    np.testing.assert_array_equal(np.array(call.target), array * 2)
    np.testing.assert_array_equal(np.array(call.source), array)  # the input is left as it was


def test_gloo_leaves_other_collectives_to_run():
    comm = _communicator()
    for changes in ({"group": (0,)}, {"reduce": "avg"}, {"kind": CollectiveKind.ALL_GATHER}):
        call, _ = _call((3,), **changes)
        assert not comm.run_in_scope(call), changes
    assert comm._world_group.calls == []
    call, array = _call((3,), kind=CollectiveKind.BROADCAST)
    assert comm.run_in_scope(call) and comm._world_group.calls == [("broadcast", [3])]
    np.testing.assert_array_equal(np.array(call.target), array)
