"""The native backend's lowering of SEND / RECV actions (autopar/runtime/native_p2p.py): each
transfer of a rank's executable schedule becomes a program of Paddle's p2p op, checked here
against the installed Paddle (op names, operand and result counts, attributes, and the argument
counts Paddle's own static auto-parallel calls them with) without running it: Paddle's CPU
build has no send / recv kernel. The ranks' schedules are in link order, as an in-order,
blocking transport needs (the compiler builds the rank plans so)."""

import ast
import dataclasses
import inspect
from pathlib import Path

import paddle
import pytest

import autopar
from autopar.errors import AutoparError, ScheduleError
from autopar.pipeline_lowering import RECV, SEND, verify_links
from autopar.runtime.host_plan import build_host_plan
from autopar.runtime.native_p2p import native_transfer_order, transfer_program
from autopar.testing.pipeline_models import residual_cut_inside

pytestmark = pytest.mark.filterwarnings("ignore")
PP = autopar.ProcessMesh([0, 1], ["pp"])


@pytest.fixture(scope="module")
def plans():
    seed = residual_cut_inside(PP)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, schedule="1F1B"))
    dist = autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)
    return {rank: dist.rank_plan(rank) for rank in PP.ranks}


def _paddle_calls(name: str) -> list[ast.Call]:
    """How Paddle's own static auto-parallel emits ``name`` (the installed sources)."""
    source = Path(inspect.getfile(paddle.distributed)).parent / "auto_parallel" / "static" / "reshard_funcs" / "same_status_reshard_func.py"
    return [
        node for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == name
    ]  # fmt: skip


def test_paddle_emits_its_p2p_ops_with_the_arities_we_call():
    sends, recvs = _paddle_calls("send_v2"), _paddle_calls("recv_v2")
    assert sends and all(len(call.args) == 5 for call in sends)  # (x, ring_id, peer, use_calc_stream, dynamic_shape)
    assert recvs and all(len(call.args) == 6 for call in recvs)  # (out_shape, dtype, peer, ring_id, use_calc_stream, dynamic_shape)


def _lowered(plan):
    """``plan``'s schedule lowered anew (no steps: the plan lowers it), before the link order."""
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, steps=())).pipeline.steps


def test_the_native_order_puts_every_link_in_order(plans):
    lowered = {rank: _lowered(plan) for rank, plan in plans.items()}
    with pytest.raises(ScheduleError, match="in-order link"):  # (a residual cut crosses mid-phase: not as lowered)
        verify_links(lowered, fifo=True)
    built = {rank: plan.pipeline.steps for rank, plan in plans.items()}
    assert native_transfer_order(built) == built  # (the compiler built the plans in link order)
    with pytest.raises(ScheduleError, match="deadlock"):  # (checked before anything runs)
        native_transfer_order({0: lowered[0], 1: lowered[1][::-1]})
    ordered = native_transfer_order(lowered)
    for link in ((0, 1), (1, 0)):
        sent = [a.transfer for a in ordered[link[0]] if a.kind is SEND and a.transfer.receiver == link[1]]
        received = [a.transfer for a in ordered[link[1]] if a.kind is RECV and a.transfer.sender == link[0]]
        assert sent == received and sent


@pytest.mark.parametrize("rank", [0, 1])
def test_each_transfer_lowers_to_one_p2p_op_of_the_installed_signature(plans, rank):
    plan = plans[rank]
    host = build_host_plan(plan)
    transfers = [a for a in plan.pipeline.steps if a.transfer is not None and a.micro_batch == 0]
    assert {a.kind for a in transfers} == {SEND, RECV}
    ops = list(plan.program.global_block().ops)
    for action in transfers:
        job = host.jobs[host.jobs_of[action.piece][0]]
        name = job.input if action.kind is SEND else job.output
        program = transfer_program(plan, action, name)
        made = [op for op in program.global_block().ops if op.name() in ("pd_op.send_v2", "pd_op.recv_v2")]
        assert len(made) == 1, program
        op, attrs = made[0], made[0].attrs()
        pair = (action.transfer.sender, action.transfer.receiver)
        assert attrs["ring_id"] == plan.rings[pair] and attrs["use_calc_stream"] and not attrs["dynamic_shape"]
        own = ops[plan.pipeline.pieces[action.piece].ops[0]]
        if action.kind is SEND:
            assert op.name() == "pd_op.send_v2" and (op.num_operands(), op.num_results()) == (1, 0)
            assert attrs["peer"] == 1 and list(op.operand_source(0).shape) == list(own.operand_source(0).shape)
            assert f'name:"{name}"' in str(program)  # the sent value read from the scope by its name
        else:
            assert op.name() == "pd_op.recv_v2" and (op.num_operands(), op.num_results()) == (0, 1)
            assert attrs["peer"] == 0 and attrs["out_shape"] == list(own.result(0).shape)
            assert attrs["dtype"] == own.result(0).dtype
            assert f'"{name}"' in str(program)  # written into the scope under its name


def test_only_transfers_lower_to_p2p_ops(plans):
    compute = next(a for a in plans[0].pipeline.steps if a.transfer is None)
    with pytest.raises(AutoparError, match="only SEND and RECV lower to p2p ops"):
        transfer_program(plans[0], compute, "x")
