"""Dead ops (results nothing reads) are removed before analysis (autopar/rewrites/dead_ops.py):
a router statistic that needs the whole batch no longer blocks micro-batching, an unused
``autopar.reshard`` gets no collective, explain names what was removed, the user's program is
untouched, and fetching a removed value is refused by name (``autopar.keep`` keeps one)."""

from __future__ import annotations

import pytest

import autopar
from autopar.cli import explain_text
from autopar.errors import AutoparError
from autopar.testing.models import SeedProgram
from autopar.testing.serial import assert_simulation_equals_serial, random_feeds

PP = autopar.ProcessMesh([0, 1], ["pp"])
MP = autopar.ProcessMesh([0, 1], ["mp"])


def routed(mesh: autopar.ProcessMesh, keep_stat: bool = False) -> tuple[SeedProgram, object]:
    """Two stages: a gated block whose router also computes a statistic nothing reads (each
    expert's highest probability over the batch, averaged: it needs the whole batch), then the
    classifier. Returns the seed and the statistic."""
    import paddle

    paddle.enable_static()
    F = paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        hidden, router, head = paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 4), paddle.nn.Linear(32, 10)
        stats = []

        def block(t):
            h = F.relu(hidden(t))
            probs = F.softmax(router(h), axis=-1)
            stats.append(paddle.mean(paddle.max(probs, axis=0)))  # a router statistic, never used
            return h * paddle.max(probs, axis=-1, keepdim=True)

        h = autopar.shard_op(block, mesh[0])(x)
        if keep_stat:
            autopar.keep(stats[0])
        loss = autopar.shard_op(lambda t: paddle.mean(F.cross_entropy(head(t), label)), mesh[1])(h)
        paddle.optimizer.Momentum(0.1, momentum=0.9).minimize(loss)
    return SeedProgram(
        main, startup, {"x": x, "label": label}, loss, {"hidden": hidden, "router": router, "head": head}
    ), stats[0]


def _pipeline(micro_batches: int, schedule: str = "1F1B") -> autopar.Strategy:
    return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule))


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_a_dead_router_statistic_does_not_block_micro_batching(schedule, micro_batches):
    seed, stat = routed(PP)
    ops = [op.name() for op in seed.main.global_block().ops]
    dist = autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=_pipeline(micro_batches, schedule))
    assert [op.name() for op in seed.main.global_block().ops] == ops  # the user's program is untouched
    removed = dict(dist.decisions.rewrites())["dead_ops"]
    assert "pd_op.max#" in removed and "pd_op.mean#" in removed, removed
    assert_simulation_equals_serial(seed, dist)
    with pytest.raises(
        AutoparError, match=r"was removed as dead before analysis: nothing in the program reads it.*autopar.keep"
    ):
        autopar.simulate(dist, random_feeds(seed.feeds, 1), [stat])


def test_a_kept_statistic_is_computed_so_micro_batching_refuses_it():
    """What compile did before dead ops were removed: the statistic needs the whole batch."""
    seed, _ = routed(PP, keep_stat=True)
    with pytest.raises(AutoparError, match=r"micro-batching: pd_op.mean#\d+ reads .* the op needs the whole batch"):
        autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=_pipeline(2))


def test_explain_names_the_removed_ops():
    seed, _ = routed(PP)
    text = explain_text(autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=_pipeline(2)))
    line = next(line for line in text.splitlines() if line.startswith("dead ops removed before analysis"))
    assert "pd_op.max#" in line and "pd_op.mean#" in line and "autopar.keep" in line, line


def key_branch(unused_reshard: bool, keep: bool = False) -> tuple[SeedProgram, autopar.DistributedProgram]:
    """Tensor parallel on ``MP``: a column-parallel query and row-parallel output; a key
    projection column-parallel too, gathered whole by ``autopar.reshard`` for a branch that was
    never written (nothing reads it)."""
    import paddle

    paddle.enable_static()
    F = paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        query, key, out = paddle.nn.Linear(16, 32), paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 10)
        for layer, mapping in ((query, [None, "mp"]), (key, [None, "mp"]), (out, ["mp", None])):
            autopar.shard_tensor(layer.weight, MP, mapping)
        if unused_reshard:
            k = autopar.reshard(key(x), MP, [None, None])
            if keep:
                autopar.keep(k)
        loss = paddle.mean(F.cross_entropy(out(F.relu(query(x))), label))
        paddle.optimizer.SGD(0.1).minimize(loss)
    seed = SeedProgram(main, startup, {"x": x, "label": label}, loss, {"query": query, "key": key, "out": out})
    count = len(main.global_block().ops)
    dist = autopar.compile(main, MP, startup_program=startup)
    assert len(main.global_block().ops) == count  # the user's program is untouched
    return seed, dist


def _collectives(dist: autopar.DistributedProgram) -> list[str]:
    return [f"{c.kind}{list(c.shape)}" for rank in dist.mesh.ranks for c in dist.comm_ops(rank)]


def test_an_unused_reshard_gets_no_collective():
    seed, dist = key_branch(unused_reshard=True)
    _, plain = key_branch(unused_reshard=False)
    _, kept = key_branch(unused_reshard=True, keep=True)
    assert _collectives(dist) == _collectives(plain)
    assert "all_gather" not in {c.kind.value for rank in MP.ranks for c in dist.comm_ops(rank)}
    # kept, the key is computed and gathered: the collective the removal saves
    assert sorted(_collectives(kept)) == sorted(_collectives(plain) + ["all_gather[8, 32]"] * 2), _collectives(kept)
    assert_simulation_equals_serial(seed, dist)
