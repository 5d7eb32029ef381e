"""Sub-meshes: each rank keeps its own ops, and views become plain reads (stage: comm-inserted
-> sub-mesh-split).

An op placed on a sub-mesh that is no pipeline stage (an expert's layers, one copy of an
``autopar.local_map``: autopar/sub_meshes.py) runs on the ranks of that sub-mesh only: on any
other rank it is erased, with the parameters and constants only it read. A view — a split of a
value into the pieces its shards are, a concat or sum of such pieces — moves no data: on each
rank the piece it holds IS its local value, so the readers of the piece read the value (a
split), or the readers of the joined value read the piece (a join), and the view op is erased.
Under a pipeline the sub-meshes are a stage's (``split_mesh(mesh, "ep")[i]`` on a ``pp x ep``
mesh is, on stage ``s``, the ranks of ``mesh[s]`` at ``ep == i``): this pass runs before the
pipeline split and keeps to the rank's own stage; the other stages' ops are the split's to erase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.errors import AutoparError
from autopar.graph import VECTOR_OPS
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_OPS, SOURCE_OPS
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.sub_meshes import View, find_views, local_region_ops, stage_container


@dataclass(frozen=True)
class SubMeshes(Pass):
    name: ClassVar[str] = "sub_meshes"
    plan_requires: ClassVar[tuple[str, ...]] = ("reshard-planned",)
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted",)
    emit_ensures: ClassVar[str] = "sub-mesh-split"

    def plan(self, state: CompileState) -> None:
        """Refuse a collective inside an ``autopar.local_map`` copy (its ops and their grad ops)."""
        graph = state.graph
        local = local_region_ops(graph)
        if not local:
            return
        for planned in state.reshards:
            moving = [step for step in planned.plan.steps if not step.kind.is_local]
            if planned.need.op in local and moving:
                need = planned.need
                raise AutoparError(
                    f"autopar.local_map: {graph.ops[need.op]} inside fn reads {graph.values[need.value].label} as {need.need} "
                    f"but it is {need.have}: that needs a {moving[0].kind} inside the local region; fn runs on each "
                    "rank's shards with no collective (give its inputs the placements fn reads, in in_placements)"
                )

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        op_meshes = state.propagation.op_meshes
        where = {key: state.propagation.dist(key).mesh for key in state.graph.tensor_keys() if key in state.propagation.states}
        pipelined = state.pipeline is not None

        def mine(mesh: ProcessMesh) -> bool:
            """Of this rank's stage (under a pipeline; the other stages' ops are the pipeline split's to erase)."""
            return not pipelined or rp.rank in stage_container(state.mesh, mesh).ranks

        views = {i: v for i, v in find_views(state.graph, state.mesh, where, op_meshes).items() if mine(op_meshes[i])}
        if not views and all(rp.rank in mesh.ranks or not mine(mesh) for mesh in op_meshes.values()):
            return
        for view in views.values():
            _read_through(state, rp, view)
        serial = {op.id(): index for index, op in enumerate(rp.ops) if op is not None}

        def elsewhere(index: int) -> bool:
            mesh = op_meshes.get(index, state.mesh)
            return rp.rank not in mesh.ranks and mine(mesh)

        gone = {op.id() for op in rp.ops if op is not None and (serial[op.id()] in views or elsewhere(serial[op.id()]))}
        _erase(state, rp, gone, serial)


def _operand(state: CompileState, rp: RankProgram, op_index: int, slot: int) -> Any:
    """The rank program's operand of serial op ``op_index`` at input ``slot`` (a vector member:
    of its builtin.combine)."""
    site_op, position = state.graph.ops[op_index].sites[slot]
    return rp.ops[site_op].operand_source(position)


def _read_through(state: CompileState, rp: RankProgram, view: View) -> None:
    """On ``rp``'s rank, the readers of the view's result read what it holds already."""
    mine = next((j for j, sub in enumerate(view.meshes) if rp.rank in sub.ranks), None)
    if mine is None:
        raise AutoparError(f"rank {rp.rank} holds no piece of {state.graph.ops[view.op]} (its sub-meshes: {', '.join(map(str, view.meshes))})")
    op = state.graph.ops[view.op]
    if view.splits:
        held, made = _operand(state, rp, view.op, view.whole), rp.produced(op.outputs[view.pieces[mine]])
    else:
        held, made = _operand(state, rp, view.op, view.pieces[mine]), rp.produced(op.outputs[view.whole])
    made.replace_all_uses_with(held)


def _erase(state: CompileState, rp: RankProgram, gone: set[int], serial: dict[int, int]) -> None:
    """Erase the ops in ``gone`` and the plumbing, parameters and constants nothing reads then
    (last first); a kept op reading an erased one's result is named."""
    ops = list(rp.program.global_block().ops)
    for op in reversed(ops):
        name = op.name()
        unread = all(not r.initialized() or r.use_empty() for r in op.results())
        plumbing = name in VECTOR_OPS or name in SOURCE_OPS or (name in CONSTANT_OPS and op.num_operands() == 0)
        if op.id() in gone or (plumbing and unread and op.id() in serial):
            if not unread:
                reader = next(u for r in op.results() if r.initialized() for u in r.all_used_ops())
                index = serial.get(op.id())
                raise AutoparError(
                    f"rank {rp.rank}: {reader.name()} reads a result of {state.graph.ops[index] if index is not None else name}, "
                    "which runs on a sub-mesh without this rank"
                )
            index = serial.get(op.id())
            if index is not None:
                rp.ops[index] = None
            op.erase()
