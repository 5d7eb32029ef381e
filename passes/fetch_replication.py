"""Fetch replication: values the user fetches are made whole on every rank inside the program
(stage: comm-fused -> fetches-placed; per rank, for the fetch list the Executor asks for).

A fetched value lies as its producer makes it: a loss is a pending sum under data
parallelism, an activation a batch shard. Gathering the pieces after the step through an
object exchange costs a round trip through the job's store per step (measured: 50x the step
of a small model) and the store keeps every step's bytes. Instead, the cheapest reshard to
Replicate (:func:`autopar.cost_model.plan_reshard`: an all_reduce of a scalar for a loss) is
emitted at the end of the rank program, so the step's own collectives bring back every
fetch whole: one small collective per fetch, nothing stored. Every rank must ask for the same
fetch list in the same order (they run the same script), which keys the collectives alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from autopar.collective import CollectiveKey
from autopar.cost_model import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.reshard_emission import emit_step


@dataclass(frozen=True)
class FetchReplication(Pass):
    name: ClassVar[str] = "fetch_replication"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted",)
    emit_ensures: ClassVar[str] = "fetches-placed"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        with paddle.static.program_guard(rp.program):
            paddle.pir.reset_insertion_point_to_end()
            for index, key in enumerate(rp.fetches):
                if state.pipeline is not None:
                    return  # a pipeline's fetches are added up over micro-batches by its runner
                rp.fetched[key] = _replicate(state, rp, index, key)
            paddle.pir.reset_insertion_point_to_end()


def _replicate(state: CompileState, rp: RankProgram, index: int, key: tuple[int, int]) -> object:
    value = state.graph.values[key]
    produced = state.propagation.made(key)
    whole = DistAttr.replicated(produced.mesh, len(value.shape))
    plan = plan_reshard(produced, whole, value.shape, value.dtype, state.cluster)
    current = rp.produced(key)
    reason = f"fetched {value.label} is {produced}: made whole on every rank at the end of the step"
    for number, step in enumerate(plan.steps):
        current = emit_step(state, rp, step, current, value, reason, CollectiveKey("fetch", index, number))
    return current
