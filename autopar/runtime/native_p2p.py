"""SEND / RECV actions lowered to Paddle's p2p ops for the native backend (stage: runtime).

NCCL's send / recv deliver each link's messages in order, and a recv blocks: the ranks'
executable schedules must take every link's messages in the order they are sent. The compiler
builds every rank plan so (:meth:`~autopar.rank_plan.RankPlan.in_link_order`);
:func:`native_transfer_order` puts any lists so (:func:`~autopar.pipeline_lowering.in_link_order`)
and checks all ranks together (:func:`~autopar.pipeline_lowering.verify_links` with ``fifo``)
before anything runs. :func:`transfer_program` makes each transfer one small program, as Paddle's own static
auto-parallel emits them (``paddle/distributed/auto_parallel/static/reshard_funcs/
same_status_reshard_func.py``): ``pd_op.send_v2`` reading the sent value from the rank's scope by
name, or ``pd_op.recv_v2`` writing the received one under its name, on the pair's communicator
(``ring_id``) with the peer's index in it.

Paddle 3.3.1's CPU build has no kernel for these ops ("Do not support send for cpu kernel now",
PADDLE_NOTES.md): on CPU a pipeline runs on the host backend, whose links deliver in order too;
these programs are built and checked against the installed Paddle's op signatures
(``tests/unit/test_native_p2p.py``), not run.
:class:`~autopar.runtime.native_pipeline_runner.NativePipelineRunner` walks a schedule with them
(built and checked on CPU; the Executor does not pick it yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.errors import AutoparError
from autopar.pipeline_lowering import RECV, SEND, RankAction, in_link_order, verify_links
from autopar.rank_plan import RankPlan


def native_transfer_order(schedules: Mapping[int, Sequence[RankAction]]) -> dict[int, tuple[RankAction, ...]]:
    """Every rank's executable schedule with its recvs in link order, checked as an in-order,
    blocking transport needs (raises :class:`~autopar.errors.ScheduleError` otherwise)."""
    ordered = in_link_order(schedules)
    verify_links(ordered, fifo=True)
    return ordered


def transfer_program(plan: RankPlan, action: RankAction, scope_name: str) -> Any:
    """The program running ``action`` (a SEND or RECV of ``plan``'s schedule) on Paddle's p2p
    ops: a send of the scope variable ``scope_name``, or a recv into it. The value's local
    shape and dtype are those of the rank program's own transfer op."""
    import paddle

    if action.kind not in (SEND, RECV):  # (an ActionKind: what the action does, not a collective's kind)
        raise AutoparError(f"rank {plan.rank}: {action} is no transfer; only SEND and RECV lower to p2p ops")
    transfer = action.transfer
    pair = (transfer.sender, transfer.receiver)
    ring = plan.rings.get(pair)
    if ring is None:
        raise AutoparError(f"rank {plan.rank}: no communicator for the pair of {transfer}")
    peer = pair.index(transfer.receiver if action.kind is SEND else transfer.sender)  # its index in the ring (native.create_rings)
    op = plan.program.global_block().ops[plan.pipeline.pieces[action.piece].ops[0]]
    value = op.operand_source(0) if action.kind is SEND else op.result(0)
    shape, dtype = list(value.shape), value.dtype
    program = paddle.static.Program()
    with paddle.static.program_guard(program):
        if action.kind is SEND:
            sent = paddle.static.data(scope_name, shape, dtype)
            sent.persistable = True  # read from the scope, not fed
            paddle._C_ops.send_v2(sent, ring, peer, True, False)
        else:
            received = paddle._C_ops.recv_v2(shape, dtype, peer, ring, True, False)
            paddle._pir_ops.set_persistable_value(received, scope_name)
    return program
