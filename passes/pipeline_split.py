"""Pipeline split: stages, their schedule, and each rank's program cut to its stages
(stage: comm-fused -> stage-split per rank; stages and schedule planned at compile).

A *stage* is a run of forward ops that ``autopar.shard_op(layer, mesh[i])`` placed on one
sub-mesh; backward ops follow their forward op, updates their parameter. An op on a sub-mesh
of a stage (an ``autopar.local_map`` copy, an expert on ``split_mesh(mesh, "ep")[i]``:
autopar/sub_meshes.py) belongs to that stage; the sub_meshes pass keeps it on its ranks. Stages
are numbered in the order the forward pass reaches them; layers cycling through the meshes again give a
pipeline rank several (virtual) stages. Values crossing stages are ordinary reshards across
meshes (the planner's ``send_recv``), emitted as ``send`` on the producing rank and ``recv`` on
the reading one; so this pass only decides, per rank:

- which ops are its own: the ops of its stages, the reshard ops emitted for it, and the
  sources and constants those read; everything else is erased;
- which *job* each op runs in — ``F<s>`` (stage s's forward of one micro-batch), ``B<s>`` (its
  backward; for zero-bubble ``I<s>``, what the sent input gradient needs, and ``W<s>``, the
  rest) or ``OPT`` (the update, once per step) — so the runtime runs them as the schedule's
  actions, one micro-batch at a time. An inserted op runs with the serial op it was inserted
  for: the next serial op when this rank runs it (a reshard is emitted right before its
  reader), else the previous one it runs (a send placed before another rank's reader).

The schedule (:mod:`autopar.schedule`: generated, lowered with send/recv and verified) is
planned once at compile for the whole pipeline; ``dist.schedule(rank)`` returns a rank's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import kind_of
from autopar.cost_model import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import VECTOR_OPS, Role
from autopar.mesh import ProcessMesh
from autopar.op_kinds import CONSTANT_OPS, SOURCE_OPS
from autopar.passes.base import CompileState, Pass, RankProgram
from autopar.passes.reshard_emission import collective_op, replace_uses
from autopar.passes.results import PipelinePlan
from autopar.pipeline_lowering import SYNC_SOURCE
from autopar.schedule import UPDATE, B, F, I, Phase, W, verified_schedule
from autopar.spmd import ops_where
from autopar.sub_meshes import stage_container

PHASES = {Role.FORWARD: F, Role.BACKWARD: B}  # an op's role -> its phase's kind (the optimizer's: UPDATE)
LOSS_SCALE_UPDATES = ops_where("moves_loss_scale")  # update_loss_scaling_: reads the overflow flag as operand 1


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
        meshes, stages, stage_of = find_stages(state)
        virtual = len(stages) // len(meshes)
        if (virtual > 1) != (self.schedule == "Interleaved1F1B"):
            raise AutoparError(
                f"PipelineConfig(schedule={self.schedule!r}): the program has {virtual} stage(s) per pipeline rank; "
                + ("use schedule='Interleaved1F1B' for several" if virtual > 1 else "Interleaved1F1B needs several: "
                   "place layers on mesh[0], mesh[1], ..., mesh[0], mesh[1], ...")
            )  # fmt: skip
        actions = verified_schedule(self.schedule, len(meshes), self.micro_batches, virtual)
        state.pipeline = PipelinePlan(tuple(meshes), tuple(stages), stage_of, self.micro_batches, self.schedule, actions)

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        plan = state.pipeline
        mine = plan.stages_of(rp.rank)
        ops = list(rp.program.global_block().ops)
        serial = {op.id(): index for index, op in enumerate(rp.ops) if op is not None}
        keep = [plan.stage_of.get(serial.get(op.id(), -1), next(iter(mine))) in mine for op in ops]
        labels = _labels(state, rp, ops, serial, keep)
        _keep_what_kept_ops_read(ops, keep)
        kept = {op.id() for op, k in zip(ops, keep) if k}
        rp.ops = [op if op is not None and op.id() in kept else None for op in rp.ops]
        rp.phases = {op.id(): label for op, label, k in zip(ops, labels, keep) if k}
        for i in reversed(range(len(ops))):
            if not keep[i]:
                _check_unread(state, ops[i], kept, serial, rp.rank)
                ops[i].erase()
        if plan.schedule_name == "ZBH1":
            _split_backward(rp)
        _agree_overflow(state, rp)


def _agree_overflow(state: CompileState, rp: RankProgram) -> None:
    """The SYNC point of dynamic loss scaling: each stage checked only its own gradients
    (autopar/rewrites/stage_overflow.py), so the overflow flag each stage's update reads is a
    pending max over the pipeline's stages. Right before each update, it is all-reduced (max) over
    the ranks holding this rank's piece on every stage: once per step, in the update phase, before
    any stage moves its loss scale or skips; the rank's other readers of the flag (its optimizer
    ops' memcpy) read the agreed one too. Each rank's update moves its own copy of the scale
    (``stop_update`` cleared: in the serial program only the first stage's does)."""
    plan = state.pipeline
    if len(plan.meshes) < 2:
        return
    updates = [
        op for index, op in enumerate(rp.ops)
        if op is not None and state.graph.ops[index].name in LOSS_SCALE_UPDATES
    ]  # fmt: skip
    if not updates:
        return
    import paddle

    mine = plan.meshes[plan.pipeline_rank(rp.rank)]
    position = mine.ranks.index(rp.rank)
    group = tuple(mesh.ranks[position] for mesh in plan.meshes)
    pending = DistAttr.of(state.mesh, ((),), {0: "max"})
    reshard = plan_reshard(pending, DistAttr.replicated(state.mesh, 1), (1,), "bool", state.cluster)
    step = reshard.steps[0]
    ring = rp.rings.setdefault(group, state.ring_of((0,), group))
    for number, update in enumerate(updates):
        flag = update.operand_source(1)
        collective = Collective(
            kind=CollectiveKind.ALL_REDUCE, group=group, key=CollectiveKey(SYNC_SOURCE, number), value=f"found_inf of {update.name()}",
            src=pending, dst=DistAttr.replicated(state.mesh, 1), shape=(1,), output_shape=(1,), bytes=step.bytes,
            time=step.time, reason=f"loss scaling overflow flag (found_inf) agreed over {state.mesh.dim_names[0]}: "
            f"each pipeline stage checked only its own gradients; every stage's {update.name()} reads the flag of all",
            reduce="max", dtype="bool",
        )  # fmt: skip
        with paddle.static.program_guard(rp.program):
            paddle.pir.set_insertion_point(update)
            agreed = collective_op(collective, flag, ring)
            paddle.pir.reset_insertion_point_to_end()
        made = agreed.get_defining_op()
        replace_uses(flag, agreed, {made.id()})
        rp.collectives.append((collective, made.id()))
        rp.phases[made.id()] = UPDATE
        with paddle.static.program_guard(rp.program):  # this rank's update moves its own copy of the scale
            paddle.pir.set_insertion_point(update)
            moves = paddle._C_ops.full([1], False, paddle.bool, paddle.CPUPlace())
            paddle.pir.reset_insertion_point_to_end()
        update.operand(5).set_source(moves)
        rp.phases[moves.get_defining_op().id()] = UPDATE


def _split_backward(rp: RankProgram) -> None:
    """Zero-bubble: each stage's backward ``B<s>`` becomes ``I<s>``, the ops the input gradient
    sent to the previous stage depends on (with its send), and ``W<s>``, the rest (weight
    gradients only), which the schedule runs later to fill bubbles. A grad op making both
    gradients (matmul_grad) stays whole in I, so W holds only what no input gradient needs."""
    ops = list(rp.program.global_block().ops)
    sends = {op_id for c, op_id in rp.collectives if kind_of(c.kind).sends}
    for op in ops:
        phase = rp.phases.get(op.id())
        if phase is not None and phase.kind is B:
            rp.phases[op.id()] = Phase(W, phase.stage)

    def deferred(op: Any) -> bool:
        phase = rp.phases.get(op.id())
        return phase is not None and phase.kind is W

    pending = [op for op in ops if op.id() in sends and deferred(op)]
    while pending:
        op = pending.pop()
        if not deferred(op):
            continue
        rp.phases[op.id()] = Phase(I, rp.phases[op.id()].stage)
        for source in op.operands_source():
            if source.initialized() and deferred(source.get_defining_op()):
                pending.append(source.get_defining_op())


def find_stages(state: CompileState) -> tuple[list[ProcessMesh], list[int], dict[int, int]]:
    """The pipeline ranks' meshes, each stage's mesh index, and each op's stage. A stage is a
    maximal run of forward ops on one sub-mesh; backward ops follow their forward op (or the
    op whose result they read), updates the first forward reader of their parameter. (Found
    once per graph and op meshes: every strategy compiled from one analysis asks.)"""
    found = _STAGES.get(state.graph)
    if found is None or found[0] != state.mesh or found[1] != state.propagation.op_meshes:
        found = _STAGES[state.graph] = (state.mesh, dict(state.propagation.op_meshes), _find_stages(state))
    meshes, stages, stage_of = found[2]
    return list(meshes), list(stages), dict(stage_of)


_STAGES: weakref.WeakKeyDictionary[Any, tuple[ProcessMesh, dict, tuple]] = weakref.WeakKeyDictionary()


def _find_stages(state: CompileState) -> tuple[list[ProcessMesh], list[int], dict[int, int]]:
    graph = state.graph
    # an op on a sub-mesh of a stage (an autopar.local_map copy, an expert: autopar/sub_meshes.py) is of that stage
    op_meshes = {i: stage_container(state.mesh, m) for i, m in state.propagation.op_meshes.items()}
    runs: list[ProcessMesh] = []
    stage_of: dict[int, int] = {}
    whole = state.analysed.single_stage  # one stage: the mesh
    for op in graph.ops:
        mesh = op_meshes.get(op.index, state.mesh if whole else None)
        if op.role is not Role.FORWARD or mesh is None or (mesh == state.mesh and not whole) or _is_constant(op):
            continue
        if not runs or runs[-1] != mesh:
            runs.append(mesh)
        stage_of[op.index] = len(runs) - 1
    meshes = list(dict.fromkeys(runs))
    _check_meshes(state, meshes, runs)
    readers: dict[Any, list[int]] = {}
    for op in graph.ops:
        for key in op.inputs:
            if key is not None and op.index in stage_of:
                readers.setdefault(key, []).append(stage_of[op.index])
    for op in graph.ops:
        mesh = op_meshes.get(op.index, state.mesh if whole else None)
        if op.index in stage_of or mesh is None or _is_constant(op):
            continue
        stage = _follow(graph, op, mesh, runs, stage_of, readers)
        if stage is None:
            raise AutoparError(
                f"{op} runs on {mesh}, which is no pipeline stage of it ({', '.join(map(str, meshes))}): "
                "place the layer that makes it with shard_op(layer, mesh[i])"
            )
        stage_of[op.index] = stage
    _vector_ops_follow(graph, stage_of)
    return meshes, [meshes.index(m) for m in runs], stage_of


def _vector_ops_follow(graph: Any, stage_of: dict[int, int]) -> None:
    """builtin.combine packs operands for the op reading the vector (add_n summing a residual
    stream's gradients): it runs on that op's stage; builtin.split on its input's producer's."""
    packed_for = {site[0]: op.index for op in graph.ops for site in op.sites if op.index in stage_of}  # (vectors are flattened)
    for op in graph.ops:
        if op.name not in VECTOR_OPS or op.index in stage_of:
            continue
        if op.name == "builtin.combine":
            if op.index in packed_for:
                stage_of[op.index] = stage_of[packed_for[op.index]]
        elif op.inputs and op.inputs[0] is not None and op.inputs[0][0] in stage_of:
            stage_of[op.index] = stage_of[op.inputs[0][0]]


def _is_constant(op: Any) -> bool:
    return op.name in SOURCE_OPS or (op.name in CONSTANT_OPS and not op.inputs)


def _follow(
    graph: Any, op: Any, mesh: ProcessMesh, runs: list[ProcessMesh], stage_of: dict[int, int], readers: dict[Any, list[int]]
) -> int | None:
    """The stage on ``mesh`` (the op's) among, in order: the stages reading an update's
    parameter, the grad op's forward op's, those making its inputs, those reading its inputs
    in the forward pass, and for an update-phase op, any stage on ``mesh``."""
    candidates = list(readers.get(op.inputs[0], ())) if op.role is Role.OPTIMIZER and op.inputs else []
    if op.forward_op is not None and op.forward_op in stage_of:
        candidates.append(stage_of[op.forward_op])
    for key in op.inputs:
        maker = None if key is None else _through_split(graph, key[0])
        if maker in stage_of:
            candidates.append(stage_of[maker])
    for key in op.inputs:  # (a grad op of no forward op reading a constant of its stage's forward: a local_map copy's scale)
        candidates += readers.get(key, ()) if key is not None else ()
    if op.role is Role.OPTIMIZER:  # (an update-phase op of that mesh with no staged input: a copy of a step-wide count)
        candidates += range(len(runs))
    return next((stage for stage in candidates if runs[stage] == mesh), None)


def _through_split(graph: Any, index: int) -> int:
    """The op making a value: for a member of a builtin.split, the op whose vector it splits
    (concat_grad's, say: the split itself gets its stage only afterwards)."""
    op = graph.ops[index]
    if op.name == "builtin.split" and op.inputs and op.inputs[0] is not None:
        return op.inputs[0][0]
    return index


def _check_meshes(state: CompileState, meshes: list[ProcessMesh], runs: list[ProcessMesh]) -> None:
    if not meshes:
        raise AutoparError(
            "Strategy.pipeline: the program has no stages; place layers on sub-meshes with "
            "autopar.shard_op(layer, mesh[i]) (mesh[i] indexes the mesh's first dim)"
        )
    for i, a in enumerate(meshes):
        for b in meshes[i + 1 :]:
            shared = set(a.ranks) & set(b.ranks)
            if shared:
                raise AutoparError(f"pipeline stages on {a} and {b} share ranks {sorted(shared)}: stages need disjoint sub-meshes")
    idle = sorted(set(state.mesh.ranks) - {r for m in meshes for r in m.ranks})
    if idle:
        raise AutoparError(f"ranks {idle} of {state.mesh} hold no pipeline stage: place layers on every mesh[i] with shard_op")
    if any(mesh != meshes[s % len(meshes)] for s, mesh in enumerate(runs)) or len(runs) % len(meshes):
        order = " -> ".join(str(meshes.index(m)) for m in runs)
        raise AutoparError(
            f"pipeline stages visit the meshes in the order {order}: stages must cycle through them "
            "(mesh[0], mesh[1], ..., then again mesh[0], mesh[1], ... for virtual stages)"
        )


def _labels(state: CompileState, rp: RankProgram, ops: list[Any], serial: dict[int, int], keep: list[bool]) -> list[Phase]:
    """Each op's job label: ``F<stage>`` / ``B<stage>`` / ``OPT``. An op inserted for a read by
    an update runs with the update, once per step, at both ends: a gradient sent to another
    stage's update is sent once its micro-batches are summed (sent per micro-batch, the update
    took the first micro-batch's only). A send runs where the value it sends is made (it
    took the label of the op before it, which was an update-side op when Paddle summed a
    shared weight's gradient mid-backward: the send ran once per step). Another inserted op
    takes the label of the next serial op when this rank runs it, else of the previous one it
    runs."""
    plan, graph = state.pipeline, state.graph

    def own(i: int) -> Phase | None:
        index = serial.get(ops[i].id())
        if index is None or index not in plan.stage_of:
            return None
        role = graph.ops[index].role
        return UPDATE if role is Role.OPTIMIZER else Phase(PHASES[role], plan.stage_of[index])

    labels: list[Phase | None] = [UPDATE if ops[i].id() in rp.update_side else own(i) for i in range(len(ops))]
    following: list[tuple[Phase | None, bool]] = [(None, False)] * len(ops)
    nxt: tuple[Phase | None, bool] = (None, False)
    for i in reversed(range(len(ops))):
        following[i] = nxt
        if labels[i] is not None:
            nxt = (labels[i], keep[i])
    sends = {op_id for c, op_id in rp.collectives if kind_of(c.kind).sends}
    position = {op.id(): i for i, op in enumerate(ops)}
    previous: Phase | None = None
    out: list[Phase] = []
    for i in range(len(ops)):
        label = labels[i]
        if label is None and ops[i].id() in sends:
            made = position[ops[i].operand_source(0).get_defining_op().id()]
            if labels[made] is not None or ops[made].name() not in SOURCE_OPS:  # (a parameter is sent at its read)
                label = out[made]
        if label is None:
            after, ours = following[i]
            label = after if ours else (previous or after or UPDATE)
        elif keep[i]:
            previous = label
        out.append(label)
    return out


def _keep_what_kept_ops_read(ops: list[Any], keep: list[bool]) -> None:
    """Sources and constants stay only where a kept op reads them (a stage-1 parameter is not
    read on stage 0)."""
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
