"""Values built from no input, computed on every pipeline stage that reads them (stage:
rewrite, part of stage inference).

Models build tables and masks in the graph from constants alone: a causal mask from
``arange`` / ``tril(ones)``, rotary sin / cos tables, position ids ``arange(seq)`` expanded to
the batch, a padding mask ``ones([batch, seq])``. They belong to no stage: several stages read
the same mask, and the op making it was written outside any layer. Paddle computes such a
value wherever it is read; so does autopar: each stage mesh reading one gets its own copy of
the ops making it, placed right before that stage's first read (so that it falls inside the
stage's run of the program), and its reads move to that copy. Nothing is sent between stages
for them, and every copy computes the same thing (no random op is copied: a value drawn at
random is not a constant; it stays where it is and its reads are planned as transfers).

The base constants (``full``, ``full_int_array``: ops with no operand) are not copied, but
where a layer placed one on a stage and another stage reads it: the pipeline split keeps them
on every rank that reads them. Ops whose readers have no stage yet
(ops outside any shard_op reading only such values) are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.graph import VECTOR_OPS, ProgramGraph, Role
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_FILLS, CONSTANT_OPS, SOURCE_OPS
from autopar.rewrites.recompute import RANDOM_OPS, clone_reading

if TYPE_CHECKING:
    from paddle.pir import Program


def constant_ops(graph: ProgramGraph) -> set[int]:
    """Forward ops computing only from constants (base constants included), none random or in
    place: what every stage can compute for itself."""
    found: set[int] = set()
    for op in graph.ops:
        if op.role is not Role.FORWARD or op.name in SOURCE_OPS:
            continue
        base = op.short_name.removesuffix("_")
        if base in RANDOM_OPS or (op.short_name.endswith("_") and op.name not in CONSTANT_OPS + CONSTANT_FILLS):
            continue
        if not op.inputs:
            if op.name in CONSTANT_OPS:
                found.add(op.index)
            continue
        if all(key is None or key[0] in found for key in op.inputs):
            found.add(op.index)
    return found


@dataclass(frozen=True)
class StagedConstants:
    """The rewritten program and where its ops moved."""

    program: Program
    positions: tuple[int | None, ...]  # old op index -> new index (None: erased, every read moved to copies)
    meshes: Mapping[int, ProcessMesh]  # new index of each copy -> the stage mesh it runs on
    copied: int  # ops copied, over all stages

    def __str__(self) -> str:
        stages = len(set(self.meshes.values()))
        return f"{self.copied} op(s) building values from constants computed on the {stages} stage(s) reading them"


def stage_constants(program: Any, graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> StagedConstants | None:
    """Copy the constant-built values onto each stage mesh reading them (module docstring);
    None when there is nothing to copy (``program`` is used as it is)."""
    import paddle

    constants = constant_ops(graph)
    # base constants are copied only when placed on a stage and read on another (they are
    # otherwise kept on every rank reading them)
    derived = sorted(i for i in constants if graph.ops[i].inputs or i in op_meshes)
    reader_mesh = _reader_meshes(graph, op_meshes, constants)
    needed: dict[int, dict[ProcessMesh, int]] = {}  # derived op -> mesh -> index of its first reader there
    for index in reversed(derived):
        where: dict[ProcessMesh, int] = {}
        for key in graph.ops[index].outputs:
            for user in graph.values[key].users if key is not None else ():
                if user in constants:
                    pairs = needed.get(user, {}).items()
                else:
                    pairs = [(reader_mesh[user], user)] if user in reader_mesh else []
                for mesh, first in pairs:
                    where[mesh] = min(where.get(mesh, first), first)
        base = not graph.ops[index].inputs
        if where and not (base and set(where) == {op_meshes[index]}):
            needed[index] = where
    if not needed:
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    ids = {r.id: (i, j) for i, op in enumerate(raw) for j, r in enumerate(op.results()) if r.initialized()}
    copies: dict[tuple[int, ProcessMesh], Any] = {}
    with paddle.static.program_guard(work):
        for index in sorted(needed):
            for mesh, first in needed[index].items():
                paddle.pir.set_insertion_point(raw[first])
                copies[(index, mesh)] = clone_reading(raw[index], lambda value, mesh=mesh: _copy_of(copies, ids, value, mesh))[-1]
        paddle.pir.reset_insertion_point_to_end()
    for reader, mesh in reader_mesh.items():
        op = raw[reader]
        for slot in range(op.num_operands()):
            source = op.operand_source(slot)
            made = ids.get(source.id) if source.initialized() else None
            if made is not None and (made[0], mesh) in copies:
                op.operand(slot).set_source(copies[(made[0], mesh)].result(made[1]))
    erased = set()
    for index in reversed(derived):  # what no read needs any more (builtin.combine included)
        if all(not r.initialized() or not r.all_used_ops() for r in raw[index].results()):
            raw[index].erase()
            erased.add(index)
    where = {op.id(): position for position, op in enumerate(work.global_block().ops)}
    positions = tuple(None if i in erased else where[op.id()] for i, op in enumerate(raw))
    meshes = {where[copy.id()]: mesh for (_, mesh), copy in copies.items()}
    return StagedConstants(work, positions, meshes, len(copies))


def _copy_of(copies: dict, ids: Mapping[str, tuple[int, int]], source: Any, mesh: ProcessMesh) -> Any:
    key = ids.get(source.id) if source.initialized() else None
    found = copies.get((key[0], mesh)) if key is not None else None
    return source if found is None else found.result(key[1])


def _reader_meshes(graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh], constants: set[int]) -> dict[int, ProcessMesh]:
    """The stage mesh of each op reading a constant-built value: its own placement, else its
    forward op's (a grad op), else, for a builtin.combine, the placement of the op reading it."""
    readers: dict[int, ProcessMesh] = {}
    for op in graph.ops:
        if op.index in constants:
            continue
        mesh = op_meshes.get(op.index)
        if mesh is None and op.forward_op is not None:
            mesh = op_meshes.get(op.forward_op)
        if mesh is not None:
            readers[op.index] = mesh
    for op in graph.ops:  # a vector operand is an operand of its builtin.combine
        for combine, _ in op.sites:
            if combine >= 0 and combine not in readers and op.index in readers and graph.ops[combine].name in VECTOR_OPS:
                readers[combine] = readers[op.index]
    return readers
