"""Global-norm clipping summed on each pipeline stage first (stage: rewrite, after the stages).

``paddle.nn.ClipGradByGlobalNorm`` stacks one squared norm per gradient and sums the stack
(``stack(norms).sum()``). In a pipeline each gradient, so its squared norm, is made on the stage
of its parameter, and the stack runs on one stage: every other stage sent it one 4-byte scalar
per parameter, per step (a 2-layer block: a dozen transfers for a few bytes each). The sum is
associative, so each stage adds its own norms first (``add_n``, placed on that stage) and the
stack reads one partial sum per stage: one transfer per stage pair and step. The clip factor
still goes back to every stage that multiplies its gradients by it (one more per pair).

The serial program sums the same numbers in another order (float rounding only). Norms whose
stage is unknown are stacked as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.causes import gradients
from autopar.graph import ProgramGraph
from autopar.mesh import ProcessMesh
from autopar.shared_parameters import reader_meshes

if TYPE_CHECKING:
    from paddle.pir import Program

NORM_OPS = ("pd_op.squared_l2_norm",)


@dataclass(frozen=True)
class StagedNorms:
    """The rewritten program and where its ops moved."""

    program: Program
    positions: tuple[int | None, ...]  # old op index -> new index (None: erased)
    meshes: Mapping[int, ProcessMesh]  # new index of each per-stage sum (and its combine) -> its stage mesh
    summed: tuple[str, ...]  # per stack: ``pd_op.stack#48: 6 norms -> 2 stage sums``

    def __str__(self) -> str:
        return f"global-norm clipping summed per stage first ({'; '.join(self.summed)})"


def norm_stages(graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> dict[int, ProcessMesh]:
    """The stage mesh of each squared-norm op: the owner stage of the parameter whose gradient
    it reads (its first forward reader's, where :func:`~autopar.shared_parameters.owner_meshes`
    puts the gradient's sum and update)."""
    made = gradients(graph)
    found: dict[int, ProcessMesh] = {}
    for op in graph.ops:
        if op.name not in NORM_OPS or not op.inputs or op.inputs[0] is None:
            continue
        gradient = made.get(op.inputs[0])
        meshes = reader_meshes(graph, gradient.param, op_meshes) if gradient is not None else []
        if meshes:
            found[op.index] = meshes[0]
    return found


def _plans(
    graph: ProgramGraph, stages: Mapping[int, ProcessMesh]
) -> dict[int, list[tuple[ProcessMesh | None, list[int]]]]:
    """Per stack of squared norms spanning several stages: its operand positions grouped by
    stage, in order of first appearance (None: a norm of unknown stage, alone)."""
    plans = {}
    for op in graph.ops:
        if (
            op.name != "pd_op.stack"
            or not op.inputs
            or any(k is None or graph.ops[k[0]].name not in NORM_OPS for k in op.inputs)
        ):
            continue
        groups: dict[Any, list[int]] = {}
        for slot, key in enumerate(op.inputs):
            mesh = stages.get(key[0])
            groups.setdefault(mesh if mesh is not None else ("alone", slot), []).append(slot)
        meshes = {m for m in groups if isinstance(m, ProcessMesh)}
        if len(meshes) > 1 and len(groups) < len(op.inputs):
            plans[op.index] = [(m if isinstance(m, ProcessMesh) else None, slots) for m, slots in groups.items()]
    return plans


def stage_norms(program: Any, graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> StagedNorms | None:
    """``program`` with each clip's squared norms added per stage before the stack (module
    docstring); None when no stack of norms spans several stages with more than one norm on
    one (``program`` is used as it is)."""
    import paddle

    plans = _plans(graph, norm_stages(graph, op_meshes))
    if not plans:
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    placed: list[tuple[Any, ProcessMesh]] = []  # new op -> its stage mesh
    erased: set[int] = set()
    summed = []
    with paddle.static.program_guard(work):
        for index, groups in plans.items():
            stack = raw[index]
            combine = stack.operand_source(0).get_defining_op()
            norms = [combine.operand_source(slot) for slot in range(combine.num_operands())]
            paddle.pir.set_insertion_point(combine)
            parts = []
            for mesh, slots in groups:
                if len(slots) == 1:
                    parts.append(norms[slots[0]])
                    continue
                part = paddle.add_n([norms[slot] for slot in slots])
                sum_op = part.get_defining_op()
                placed += [(sum_op.operand_source(0).get_defining_op(), mesh), (sum_op, mesh)]
                parts.append(part)
            stacked = paddle.stack(parts, axis=stack.attrs()["axis"])
            stack.result(0).replace_all_uses_with(stacked)
            erased |= {index, _position(raw, combine)}
            summed.append(f"{stack.name()}#{index}: {len(norms)} norms -> {len(parts)} per-stage sums")
        paddle.pir.reset_insertion_point_to_end()
    return StagedNorms(work, *erased_and_placed(work, raw, erased, placed), tuple(summed))


def erased_and_placed(
    work: Any, raw: list[Any], erased: set[int], placed: list[tuple[Any, ProcessMesh]]
) -> tuple[tuple[int | None, ...], dict[int, ProcessMesh]]:
    """Erase ops ``erased`` (indices into ``raw``, ``work``'s ops before a per-stage rewrite);
    then where each old op is now (None: erased) and the stage mesh of each ``placed`` op by
    its new index."""
    for index in sorted(erased, reverse=True):
        raw[index].erase()
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    positions = tuple(None if i in erased else where[op.id()] for i, op in enumerate(raw))
    return positions, {where[op.id()]: mesh for op, mesh in placed}


def _position(raw: list[Any], op: Any) -> int:
    """The index of ``op`` in ``raw`` (Python op objects are not equal across accesses: by id)."""
    return next(i for i, other in enumerate(raw) if other.id() == op.id())
