"""Backend lowering for the native backend: collectives the backend lacks become ones it has
(stage: comm-fused -> lowered).

The host form of a rank program carries one op per planned collective, typed to the exact
local result; the host runtime performs them from their :class:`Collective` values. The
native backend runs the program itself, so each collective must be a real Paddle op with
Paddle's semantics:

- ``all_gather`` concatenates on dim 0: along another dim it becomes all_gather + split +
  concat; uneven pieces are refused (NCCL / gloo gather equal sizes).
- ``reduce_scatter`` (no CPU kernel; gloo has none) becomes all_reduce + this rank's slice.
- ``all_to_all`` (no CPU kernel) becomes the gather along its source dim + this rank's slice
  along its target dim.
- an average (``all_reduce`` / ``reduce_scatter`` of a Partial(avg), e.g. a fetched accuracy
  of data-parallel pieces) becomes a sum scaled by 1/n: gloo has no average ("Unsupported
  reduce type: 4" in the step), NCCL's needs NCCL >= 2.10; the scale costs one tiny op.
For the host backend the pass leaves the program as it is (the runtime runs the values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.collective_kinds import KINDS
from autopar.errors import NativeUnsupported
from autopar.passes.base import CompileState, Pass, RankProgram


@dataclass(frozen=True)
class BackendLowering(Pass):
    name: ClassVar[str] = "backend_lowering"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted",)
    emit_ensures: ClassVar[str] = "lowered"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        if rp.backend == "native" and state.pipeline is not None:
            raise NativeUnsupported(
                "native backend: a pipeline's send / recv and its schedule run on the host backend "
                "(static gloo programs have no send / recv kernel); use backend='host' or 'auto'"
            )
        if rp.backend == "native":
            lower_for_native(rp, state.mesh.size)


def lower_for_native(rp: RankProgram, world: int) -> None:
    """Rewrite ``rp``'s collectives in place so all run as Paddle ops on a gloo/NCCL ring."""
    import paddle

    for collective, _ in rp.collectives:
        if sorted(collective.group) != list(range(world)) and paddle.is_compiled_with_cuda() is False:
            raise NativeUnsupported(
                f"native backend on CPU: {collective.kind} over ranks {list(collective.group)} does not span the world "
                "(gloo runs one communicator per process); use the host backend"
            )
    ops = {op.id(): op for op in rp.program.global_block().ops}
    lowered = []
    with paddle.static.program_guard(rp.program):
        for collective, op_id in rp.collectives:
            op = ops[op_id]
            paddle.pir.set_insertion_point(op)
            new = KINDS[collective.kind].native_op(collective, op.operand_source(0), rp.rings[collective.group], rp.rank)
            if new is None:  # the host op runs natively as it is
                lowered.append((collective, op_id))
                continue
            new.set_type(paddle.pir.create_shaped_type(op.result(0).type(), list(collective.output_shape)))
            old = op.result(0)
            old.replace_all_uses_with(new)
            _repoint(rp, old, new)
            op.erase()
            lowered.append((collective, new.get_defining_op().id()))
        paddle.pir.reset_insertion_point_to_end()
    rp.collectives[:] = lowered


def _repoint(rp: RankProgram, old: Any, new: Any) -> None:
    """Records that name the replaced result (a fetch made whole, a reshard's result) name its
    replacement: the erased op's value would be a dangling reference."""
    for table in (rp.fetched, rp.final, rp.resharded, rp.replaced):
        for key, value in table.items():
            if value.is_same(old):
                table[key] = new
