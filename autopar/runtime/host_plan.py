"""Host plan: a rank program cut at its collectives into a job list (stage: runtime).

Following PADDLE_NOTES' measured recipe: each segment is a clone of the rank program with
every op outside it erased (in reverse order), keeping the ``builtin.parameter`` ops,
persistable ``pd_op.data`` ops (they read the scope by name), feeds and constants it uses.
A value made in one segment and read later (by a segment, a collective, or a fetch) is made
persistable under a deterministic scope name on the producer side and read through a
persistable kwarg on the consumer side, so every segment shares the rank's scope.

The collective ops themselves are not run by Paddle: each of the plan's Collective values
becomes a :class:`CollectiveCall` that reads and writes scope variables by name; the runtime
performs it between segments.

A collective runs as soon as its input is made (unpipelined plans): it moves before the
segments between its input's producer and it, never past another collective (every rank
still meets the collectives in one order) nor past a segment reading its input; an input read
by name (a parameter or state, which a later segment may update in place; a feed) keeps it
where it is. Segments that end up adjacent are one segment. So a fetched loss is all-reduced
right after the gradients, not in a sync point of its own at the end of the step, and
per-gradient all-reduces each followed by a small scaling segment become one run of
collectives and one segment (each segment run costs an interpreter run).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from autopar.op_kinds import CONSTANT_FILLS, CONSTANT_OPS, SOURCE_OPS
from autopar.rank_plan import RankPlan
from autopar.runtime.jobs import CollectiveCall, Job, Segment
from autopar.schedule import UPDATE, Phase


@dataclass
class HostPlan:
    """One rank's jobs, plus where each exported value lives in the scope.

    Pipelined plans: ``pieces[i]`` is job ``i``'s piece of the plan's executable schedule (the
    program cut per action at compile, :mod:`autopar.pipeline_lowering`; a segment never spans
    two), ``jobs_of`` each piece's jobs in order, and ``accumulated`` the scope names made once
    per micro-batch and read by the update (gradients: the runner sums them over the
    micro-batches), ``accumulated_phases`` the phase making each.
    """

    jobs: list[Job]
    names: dict[tuple[int, int], str]  # (op position in the rank program, result) -> scope name
    pieces: list[int] = field(default_factory=list)  # each job's piece (-1 when not pipelined)
    accumulated: list[str] = field(default_factory=list)
    accumulated_phases: list[Phase] = field(default_factory=list)

    @functools.cached_property
    def jobs_of(self) -> dict[int, tuple[int, ...]]:
        """Each piece's job indices, in order (a piece of sources only has none)."""
        found: dict[int, list[int]] = {}
        for index, piece in enumerate(self.pieces):
            found.setdefault(piece, []).append(index)
        return {piece: tuple(jobs) for piece, jobs in found.items()}


def _scope_name(op: Any, position: int, result: int, prefix: str = "autopar") -> str:
    name = op.name()
    attrs = op.attrs()
    if name == "builtin.parameter":
        return str(attrs["parameter_name"])
    if name == "pd_op.data" and attrs.get("persistable", [False])[0]:
        return str(attrs["name"])
    return f"{prefix}.v{position}.{result}"


def _is_source(op: Any) -> bool:
    """Ops every segment re-makes or re-reads instead of receiving from another segment:
    parameters and feeds (read by name) and constants (cheap to make again)."""
    if op.name() in SOURCE_OPS or (op.name() in CONSTANT_OPS and op.num_operands() == 0):
        return True
    if op.name() in CONSTANT_FILLS:
        return all(s.initialized() and _is_source(s.get_defining_op()) for s in op.operands_source())
    return False


def is_feed(op: Any) -> bool:
    return op.name() == "pd_op.data" and not op.attrs().get("persistable", [False])[0]


def build_host_plan(plan: RankPlan, exports: list[tuple[int, int]] = (), prefix: str = "autopar") -> HostPlan:
    """Cut the plan's program at its collectives; ``exports`` are values fetched after.
    ``prefix`` names the scope variables passed between segments: host plans sharing a scope
    (one rank's runners for different fetch lists) must not share them."""
    program = plan.program
    ops = list(program.global_block().ops)
    comm_at = {position: collective for collective, position in plan.collectives}
    role = plan.pipeline
    piece = [-1] * len(ops)
    for index, cut in enumerate(role.pieces if role is not None else ()):
        for member in cut.ops:
            piece[member] = index
    position = {op.id(): i for i, op in enumerate(ops)}
    runs = _runs(len(ops), comm_at, piece)
    if plan.pipeline is None:
        runs = _hoisted(runs, ops, position)
    segment_of = {i: k for k, (kind, members) in enumerate(runs) if kind == "segment" for i in members}
    for i, op in enumerate(ops):
        if op.name() == "builtin.combine":  # a vector cannot live in the scope: build it where it is read
            users = [position[u.id()] for u in op.result(0).all_used_ops()]
            if users and all(u in segment_of for u in users):
                segment_of[i] = segment_of[min(users)]
    producer = {}
    for i, op in enumerate(ops):
        for j, result in enumerate(op.results()):
            if result.initialized():
                producer[result.id] = (i, j)
    crossing = _crossing_values(ops, producer, segment_of, comm_at, exports)
    names = {key: _scope_name(ops[key[0]], *key, prefix) for key in crossing}
    jobs: list[Job] = []
    pieces: list[int] = []
    for k, (kind, members) in enumerate(runs):
        if kind == "segment":
            mine = {i for i, s in segment_of.items() if s == k}
            if any(not _is_source(ops[i]) for i in mine):
                jobs.append(_segment(program, k, mine, crossing, names, segment_of))
                pieces.append(piece[members[0]] if members else piece[min(mine)])  # (not a combine moved in from an earlier piece)
            continue
        (hi,) = members
        pieces.append(piece[hi])
        source = producer[ops[hi].operand_source(0).id]
        if is_feed(ops[source[0]]):  # fed per run, never in the scope: read from the feed dict
            jobs.append(CollectiveCall(comm_at[hi], str(ops[source[0]].attrs()["name"]), names[(hi, 0)], from_feed=True))
            continue
        source_name = names.get(source) or _scope_name(ops[source[0]], *source, prefix)
        jobs.append(CollectiveCall(comm_at[hi], source_name, names[(hi, 0)]))
    if role is None:
        return HostPlan(jobs, names, pieces)
    accumulated = _accumulated(ops, crossing, role.phases, position)
    return HostPlan(jobs, names, pieces, [names[k] for k in accumulated], [role.phases[k[0]] for k in accumulated])


def _runs(count: int, comm_at: dict, phase: list[int]) -> list[tuple[str, list[int]]]:
    """Segments (maximal runs of ops in one piece between collectives) and collectives, in order."""
    runs: list[tuple[str, list[int]]] = [("segment", [])]
    for i in range(count):
        if i in comm_at:
            runs += [("collective", [i]), ("segment", [])]
            continue
        members = runs[-1][1]
        if members and phase[members[0]] != phase[i]:
            runs.append(("segment", []))
        runs[-1][1].append(i)
    return runs


def _hoisted(runs: list[tuple[str, list[int]]], ops: list[Any], position: dict) -> list[tuple[str, list[int]]]:
    """``runs`` with each collective moved before the segments preceding it that neither make
    nor read its input (not past another collective); an input read by name stays put.
    Adjacent segments are then merged."""
    moved: list[tuple[str, list[int]]] = []
    for kind, members in runs:
        at = len(moved)
        if kind == "collective":
            source = ops[members[0]].operand_source(0)
            made_by = position[source.get_defining_op().id()]
            if not _is_source(ops[made_by]):
                while at and moved[at - 1][0] == "segment" and not _touches(moved[at - 1][1], made_by, source, ops):
                    at -= 1
        moved.insert(at, (kind, members))
    merged: list[tuple[str, list[int]]] = []
    for kind, members in moved:
        if kind == "segment" and merged and merged[-1][0] == "segment":
            merged[-1] = ("segment", sorted(merged[-1][1] + members))
        else:
            merged.append((kind, list(members)))
    return merged


def _touches(members: list[int], made_by: int, value: Any, ops: list[Any]) -> bool:
    """Whether the segment ``members`` makes ``value`` (op ``made_by``) or reads it."""
    return made_by in members or any(ops[i].operand_source(j).is_same(value) for i in members for j in range(ops[i].num_operands()))


def _accumulated(ops: list[Any], crossing: set, phase: tuple[Phase, ...], position: dict) -> list[tuple[int, int]]:
    """Crossing values made per micro-batch (F / B) and read by the once-per-step update."""
    out = []
    for key in sorted(crossing):
        if phase[key[0]] == UPDATE:
            continue
        readers = [position[u.id()] for u in ops[key[0]].result(key[1]).all_used_ops()]
        if any(phase[r] == UPDATE for r in readers):
            out.append(key)
    return out


def _crossing_values(ops, producer, segment_of, comm_at, exports) -> set[tuple[int, int]]:
    """Values read outside the segment that makes them (sources are read by name instead)."""
    crossing = set(exports)
    for i, op in enumerate(ops):
        for source in op.operands_source():
            if not source.initialized():
                continue
            key = producer[source.id]
            if _is_source(ops[key[0]]):
                continue
            if i in comm_at or key[0] in comm_at or segment_of.get(key[0]) != segment_of.get(i):
                crossing.add(key)
    for position in comm_at:
        crossing.add((position, 0))
    return crossing


def _segment(program: Any, k: int, members: set[int], crossing: set, names: dict, segment_of: dict) -> Segment:
    import paddle

    clone = program.clone()
    ops = list(clone.global_block().ops)
    index = {op.id(): i for i, op in enumerate(ops)}
    keep = set(members)
    pending = list(members)
    while pending:  # the sources and constants a member reads, and what those read
        for source in ops[pending.pop()].operands_source():
            if source.initialized() and _is_source(source.get_defining_op()):
                found = index[source.get_defining_op().id()]
                if found not in keep:
                    keep.add(found)
                    pending.append(found)
    block = clone.global_block()
    with paddle.static.program_guard(clone):
        for key in sorted(crossing):
            if key[0] in members:
                value = ops[key[0]].result(key[1])
                paddle.pir.set_insertion_point_after(ops[key[0]])
                if ops[key[0]].name() == "builtin.split" or str(value.dtype) == "paddle.bfloat16":
                    # an element of a vector has no scope variable of its own to rename: copy it.
                    # (Measured, Paddle 3.3.1: the interpreter drops the export of a bfloat16
                    # bias gradient of add_grad in an O2 program; a copy keeps it.)
                    value = paddle._pir_ops.assign(value)
                paddle._pir_ops.set_persistable_value(value, names[key])
                value.persistable = True
            elif any(index[u.id()] in members for u in ops[key[0]].result(key[1]).all_used_ops()):
                value = ops[key[0]].result(key[1])
                kwarg = block.add_kwarg(names[key], value.type())
                kwarg.persistable = True
                for user in list(value.all_used_ops()):
                    if index[user.id()] in members:
                        source = kwarg
                        if user.name() == "builtin.combine":  # a block argument cannot be a vector member
                            paddle.pir.set_insertion_point(user)
                            source = paddle._pir_ops.assign(kwarg)
                        for pos in range(user.num_operands()):
                            if user.operand_source(pos).is_same(value):
                                user.operand(pos).set_source(source)
        paddle.pir.reset_insertion_point_to_end()
    for i in reversed(range(len(ops))):
        if i not in keep:
            ops[i].erase()
    feeds = tuple(
        str(ops[i].attrs()["name"])
        for i in sorted(keep)
        if ops[i].name() == "pd_op.data" and not ops[i].attrs().get("persistable", [False])[0]
    )
    return Segment(f"segment{k}", clone, feeds)
