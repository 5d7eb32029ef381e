"""passes/vocab_parallel.py: ops whose local kernel is wrong on a split row (an embedding over a
vocabulary-split table, softmax and cross-entropy over class-split logits) become what each rank
must compute (stage: comm-inserted -> rows-rewritten). Read from the rank program the compile
produces, so these hold whichever pass makes it. (Equal to serial:
tests/equivalence/test_vocab_parallel.py.)"""

import paddle
from pass_programs import count, op_names, parameter_shapes

import autopar
from autopar.testing.models import make_optimizer


def _compile(build):
    """``build(mesh)`` inside a fresh program pair, returning the loss; compiled on mp = 2."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    mesh = autopar.ProcessMesh([0, 1], ["mp"])
    with paddle.static.program_guard(main, startup):
        make_optimizer("sgd").minimize(build(mesh))
    return main, autopar.compile(main, mesh, startup_program=startup)


def _class_split_head(mesh):
    x, y = paddle.static.data("x", [4, 8], "float32"), paddle.static.data("y", [4, 1], "int64")
    head = paddle.nn.Linear(8, 10)
    autopar.shard_tensor(head.weight, mesh, [None, "mp"])
    autopar.shard_tensor(head.bias, mesh, ["mp"])
    return head(x), y


def test_cross_entropy_over_class_split_logits_gathers_three_values_per_row():
    def build(mesh):
        logits, y = _class_split_head(mesh)
        return paddle.mean(paddle.nn.functional.cross_entropy(logits, y))

    main, dist = _compile(build)
    serial = [op.name() for op in main.global_block().ops]
    assert "pd_op.cross_entropy_with_softmax" in serial
    for rank in (0, 1):
        plan = dist.rank_plan(rank)
        assert (
            count(plan, "pd_op.cross_entropy_with_softmax") == count(plan, "pd_op.cross_entropy_with_softmax_grad") == 0
        )
        ((gather, _),) = plan.collectives  # each rank's max, sum of exponentials and target logit, per row
        assert gather.kind == "all_gather" and gather.group == (0, 1) and gather.output_shape == (4, 3 * 2)


def test_softmax_over_a_split_axis_all_reduces_one_value_per_row():
    def build(mesh):
        logits, _ = _class_split_head(mesh)
        return paddle.mean(paddle.square(paddle.nn.functional.softmax(logits)))

    _, dist = _compile(build)
    plan = dist.rank_plan(0)
    assert count(plan, "pd_op.softmax") == count(plan, "pd_op.softmax_grad") == 0
    rows = [(c.kind, c.reduce, c.output_shape) for c, _ in plan.collectives]
    assert rows == [("all_reduce", "max", (4, 1)), ("all_reduce", "sum", (4, 1)), ("all_reduce", "sum", (4, 1))]


def test_an_embedding_over_a_row_split_table_looks_up_its_own_rows():
    tables = []

    def build(mesh):
        ids = paddle.static.data("ids", [4, 8], "int64")
        table = paddle.nn.Embedding(32, 16)
        tables.append(table.weight.name)
        autopar.shard_tensor(table.weight, mesh, ["mp", None])
        return paddle.mean(paddle.nn.Linear(16, 4)(table(ids)))

    main, dist = _compile(build)
    serial = {op.name() for op in main.global_block().ops}
    plan = dist.rank_plan(1)
    assert parameter_shapes(plan.program)[tables[0]] == [16, 16]  # half the rows, never gathered
    masking = {"pd_op.greater_equal", "pd_op.less_than", "pd_op.where"}  # ids outside the rank's rows read as 0
    assert masking <= set(op_names(plan)) - serial
    assert [(c.kind, c.reduce) for c, _ in plan.collectives] == [("all_reduce", "sum")] * 2  # forward, backward
