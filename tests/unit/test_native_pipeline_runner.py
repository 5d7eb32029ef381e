"""The native backend's pipeline runner (autopar/runtime/native_pipeline_runner.py) walks the
rank plan's schedule with Paddle's p2p ops for its transfers: its dispatch table maps SEND /
RECV to the transfer programs, one per action, on the pair's communicator with the peer's
index, the value's local shape and the scope name of its micro-batch's job; the programs are
in the order the links carry the messages. Built, not run: Paddle's CPU build has no send /
recv kernel (measured here), and on CPU a pipeline stays on the host backend."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.pipeline_lowering import RECV, SEND
from autopar.runtime.native_p2p import native_transfer_order
from autopar.runtime.native_pipeline_runner import NativePipelineRunner
from autopar.runtime.pipeline_runner import PipelineRunner
from autopar.testing.pipeline_models import staged_mlp

pytestmark = pytest.mark.filterwarnings("ignore")
PP = autopar.ProcessMesh([0, 1], ["pp"])


@pytest.fixture(scope="module")
def dist():
    seed = staged_mlp(PP, optimizer="sgd")
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, schedule="1F1B"))
    return autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)


@pytest.fixture(scope="module")
def runners(dist):
    return {rank: NativePipelineRunner(dist.rank_plan(rank), []) for rank in PP.ranks}


def _p2p_op(program):
    made = [op for op in program.global_block().ops if op.name() in ("pd_op.send_v2", "pd_op.recv_v2")]
    assert len(made) == 1, program
    return made[0]


def test_send_and_recv_dispatch_to_the_transfer_programs(runners):
    for runner in runners.values():
        assert runner.handlers[SEND] == runner._transfer and runner.handlers[RECV] == runner._transfer
        host = PipelineRunner(runner.plan, [])  # every other kind as the host runner runs it
        assert {k for k in runner.handlers} == {k for k in host.handlers}
        assert all(runner.handlers[k].__func__ is host.handlers[k].__func__ for k in host.handlers if k not in (SEND, RECV))
        transfers = [(a.piece, a.micro_batch) for a in runner.role.steps if a.kind in (SEND, RECV)]
        assert transfers and sorted(transfers) == sorted(runner.transfers)  # one program per transfer action


@pytest.mark.parametrize("rank", [0, 1])
def test_each_program_has_the_peer_ring_and_shape_of_its_transfer(runners, rank):
    runner = runners[rank]
    plan = runner.plan
    ops = list(plan.program.global_block().ops)
    for action in (a for a in runner.role.steps if a.kind in (SEND, RECV)):
        program = runner.transfers[(action.piece, action.micro_batch)]
        op, attrs = _p2p_op(program), _p2p_op(program).attrs()
        pair = (action.transfer.sender, action.transfer.receiver)
        peer = action.transfer.receiver if action.kind is SEND else action.transfer.sender
        assert attrs["ring_id"] == plan.rings[pair] and attrs["peer"] == pair.index(peer) and peer != rank
        own = ops[plan.pipeline.pieces[action.piece].ops[0]]  # the rank program's own transfer op
        name = runner._scope_name(action)
        if action.kind is SEND:
            assert op.name() == "pd_op.send_v2" and list(op.operand_source(0).shape) == list(own.operand_source(0).shape)
        else:
            assert op.name() == "pd_op.recv_v2" and attrs["out_shape"] == list(own.result(0).shape)
        assert f'"{name}"' in str(program)  # the scope variable of its micro-batch's job, by name
    names = {runner._scope_name(a) for a in runner.role.steps if a.kind in (SEND, RECV)}
    assert len(names) == len(runner.transfers)  # each micro-batch's transfer has its own scope name


def test_the_programs_run_in_link_order(runners):
    steps = {rank: runner.role.steps for rank, runner in runners.items()}
    assert native_transfer_order(steps) == steps
    sent = [a.transfer for a in steps[0] if a.kind is SEND]
    received = [a.transfer for a in steps[1] if a.kind is RECV]
    assert sent == received and sent


def test_the_host_path_stays_on_cpu(dist, runners):
    plan = dist.rank_plan(0, "auto")
    assert plan.backend == "host"
    host = PipelineRunner(plan, [])
    assert host.handlers[SEND].__func__ is PipelineRunner._run_piece and isinstance(host.place, paddle.CPUPlace)
    runner = runners[0]
    action = next(a for a in runner.role.steps if a.kind is SEND)
    program = runner.transfers[(action.piece, action.micro_batch)]
    runner.write(runner._scope_name(action), np.zeros(list(_p2p_op(program).operand_source(0).shape), "float32"))
    with pytest.raises(Exception, match="Do not support send for cpu kernel now"):  # (PADDLE_NOTES.md)
        runner._transfer(action)
