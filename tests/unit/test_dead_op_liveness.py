"""Which ops the dead-op rewrite removes (autopar/rewrites/dead_ops.py)."""

from __future__ import annotations

import paddle

import autopar
from autopar.graph import ProgramGraph
from autopar.rewrites.dead_ops import dead_ops


def _program(build, train: bool = True):
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        h = paddle.nn.Linear(8, 8)(x)
        build(h)
        loss = paddle.mean(h)
        if train:
            paddle.optimizer.SGD(0.1).minimize(loss)
    return main


def _removed(main) -> list[str]:
    pruned = dead_ops(main, ProgramGraph(main))
    return [] if pruned is None else [op.split("#")[0] for op in pruned.removed]


def test_a_dead_chain_goes_whole_and_the_loss_stays():
    main = _program(lambda h: paddle.sqrt(paddle.abs(paddle.tanh(h))))
    assert _removed(main) == ["pd_op.tanh", "pd_op.abs", "pd_op.sqrt"]


def test_a_forward_only_program_keeps_everything():
    """Without a backward every result may be what the user fetches."""
    assert _removed(_program(lambda h: paddle.tanh(h), train=False)) == []


def test_random_and_in_place_ops_stay():
    """A dead random draw still advances the generator the later draws read (removing it would
    change them); an in-place op may write what it reads."""

    def build(h):
        paddle.nn.functional.dropout(h, 0.5)
        paddle.uniform([4], min=0.0, max=1.0)
        paddle.assign(h * 2.0, output=h)

    removed = _removed(_program(build))
    assert not {"pd_op.dropout", "pd_op.uniform", "pd_op.assign_out_"} & set(removed), removed


def test_a_kept_value_stays_with_what_makes_it():
    kept = []
    main = _program(lambda h: kept.append(paddle.exp(paddle.tanh(h))))
    autopar.keep(kept[0])
    from autopar.annotate import annotations_of

    assert dead_ops(main, ProgramGraph(main), frozenset(annotations_of(main).keep)) is None
