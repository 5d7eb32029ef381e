"""The per-op lowerings the rules declare, run in every rank's program (stage: comm-inserted ->
lowered).

A rule whose kept split Paddle's kernel cannot run on the local piece declares a
:class:`~autopar.spmd.lowering.Lowering` (vocabulary-parallel rows, batch statistics over a
split batch, dropout slicing, a scan's carry between shards). This one pass walks them all
(:func:`lowered_ops`): at compile time it records the mesh dims of the collectives they will emit; per rank it sets the insertion
point at each matched op of the rank's program and calls the lowering's emitter
(:data:`EMITTERS`), which replaces the op by what that rank must compute. The emitters emit
planned reshards (:func:`~autopar.passes.reshard_emission.emit_step`), so they live beside the
passes, not with the rules; a lowering a rule declares without an emitter is refused.

Runs after reshard emission: an op's operands are then final (resharded where its rule
required), and the readers of its results (reshards included) are rewired to the new values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.errors import AutoparError
from autopar.graph import OpNode
from autopar.passes import batch_norm_stats, dropout_slicing, scan_carry, vocab_parallel
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.lowered_ops import lowered_ops
from autopar.passes.results import LoweringGroups
from autopar.spmd.batch_norm import BATCH_STATISTICS
from autopar.spmd.dropout import DROPOUT_SLICES
from autopar.spmd.registry import lowerings
from autopar.spmd.scan import SCAN_CARRIES
from autopar.spmd.vocab_parallel import VOCAB_ROWS

Emitter = Callable[[CompileState, RankProgram, OpNode, Any], None]

# lowering name -> what one rank's program gets in place of a matched op (inside the program guard;
# each emitter sets its insertion point: before the op, or after it for the local-statistics average)
EMITTERS: dict[str, Emitter] = {
    VOCAB_ROWS.name: vocab_parallel.rewrite,
    BATCH_STATISTICS.name: batch_norm_stats.rewrite,
    DROPOUT_SLICES.name: dropout_slicing.rewrite,
    SCAN_CARRIES.name: scan_carry.rewrite,
}


@dataclass(frozen=True)
class OpLowering(Pass):
    """Every lowering the registry declares, in their order; the rank program then has each
    lowering's stage (``rows-rewritten``, ``statistics-rewritten``, ``dropout-sliced``) and
    ``ops-lowered``."""

    name: ClassVar[str] = "op_lowering"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    emit_requires: ClassVar[tuple[str, ...]] = ("partitioned", "comm-inserted")
    emit_ensures: ClassVar[str] = "ops-lowered"

    def plan(self, state: CompileState) -> LoweringGroups:
        missing = [lowering.name for lowering in lowerings() if lowering.name not in EMITTERS]
        if missing:
            raise AutoparError(f"rules declare the lowerings {missing} but autopar.passes.op_lowering has no emitter for them")
        groups = {tuple(lowering.group(decision)) for lowering, _, decision in lowered_ops(state) if lowering.group is not None}
        return LoweringGroups(frozenset(groups))

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        with paddle.static.program_guard(rp.program):
            for lowering, op, decision in lowered_ops(state):
                if rp.rank in state.propagation.op_meshes.get(op.index, state.mesh).ranks and rp.ops[op.index] is not None:
                    EMITTERS[lowering.name](state, rp, op, decision)
            paddle.pir.reset_insertion_point_to_end()
        rp.stages.extend(lowering.ensures for lowering in lowerings())
