"""Small programs and readers shared by the per-pass unit tests (tests/unit/passes/).

Each pass test compiles one of these and reads what the pass did from the public contract: the
rank plan after the pass (``dist.rank_plan(rank, after=name)``) against the plan after the pass
before it, the collectives' values and the ops of the rank program."""

from __future__ import annotations

import paddle

import autopar
from autopar.testing.models import SeedProgram, make_optimizer, simple_net

SIZES = (16, 32, 16, 10)


def data_parallel(world: int = 2, batch: int = 8, **strategy) -> tuple[SeedProgram, autopar.DistributedProgram]:
    """SimpleNet (three linears) with its batch split over ``world`` data-parallel ranks."""
    seed = simple_net(batch=batch, sizes=SIZES, optimizer=strategy.pop("optimizer", "momentum"))
    mesh = autopar.ProcessMesh(list(range(world)), ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**strategy))
    return seed, dist


def megatron_mlp(**strategy) -> tuple[SeedProgram, autopar.DistributedProgram]:
    """A linear, then fc1 column-parallel, gelu, fc2 row-parallel over ``mp`` = 2; a mean loss."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 16], "float32")
        layers = {"input": paddle.nn.Linear(16, 16), "fc1": paddle.nn.Linear(16, 64), "fc2": paddle.nn.Linear(64, 16)}
        autopar.shard_tensor(layers["fc1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(layers["fc1"].bias, mesh, ["mp"])
        autopar.shard_tensor(layers["fc2"].weight, mesh, ["mp", None])
        h = layers["fc2"](paddle.nn.functional.gelu(layers["fc1"](layers["input"](x))))
        loss = paddle.mean(h)
        make_optimizer("sgd").minimize(loss)
    seed = SeedProgram(main, startup, {"x": x}, loss, layers)
    return seed, autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(**strategy))


def previous_pass(dist: autopar.DistributedProgram, name: str) -> str:
    """The pass that runs right before ``name`` (its rank program is the input of ``name``)."""
    names = dist.passes.names()
    assert name in names, f"{name} is not among the passes {names}"
    return names[names.index(name) - 1]


def around(dist: autopar.DistributedProgram, name: str, rank: int = 0, backend: str = "host"):
    """The rank plans before and after the pass ``name``."""
    return dist.rank_plan(rank, backend, after=previous_pass(dist, name)), dist.rank_plan(rank, backend, after=name)


def op_names(plan) -> list[str]:
    return [op.name() for op in plan.program.global_block().ops]


def count(plan, op_name: str) -> int:
    return op_names(plan).count(op_name)


def data_shapes(program) -> dict[str, list[int]]:
    """Each feed (``pd_op.data``) of ``program``: its declared shape."""
    return {
        str(op.attrs()["name"]): list(op.result(0).shape)
        for op in program.global_block().ops
        if op.name() == "pd_op.data"
    }


def parameter_shapes(program) -> dict[str, list[int]]:
    """Each parameter (``builtin.parameter``) of ``program``: its shape there."""
    return {
        str(op.attrs()["parameter_name"]): list(op.result(0).shape)
        for op in program.global_block().ops
        if op.name() == "builtin.parameter"
    }


def sources(plan) -> list[str]:
    """Where each collective of ``plan`` comes from (``Collective.key.source``), in program order."""
    return [c.key.source for c, _ in plan.collectives]


def declared(dist: autopar.DistributedProgram, name: str):
    """The pass object named ``name`` in ``dist``'s pipeline (its declared stages and options)."""
    (found,) = [p for p in dist.passes.passes if p.name == name]
    return found


def assert_declared_emit_stage(dist: autopar.DistributedProgram, name: str, rank: int = 0) -> None:
    """The pass ``name`` needs what the rank program (or the compile state) has before it and
    adds the stage it declares, as the last stage of the rank program after it."""
    p = declared(dist, name)
    before, after = around(dist, name, rank)
    assert p.emit_ensures and p.emit_ensures not in before.stages
    assert after.stages == (*before.stages, p.emit_ensures)
