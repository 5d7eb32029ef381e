"""Fuzz every public entry with wrong arguments: types, shapes, names, meshes, dims_mappings,
strategies, feeds and fetch lists. Each call either works or raises an AutoparError; any other
exception (KeyError, AttributeError, ValueError, RecursionError, a Paddle error) fails the test.

"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import autopar
from autopar.annotate import _TABLE
from autopar.errors import AnnotationWarning, AutoparError
from autopar.testing.models import simple_net
from autopar.testing.serial import random_feeds

MESHES = [
    autopar.ProcessMesh([0, 1], ["dp"]),
    autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]),
    autopar.ProcessMesh([1, 0], ["dp"]),
    autopar.ProcessMesh([0], ["mp"]),
    autopar.ProcessMesh([[0], [1]], ["dp", "mp"]),
]


def outcome(call: Any, *args: Any, **kwargs: Any) -> Any:
    """The call's result, or None when it raised an AutoparError; anything else propagates."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AnnotationWarning)
            return call(*args, **kwargs)
    except AutoparError as err:
        assert str(err), "an AutoparError must say what was wrong"
        return None


# ---- what a careless caller passes --------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["dp", "mp", "d0", "x", "label", "", "R", "S(0)", "P(sum)", "sum", "1F1B", "host", "native"]),
    st.text(max_size=3),
    st.binary(max_size=2),
    st.sampled_from([object(), np.int64(1), np.float32(0.5), np.array(2), math.pi]),
    st.sampled_from(MESHES),
    st.sampled_from(
        [autopar.Shard(0), autopar.Shard(1), autopar.Replicate(), autopar.Partial(), autopar.Partial("max")]
    ),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.sets(st.one_of(st.integers(-2, 3), st.sampled_from(["dp", "mp", "x"])), max_size=3),
        st.dictionaries(st.one_of(st.integers(-1, 3), st.sampled_from(["dp", "mp", "x", "label"])), inner, max_size=3),
        st.lists(st.integers(-1, 5), min_size=1, max_size=4).map(np.array),
    ),
    max_leaves=8,
)
entries = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(["dp", "mp", "pp", "d0"]),
                    st.tuples(st.sampled_from(["dp", "mp", 0, 1, -1]), st.sampled_from(["dp", "mp", 0, 1, 2])), junk)  # fmt: skip
dims_mappings = st.one_of(st.lists(entries, max_size=3), junk)


# ---- ProcessMesh, placements, DistAttr --------------------------------------------------------


@given(mesh=junk, dim_names=junk, shape=st.one_of(st.none(), junk), process_ids=st.one_of(st.none(), junk))
def test_process_mesh(mesh, dim_names, shape, process_ids):
    made = outcome(lambda: autopar.ProcessMesh(mesh, dim_names, shape=shape, process_ids=process_ids))
    if made is not None:
        assert all(type(r) is int and r >= 0 for r in made.ranks) and all(type(s) is int and s > 0 for s in made.shape)
        assert all(type(n) is str and n for n in made.dim_names) and len(made.dim_names) == made.ndim
        assert math.prod(made.shape) == made.size == len(set(made.ranks))
        for index in (0, -1, made.shape[0]):
            outcome(made.__getitem__, index)
        outcome(made.groups, dim_names)
        outcome(made.coordinate, process_ids)
        outcome(made.rank_at, shape)
        outcome(made.mesh_dim, mesh)


@given(mesh=st.sampled_from(MESHES), mapping=dims_mappings, partial=junk, ndim=junk, rank=junk)
def test_dist_attr(mesh, mapping, partial, ndim, rank):
    attr = outcome(autopar.DistAttr, mesh, mapping, partial)
    if attr is not None:
        assert autopar.DistAttr.parse(str(attr), mesh, attr.ndim) == attr
        outcome(attr.local_shape, ndim, rank)
        outcome(attr.shard_index, ndim, rank)
    outcome(autopar.DistAttr.from_placements, mesh, mapping, ndim)
    outcome(autopar.DistAttr.parse, partial, mesh, ndim)
    outcome(autopar.DistAttr, partial, mapping)


@given(dim=junk, order=junk, text=junk)
def test_placements(dim, order, text):
    outcome(autopar.Shard, dim, order)
    outcome(autopar.Partial, dim)
    outcome(autopar.placement.parse_placement, text)


# ---- Strategy, PipelineConfig ------------------------------------------------------------

FIELDS = [
    "pipeline",
    "zero_stage",
    "sequence_parallel",
    "recompute",
    "cluster",
    "fuse_allreduce",
    "allreduce_bucket_mb",
    "extra",
]


@given(fields=st.dictionaries(st.sampled_from(FIELDS), junk, max_size=3),
       micro_batches=junk, schedule=junk)  # fmt: skip
def test_strategy_and_pipeline_config(fields, micro_batches, schedule):
    outcome(autopar.PipelineConfig, micro_batches, schedule)
    strategy = outcome(lambda: autopar.Strategy(**fields))
    if strategy is not None:
        outcome(strategy.check_implemented)


# ---- shard_tensor, shard_op, compile -------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _program() -> Any:
    """One small training program; each example clears its annotations."""
    return simple_net(batch=4, sizes=(4, 2), optimizer="sgd"), simple_net(batch=4, sizes=(4, 2), optimizer="sgd")


def _values(net: Any, other: Any) -> list[Any]:
    return [net.feeds["x"], net.feeds["label"], net.layers["linear1"].weight, net.layers["linear1"].bias,
            net.loss, net.values["linear1"], other.feeds["x"], other.layers["linear1"].weight]  # fmt: skip


annotation = st.tuples(st.integers(0, 7), st.one_of(st.sampled_from(MESHES), junk), dims_mappings)


CORRUPTIONS = ["mesh", "program", "other program", "startup", "other startup", "main as startup", "no startup",
               "strategy", "strategy fields", "callback"]  # fmt: skip


@given(
    annotations=st.lists(annotation, max_size=3),
    mesh=st.sampled_from(MESHES),
    corrupt=st.sets(st.sampled_from(CORRUPTIONS), max_size=2),
    bad=junk,
    fields=st.dictionaries(st.sampled_from(FIELDS), junk, max_size=2),
)
def test_shard_tensor_and_compile(annotations, mesh, corrupt, bad, fields):
    net, other = _program()
    for p in (net.main, other.main):
        _TABLE.pop(p, None)
    values = _values(net, other)
    for index, on, spec in annotations:
        outcome(autopar.shard_tensor, values[index], on, spec)
    outcome(autopar.shard_tensor, bad, mesh, [None])
    outcome(autopar.shard_op, bad, mesh)
    args = {"program": net.main, "mesh": mesh, "startup": net.startup, "strategy": None, "callback": None}
    for what in sorted(corrupt):
        swaps = {"other program": ("program", other.main), "other startup": ("startup", other.startup),
                 "main as startup": ("startup", net.main), "no startup": ("startup", None),
                 "strategy fields": ("strategy", outcome(lambda: autopar.Strategy(**fields)))}  # fmt: skip
        key, value = swaps.get(what, (what, bad))
        args[key] = value
    dist = outcome(autopar.compile, args["program"], args["mesh"], startup_program=args["startup"],
                   strategy=args["strategy"], callback=args["callback"])  # fmt: skip
    event("compiled" if dist is not None else "refused")
    if dist is not None and not dist.unavailable:
        for item in ["x", "linear_0.w_0", *values, bad, mesh]:
            outcome(dist.dist_attr, item)
        main = net if args["program"] is net.main else other
        if args["startup"] is main.startup:  # odd but accepted annotations must run too
            ran = outcome(
                autopar.simulate,
                dist,
                random_feeds(main.feeds, 1, classes=2),
                [main.loss, main.layers["linear1"].weight],
            )
            event("simulated" if ran is not None else "simulate refused")


# ---- simulate, Executor, fetch lists -------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _compiled() -> tuple[Any, Any, Any]:
    net, other = simple_net(batch=4, sizes=(4, 2), optimizer="sgd"), simple_net(batch=4, sizes=(4, 2), optimizer="sgd")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    return net, other, autopar.compile(net.main, mesh, startup_program=net.startup)


def _fetchable(net: Any, other: Any) -> list[Any]:
    return [net.loss, net.layers["linear1"].weight, "linear_0.b_0", net.values["linear1"], other.loss, "x_", "nothing",
            net.feeds["x"], "label"]  # fmt: skip


FEED_NAMES = ("x", "label")


def _is(drawn: Any, tag: str) -> bool:
    return isinstance(drawn, str) and drawn == tag


def _fetch_list(fetch: Any, fetchable: list[Any]) -> Any:
    """Drawn indices -> fetchable values (feeds included)."""
    if isinstance(fetch, (list, tuple)):
        return [fetchable[f] if type(f) is int and 0 <= f < len(fetchable) else f for f in fetch]
    return fetch


arrays = st.one_of(
    st.tuples(st.sampled_from([(4, 4), (4, 1), (4,), (2, 4), (), (4, 4, 1)]),
              st.sampled_from(["float32", "float64", "int64", "int32", "bool", "float16"]))
    .map(lambda sd: np.zeros(sd[0], dtype=sd[1])),
    junk,
)  # fmt: skip
# a feed dict is the good one after up to two edits: drop a feed, or set a key to an array / junk
edit = st.one_of(st.tuples(st.just("drop"), st.sampled_from(FEED_NAMES)),
                st.tuples(st.just("set"), st.sampled_from([*FEED_NAMES, "y", 0, None]), arrays))  # fmt: skip
edits = st.one_of(st.just([]), st.lists(edit, min_size=1, max_size=2))
# what a caller passes as feeds: a list of edited feed dicts, one edited dict alone, or junk
step_lists = st.tuples(
    st.sampled_from(["steps", "steps", "steps", "one", "junk"]), st.lists(edits, max_size=2), edits, junk
).map(lambda t: {"steps": ("steps", t[1]), "one": ("one", t[2]), "junk": t[3]}[t[0]])
fetch_lists = st.one_of(
    st.lists(st.integers(0, 3), max_size=3), st.lists(st.one_of(st.integers(0, 6), junk), max_size=3), junk
)


def _edited(good: dict[str, Any], changes: list[tuple]) -> dict[Any, Any]:
    feed: dict[Any, Any] = dict(good)
    for change in changes:
        if change[0] == "drop":
            feed.pop(change[1], None)
        else:
            feed[change[1]] = change[2]
    return feed


def _feeds(drawn: Any, good: dict[str, Any]) -> Any:
    if isinstance(drawn, tuple) and len(drawn) == 2 and _is(drawn[0], "steps"):
        return [_edited(good, changes) for changes in drawn[1]]
    if isinstance(drawn, tuple) and len(drawn) == 2 and _is(drawn[0], "one"):
        return _edited(good, drawn[1])
    return drawn


@given(steps=step_lists, fetch=fetch_lists)
def test_simulate(steps, fetch):
    net, other, dist = _compiled()
    steps = _feeds(steps, random_feeds(net.feeds, 1, classes=2)[0])
    fetch = _fetch_list(fetch, _fetchable(net, other))
    result = outcome(autopar.simulate, dist, steps, fetch)
    event("simulated" if result is not None else "refused")
    if result is not None:
        assert len(result.fetches) == len(steps) and all(len(f) == len(fetch) for f in result.fetches)


class _OneRank:
    def run(self, job: Any, x: Any) -> Any:
        raise AssertionError(f"a one-rank job has no collective, got {job}")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


@functools.lru_cache(maxsize=1)
def _one_rank() -> tuple[Any, Any]:
    net = simple_net(batch=4, sizes=(4, 2), optimizer="sgd")
    return net, autopar.compile(net.main, autopar.ProcessMesh([0], ["dp"]), startup_program=net.startup)


@given(
    corrupt=st.sampled_from([None, None, None, "dist", "rank", "backend", "communicator"]),
    bad=junk,
    backend=st.sampled_from(["host", "host", "host", "auto", "native"]),
    feed=st.one_of(edits.map(lambda e: ("one", e)), junk),
    fetch=fetch_lists,
)
def test_executor(corrupt, bad, backend, feed, fetch, monkeypatch_env):
    net, compiled = _one_rank()
    args = {"dist": compiled, "rank": 0, "backend": backend, "communicator": _OneRank()}
    if corrupt is not None:
        args[corrupt] = bad
    exe = outcome(
        autopar.Executor, args["dist"], rank=args["rank"], backend=args["backend"], communicator=args["communicator"]
    )
    if exe is None:
        event("Executor refused")
        return
    outcome(exe.run, random_feeds(net.feeds, 1, classes=2)[0], [net.loss])  # before run_startup
    exe.run_startup()
    feed = _feeds(feed, random_feeds(net.feeds, 1, classes=2)[0])
    event("ran" if outcome(exe.run, feed, _fetch_list(fetch, _fetchable(net, net))) is not None else "run refused")
    assert set(exe.parameters()) == set(compiled.values.named("parameter"))


@pytest.fixture(scope="module")
def monkeypatch_env():
    """No launcher here: the Executor's environment checks must refuse, not Paddle."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
        patch.delenv("PADDLE_TRAINERS_NUM", raising=False)
        patch.delenv("PADDLE_TRAINER_ID", raising=False)
        yield
