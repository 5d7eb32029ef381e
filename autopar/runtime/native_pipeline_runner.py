"""NativePipelineRunner: a pipelined rank's schedule walked with Paddle's p2p ops for its
transfers (stage: runtime; the native backend's pipeline runner, for GPUs).

The same walk as :class:`~autopar.runtime.pipeline_runner.PipelineRunner` (one dispatch table
keyed by the action's kind, the rank plan's actions in their order), with one difference: its
``SEND`` / ``RECV`` handlers run the action's transfer program
(:func:`~autopar.runtime.native_p2p.transfer_program`: ``pd_op.send_v2`` reading the sent value
from the rank's scope by name, ``pd_op.recv_v2`` writing the received one under its name, on the
pair's communicator) instead of handing the transfer to a host communicator. NCCL's send / recv
are in order and blocking: the rank plan's recvs are in link order already (the compiler builds
every plan so, :meth:`~autopar.rank_plan.RankPlan.in_link_order`, checked against its peers'
lists), so walking the list in order is walking it in the order the links carry the messages.

The transfer programs are built with the runner, one per transfer action and micro-batch, not
at run time. Paddle 3.3.1's CPU build has no kernel for these ops (PADDLE_NOTES.md; measured
again by ``tests/unit/test_native_pipeline_runner.py``): on CPU pipelines run on the host
backend (``rank_plan(rank, "auto")``); this runner is built and its programs checked there, and
runs where NCCL does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.errors import AutoparError
from autopar.pipeline_lowering import RECV, SEND, TRANSFER_KINDS, RankAction
from autopar.rank_plan import RankPlan, ValueKey
from autopar.runtime.jobs import Segment
from autopar.runtime.native_p2p import transfer_program
from autopar.runtime.pipeline_runner import PipelineRunner


class NativePipelineRunner(PipelineRunner):
    def __init__(self, plan: RankPlan, fetch_keys: Sequence[ValueKey], scope: Any = None, capture: bool = False) -> None:
        super().__init__(plan, fetch_keys, scope, capture)
        self.transfers: dict[tuple[int, int], Any] = {}  # (piece, micro-batch) -> its p2p program
        for action in self.role.steps:
            if action.kind in TRANSFER_KINDS:
                self.transfers[(action.piece, action.micro_batch)] = transfer_program(plan, action, self._scope_name(action))
        self.handlers = self.handlers | {SEND: self._transfer, RECV: self._transfer}

    def _scope_name(self, action: RankAction) -> str:
        """The scope variable the transfer reads (SEND) or writes (RECV): its job's, in the host
        plan of the action's micro-batch (each micro-batch's values have their own names)."""
        host = self.hosts[action.micro_batch]
        jobs = host.jobs_of.get(action.piece, ())
        if len(jobs) != 1 or isinstance(host.jobs[jobs[0]], Segment):
            raise AutoparError(f"rank {self.plan.rank}: {action} runs {len(jobs)} jobs; a transfer's piece is its one p2p op")
        job = host.jobs[jobs[0]]
        return job.input if action.kind is SEND else job.output

    def _transfer(self, action: RankAction) -> None:
        """Run the action's p2p program (a feed sent is written into the scope first: the
        program reads it by name); the runner's driver performs nothing for it."""
        host, k = self.hosts[action.micro_batch], action.micro_batch
        job = host.jobs[host.jobs_of[action.piece][0]]
        if action.kind is SEND and job.from_feed:
            self.write(job.input, self.micro_feeds[k][job.input])
        self.run_program(("p2p", action.piece, k), self.transfers[(action.piece, k)], {})
        self._stash(action)
