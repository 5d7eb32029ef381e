"""Pipeline split: stages, their schedule, and each rank's program cut to its stage
(stage: comm-fused -> stage-split per rank; stages and schedule planned at compile).

A *stage* is the sub-mesh ``autopar.shard_op(layer, mesh[i])`` placed a layer's forward ops
on; backward ops follow their forward op, updates their parameter. Stages are numbered in
the order the forward pass reaches them. Values crossing stages are ordinary reshards across
meshes (the planner's ``send_recv``), emitted as ``send`` on the producing rank and ``recv`` on
the reading one; so this pass only decides, per rank:

- which ops are its own: the ops of its stage, the reshard ops emitted for it, and the
  sources and constants those read; everything else is erased;
- which *phase* each op runs in — ``F`` (forward of one micro-batch), ``B`` (its backward) or
  ``OPT`` (the update, once per step) — so the runtime can run the phases as the schedule's
  actions, one micro-batch at a time. An inserted op runs in the phase of the serial op it
  was inserted for (the next serial op in the full program: a reshard is emitted right before
  its reader; after the last one, the previous op's).

The schedule (:mod:`autopar.schedule`: generated, lowered with send/recv and verified) is
planned once at compile for the whole pipeline; ``dist.schedule(rank)`` returns a rank's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.errors import AutoparError
from autopar.graph import Role
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_OPS, SOURCE_OPS
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.schedule import Action, build_schedule

PHASES = {Role.FORWARD: "F", Role.BACKWARD: "B", Role.OPTIMIZER: "OPT"}
RUNNABLE = ("FThenB", "1F1B")  # schedules the runtime runs today (no split backward, one stage per rank)


@dataclass(frozen=True)
class PipelinePlan:
    """Stages and schedule of a pipelined program (rank-independent)."""

    stages: tuple[ProcessMesh, ...]
    stage_of: Mapping[int, int]  # serial op index -> stage (sources and constants: absent)
    micro_batches: int
    schedule_name: str
    actions: Mapping[int, tuple[Action, ...]]  # stage -> its verified actions (send/recv included)

    def stage_of_rank(self, rank: int) -> int:
        for stage, mesh in enumerate(self.stages):
            if rank in mesh.ranks:
                return stage
        raise AutoparError(f"rank {rank} holds no pipeline stage (stages: {', '.join(map(str, self.stages))})")


@dataclass(frozen=True)
class PipelineSplit(Pass):
    micro_batches: int = 1
    schedule: str = "1F1B"

    name: ClassVar[str] = "pipeline_split"
    plan_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    plan_ensures: ClassVar[str] = "stages-planned"
    emit_requires: ClassVar[tuple[str, ...]] = ("comm-inserted", "stages-planned")
    emit_ensures: ClassVar[str] = "stage-split"

    def plan(self, state: CompileState) -> None:
        if self.schedule not in RUNNABLE:
            raise AutoparError(
                f"PipelineConfig(schedule={self.schedule!r}): the runtime runs {' and '.join(RUNNABLE)} today "
                "(interleaved and zero-bubble schedules are verified as data, see autopar.schedule, but not run yet)"
            )
        stages, stage_of = find_stages(state)
        actions = build_schedule(self.schedule, len(stages), self.micro_batches)
        state.pipeline = PipelinePlan(tuple(stages), stage_of, self.micro_batches, self.schedule,
                                      {s: tuple(a) for s, a in actions.items()})  # fmt: skip

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        plan = state.pipeline
        stage = plan.stage_of_rank(rp.rank)
        ops = list(rp.program.global_block().ops)
        serial = {op.id(): index for index, op in enumerate(rp.ops) if op is not None}
        labels = _phases(state, ops, serial)
        keep = [plan.stage_of.get(serial.get(op.id(), -1), stage) == stage for op in ops]
        _keep_what_kept_ops_read(ops, keep)
        kept = {op.id() for op, k in zip(ops, keep) if k}
        rp.ops = [op if op is not None and op.id() in kept else None for op in rp.ops]
        rp.phases = {op.id(): label for op, label, k in zip(ops, labels, keep) if k}
        for i in reversed(range(len(ops))):
            if not keep[i]:
                _check_unread(state, ops[i], kept, serial, rp.rank)
                ops[i].erase()


def find_stages(state: CompileState) -> tuple[list[ProcessMesh], dict[int, int]]:
    """Stage meshes in the order the forward pass reaches them, and each op's stage."""
    graph, meshes = state.graph, state.propagation.op_meshes
    stages: list[ProcessMesh] = []
    for op in graph.ops:
        mesh = meshes.get(op.index)
        if op.role is Role.FORWARD and mesh is not None and mesh != state.mesh and mesh not in stages:
            stages.append(mesh)
    if not stages:
        raise AutoparError(
            "Strategy.pipeline: the program has no stages; place layers on sub-meshes with "
            "autopar.shard_op(layer, mesh[i]) (mesh[i] indexes the mesh's first dim)"
        )
    for i, a in enumerate(stages):
        for b in stages[i + 1 :]:
            shared = set(a.ranks) & set(b.ranks)
            if shared:
                raise AutoparError(f"pipeline stages {a} and {b} share ranks {sorted(shared)}: stages need disjoint sub-meshes")
    idle = sorted(set(state.mesh.ranks) - {r for m in stages for r in m.ranks})
    if idle:
        raise AutoparError(f"ranks {idle} of {state.mesh} hold no pipeline stage: place layers on every mesh[i] with shard_op")
    stage_of = {}
    for op in graph.ops:
        mesh = meshes.get(op.index)
        if mesh is None or op.name in SOURCE_OPS or (op.name in CONSTANT_OPS and not op.inputs):
            continue
        if mesh not in stages:
            raise AutoparError(
                f"{op} runs on {mesh}, which is no pipeline stage ({', '.join(map(str, stages))}): "
                "place the layer that makes it with shard_op(layer, mesh[i])"
            )
        stage_of[op.index] = stages.index(mesh)
    return stages, stage_of


def _phases(state: CompileState, ops: list[Any], serial: dict[int, int]) -> list[str]:
    """Each op's phase: a serial op's role; an inserted op, that of the next serial op."""
    labels: list[str | None] = [None] * len(ops)
    following: str | None = None
    for i in reversed(range(len(ops))):
        index = serial.get(ops[i].id())
        if index is not None:
            following = PHASES[state.graph.ops[index].role]
        labels[i] = following
    last = "OPT"
    for i, label in enumerate(labels):
        labels[i] = label or last
        last = labels[i]
    return labels  # type: ignore[return-value]


def _keep_what_kept_ops_read(ops: list[Any], keep: list[bool]) -> None:
    """Sources and constants a kept op reads stay (foreign ones go: a stage-1 parameter is not
    read on stage 0); inserted ops stay only if their results are read or they have none."""
    position = {op.id(): i for i, op in enumerate(ops)}
    for i, op in enumerate(ops):
        if op.name() in SOURCE_OPS or (op.name() in CONSTANT_OPS and op.num_operands() == 0):
            keep[i] = False
    for i in reversed(range(len(ops))):
        if not keep[i]:
            continue
        for source in ops[i].operands_source():
            if source.initialized():
                producer = position[source.get_defining_op().id()]
                if ops[producer].name() in SOURCE_OPS or ops[producer].name() in CONSTANT_OPS:
                    keep[producer] = True


def _check_unread(state: CompileState, op: Any, kept: set[int], serial: dict[int, int], rank: int) -> None:
    """An erased op's results must not be read by a kept op: that would be a value of another
    stage read without a transfer (a bug of the planning, named rather than crashing)."""
    for result in op.results():
        if result.initialized() and any(user.id() in kept for user in result.all_used_ops()):
            index = serial.get(op.id())
            what = str(state.graph.ops[index]) if index is not None else op.name()
            raise AutoparError(f"rank {rank}: its stage reads a result of {what}, which runs on another stage, without a transfer")
