"""Per-op lowerings are declared by rules and walked by one pass (issue 37 item 2): the rules of
embedding / softmax / cross-entropy, batch_norm, dropout and cumsum declare theirs
(autopar/spmd/lowering.py), ``spmd.lowerings()`` lists them in their declared order, and
passes/op_lowering.py runs every one through the same scaffold (which ops, which ranks, the
program guard), each lowering adding only an emitter."""

from __future__ import annotations

import paddle
import pytest

import autopar
from autopar.passes import op_lowering
from autopar.spmd import get_rule, lowerings
from autopar.spmd.batch_norm import BATCH_STATISTICS
from autopar.spmd.dropout import DROPOUT_SLICES
from autopar.spmd.lowering import Lowering
from autopar.spmd.registry import register_rule
from autopar.spmd.scan import SCAN_CARRIES
from autopar.spmd.vocab_parallel import VOCAB_ROWS


def test_the_rules_declare_the_lowerings_and_each_has_an_emitter():
    assert lowerings() == (VOCAB_ROWS, BATCH_STATISTICS, DROPOUT_SLICES, SCAN_CARRIES)
    for op in ("embedding", "embedding_grad", "softmax", "log_softmax_grad", "cross_entropy_with_softmax"):
        assert get_rule(op).lowering is VOCAB_ROWS, op
    assert get_rule("batch_norm_").lowering is get_rule("batch_norm_grad").lowering is BATCH_STATISTICS
    assert get_rule("dropout").lowering is DROPOUT_SLICES and get_rule("dropout_grad").lowering is None
    assert get_rule("cumsum").lowering is get_rule("cumsum_grad").lowering is SCAN_CARRIES
    assert set(op_lowering.EMITTERS) == {lowering.name for lowering in lowerings()}


def test_a_rule_cannot_declare_two_lowerings():
    rule = get_rule("dropout")
    other = Lowering("other", "other-done", order=9, match=lambda site: None)
    with pytest.raises(ValueError, match="already declares the lowering dropout_slicing, not other"):
        register_rule(rule, lowering=other)


def _dropout_program():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 3
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 16], "float32")
        h = paddle.nn.functional.dropout(paddle.nn.Linear(16, 16)(x), 0.5, training=True)
        loss = paddle.mean(h)
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup, x


def test_one_pass_runs_the_lowerings_and_their_stages():
    main, startup, x = _dropout_program()
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    dist = autopar.compile(main, mesh, startup_program=startup)
    assert "op_lowering()" in str(dist.passes)
    assert not any(name in dist.passes.names() for name in ("vocab_parallel", "batch_norm_stats", "dropout_slicing"))
    for rank in (0, 1):
        ops = dist.rank_plan(rank).program.global_block().ops
        (dropout,) = [o for o in ops if o.name() == "pd_op.dropout"]
        # the mask drawn over the serial shape (rank's rows: 4 of 8), this rank's box of it applied
        assert list(dropout.operand_source(0).shape) == [8, 16]
        assert any(o.name() == "pd_op.slice" for o in ops) and any(o.name() == "pd_op.multiply" for o in ops)


def test_without_an_emitter_the_pass_refuses_by_name(monkeypatch):
    main, startup, x = _dropout_program()
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(x, mesh, ["dp", None])
    monkeypatch.delitem(op_lowering.EMITTERS, "dropout_slicing")
    with pytest.raises(autopar.AutoparError, match=r"rules declare the lowerings \['dropout_slicing'\] but .* no emitter"):
        autopar.compile(main, mesh, startup_program=startup)
