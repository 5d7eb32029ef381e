"""Dynamic loss scaling checked on each pipeline stage (stage: rewrite, after the stages).

``paddle.amp.GradScaler`` appends one ``check_finite_and_unscale_`` and one
``update_loss_scaling_`` over *every* gradient. In a pipeline the gradients are made on the
stages of their parameters, and one op runs on one stage: every other stage would send it all
its gradients and receive them back unscaled (twice the gradient bytes across the pipeline per
step), and only that stage would update the loss scale — the other stages' copies of it (the
last stage scales the loss with its own) stay behind, and the run silently diverges
(measured: ``loss_scaling_0`` differed between the stages after the first change of scale).

So each such op is split by stage: each stage checks and unscales its own gradients (its
found_inf says whether *its* gradients overflowed: within the stage a pending max over the mesh
dims they are split or pending over, autopar/spmd/loss_scaling.py), runs its own
``update_loss_scaling_`` on them (moving its own copy of the loss scale and step counts) and its
own ``memcpy`` of the flag for its optimizer ops. (In the rewritten serial program the stages'
updates run one after another on the one loss scale: all but the first are built with
``stop_update`` set, so the scale and counts move once per step, as in the user's program, and
autopar.check's serial reference stays right; the pipeline split clears it on every rank, whose
program holds its stage's update only.) What no single stage can see — another stage's
overflow — is agreed once per step by the pipeline split: a SYNC point, an ``all_reduce(max)``
of the flag over the pipeline's stages right before each stage's update reads it
(passes/pipeline_split.py). Every stage then skips an overflowing step together and moves its
loss scale alike, so the copies stay bit-identical (the replica check covers them). Reads after
the split ops are moved onto the per-stage results (the in-place aliasing, :mod:`.loss_scaling`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.causes import gradients
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, Role
from autopar.mesh import ProcessMesh
from autopar.rewrites.stage_norms import erased_and_placed
from autopar.shared_parameters import reader_meshes
from autopar.spmd import ops_where

if TYPE_CHECKING:
    from paddle.pir import Program

CHECKS = ops_where("checks_overflow")  # check_finite_and_unscale_
UPDATES = ops_where("moves_loss_scale")  # update_loss_scaling_
UPDATE_ATTRS = ("incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio")


@dataclass(frozen=True)
class StagedChecks:
    """The rewritten program and where its ops moved."""

    program: Program
    positions: tuple[int | None, ...]  # old op index -> new index (None: erased)
    meshes: Mapping[int, ProcessMesh]  # new index of each per-stage op -> its stage mesh
    split: tuple[str, ...]  # ``pd_op.check_finite_and_unscale_#67: 4 gradients on 2 stages``

    def __str__(self) -> str:
        return f"loss scaling checked per stage, found_inf agreed at a SYNC point ({'; '.join(self.split)})"


@dataclass(frozen=True)
class _Pair:
    """One check and the update that reads its flag: their indices, and each gradient slot's stage."""

    check: int
    update: int
    stages: tuple[ProcessMesh, ...]  # per gradient slot
    copies: tuple[int, ...]  # the other readers of the flag (memcpy to the host for the optimizer ops)


def _gradient_stages(graph: ProgramGraph, update: Any, op_meshes: Mapping[int, ProcessMesh]) -> list[ProcessMesh | None]:
    """The stage of each gradient ``update`` zeroes: its parameter's first forward reader's (the
    optimizer reads the update's results, :mod:`.loss_scaling`)."""
    made = gradients(graph)
    count = len(update.inputs) - 5
    found: list[ProcessMesh | None] = []
    for slot in range(count):
        result = update.outputs[slot]
        gradient = made.get(result) if result is not None else None
        meshes = reader_meshes(graph, gradient.param, op_meshes) if gradient is not None else []
        producer = update.inputs[slot][0] if update.inputs[slot] is not None else None
        found.append(meshes[0] if meshes else op_meshes.get(producer) if producer is not None else None)
    return found


def _pairs(graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> list[_Pair]:
    """The checks whose gradients lie on several stages, each with its update; refused by name
    where the stage of a gradient is unknown, the two ops do not pair up, or a stage holds no
    gradient (it would move no copy of the loss scale, and miss the SYNC the others wait in)."""
    pairs = []
    stages_of_pipeline = {m for i, m in op_meshes.items() if graph.ops[i].role is Role.FORWARD}
    for op in graph.ops:
        if op.name not in CHECKS or len(stages_of_pipeline) < 2:
            continue
        flag = op.outputs[-1]
        readers = [graph.ops[u] for u in graph.values[flag].users] if flag is not None else []
        updates = [r for r in readers if r.name in UPDATES]
        copies = [r for r in readers if r.name not in UPDATES]
        if len(updates) != 1 or len(updates[0].inputs) - 5 != len(op.inputs) - 1:
            raise AutoparError(
                f"{op}: dynamic loss scaling across pipeline stages needs one update_loss_scaling_ over the same "
                f"gradients reading its found_inf; found {[str(u) for u in updates]}"
            )
        stages = _gradient_stages(graph, updates[0], op_meshes)
        if None in stages:
            slot = stages.index(None)
            raise AutoparError(
                f"{op}: cannot tell which pipeline stage makes the gradient {graph.values[op.inputs[slot]].label} "
                "it checks; found_inf cannot be agreed across stages without it"
            )
        missing = sorted(str(m) for m in stages_of_pipeline - set(stages))
        if missing:
            raise AutoparError(
                f"{op}: dynamic loss scaling in a pipeline needs a gradient on every stage: the stage(s) on "
                f"{', '.join(missing)} hold none, so found_inf cannot be agreed there (each stage checks its own "
                "gradients and moves its own copy of the loss scale); place a layer with parameters on every stage"
            )
        if len(set(stages)) > 1:
            pairs.append(_Pair(op.index, updates[0].index, tuple(stages), tuple(c.index for c in copies)))
    return pairs


def _groups(stages: tuple[ProcessMesh, ...]) -> list[tuple[ProcessMesh, list[int]]]:
    """Gradient slots grouped by stage, in order of first appearance."""
    groups: dict[ProcessMesh, list[int]] = {}
    for slot, mesh in enumerate(stages):
        groups.setdefault(mesh, []).append(slot)
    return list(groups.items())


def stage_overflow_checks(program: Any, graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> StagedChecks | None:
    """``program`` with each loss-scaling check and update split by pipeline stage, each stage's
    update reading its own flag (agreed at the SYNC point; module docstring); None when no check
    spans several stages."""
    pairs = _pairs(graph, op_meshes)
    if not pairs:
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    placed: list[tuple[Any, ProcessMesh]] = []
    erased: set[int] = set()
    split = []
    for pair in pairs:
        erased |= _split(work, raw, pair, placed)
        split.append(f"{raw[pair.check].name()}#{pair.check}: {len(pair.stages)} gradients on {len(set(pair.stages))} stages")
    return StagedChecks(work, *erased_and_placed(work, raw, erased, placed), tuple(split))


def _split(work: Any, raw: list[Any], pair: _Pair, placed: list[tuple[Any, ProcessMesh]]) -> set[int]:
    """One check / update pair of ``work`` (its ops ``raw``) split by stage; the indices it erases."""
    import paddle

    check, update = raw[pair.check], raw[pair.update]
    check_in, check_out = _members(check)
    update_out = _members(update)[1]
    scale = check.operand_source(1)
    states = [update.operand_source(i) for i in range(2, 6)]  # scale, good, bad, stop_update
    attrs = update.attrs()
    groups = _groups(pair.stages)
    flags = {}
    with paddle.static.program_guard(work):
        paddle.pir.set_insertion_point(check)
        for mesh, slots in groups:
            outs, flags[mesh] = scaling_op("check_finite_and_unscale_", [check_in[s] for s in slots], scale)
            placed += [(op, mesh) for op in _made_ops(flags[mesh], outs)]
            for slot, out in zip(slots, outs):
                _rewire(check_out[slot], out)
        paddle.pir.set_insertion_point(update)
        update_in = _members(update)[0]  # (read now: the checked gradients it reads were just rewired)
        stage_of = {}
        for number, (mesh, slots) in enumerate(groups):
            stop = states[3]
            if number:  # (serially only the first moves the shared states; each rank's own moves its copy)
                stop = paddle._C_ops.full([1], True, paddle.bool, paddle.CPUPlace())
                placed.append((stop.get_defining_op(), mesh))
            results = scaling_op(
                "update_loss_scaling_", [update_in[s] for s in slots], flags[mesh], states[0], states[1], states[2],
                *(attrs[name] for name in UPDATE_ATTRS), stop,
            )  # fmt: skip
            placed += [(op, mesh) for op in _made_ops(results[1], results[0])]
            for slot, out in zip(slots, results[0]):
                stage_of.update({user.id(): mesh for user in update_out[slot].all_used_ops()})
                _rewire(update_out[slot], out)
        for i in range(1, 4):  # the updated states (in place): a reader takes the last stage's
            if update.result(i).initialized():
                update.result(i).replace_all_uses_with(results[i])
        for index in pair.copies:
            _copy_per_stage(raw[index], flags, stage_of, placed)
    paddle.pir.reset_insertion_point_to_end()
    return {_index(raw, op) for op in (*_packing(check), *_packing(update), *(raw[i] for i in pair.copies))}


def scaling_op(name: str, grads: Sequence[Any], *rest: Any) -> Any:
    """``paddle._C_ops.<name>(grads, *rest)`` for an in-place scaling op (``check_finite_and_unscale_``,
    ``update_loss_scaling_``) on gradients of any dtype. Paddle builds them on float16 gradients
    (GradScaler at float16 O2) but this CPU build registers their kernels for fp32 / fp64 only
    and refuses to *construct* them on float16 ones: so they are built on fp32 stand-ins of the
    low-precision gradients, then made to read the gradients themselves, their vector operand
    and in-place results retyped (the op Paddle builds on a GPU). Its results, as the builder's."""
    import paddle

    low = [str(g.dtype) in ("paddle.float16", "paddle.bfloat16") for g in grads]
    if not any(low):
        return getattr(paddle._C_ops, name)(grads, *rest)
    stand_ins = [paddle._C_ops.cast(g, paddle.float32) if is_low else g for g, is_low in zip(grads, low)]
    made = getattr(paddle._C_ops, name)(stand_ins, *rest)
    op = made[1].get_defining_op()  # (found_inf; the new loss scale)
    for stand_in, grad, is_low in zip(stand_ins, grads, low):
        if is_low:
            stand_in.replace_all_uses_with(grad)
            stand_in.get_defining_op().erase()
    vector = paddle.base.libpaddle.pir.create_vec_type([g.type() for g in grads])
    op.operand_source(0).set_type(vector)
    op.result(0).set_type(vector)
    for split in op.result(0).all_used_ops():  # builtin.split: the gradients updated in place
        for result, grad in zip(split.results(), grads):
            result.set_type(grad.type())
    return made


def _copy_per_stage(copy: Any, flags: Mapping[ProcessMesh, Any], stage_of: Mapping[int, ProcessMesh], placed: list) -> None:
    """``copy`` (a memcpy of the flag) made on each stage from that stage's flag; each reader (an
    optimizer op, placed by the gradient it reads: ``stage_of``) reads its stage's copy."""
    import paddle

    paddle.pir.set_insertion_point(copy)
    made = {}
    for mesh, flag in flags.items():
        made[mesh] = paddle._C_ops.memcpy(flag, copy.attrs()["dst_place_type"])
        placed.append((made[mesh].get_defining_op(), mesh))
    for user in list(copy.result(0).all_used_ops()):
        mesh = stage_of.get(user.id())
        if mesh is None:
            raise AutoparError(
                f"{user.name()} reads the loss-scaling overflow flag but no gradient of a pipeline stage: "
                "found_inf cannot be agreed across stages for it"
            )
        for slot in range(user.num_operands()):
            if user.operand_source(slot).is_same(copy.result(0)):
                user.operand(slot).set_source(made[mesh])


def _members(op: Any) -> tuple[list[Any], list[Any]]:
    """The members of ``op``'s vector operand and of its vector result."""
    combine = op.operand_source(0).get_defining_op()
    split = next(user for user in op.result(0).all_used_ops() if user.name() == "builtin.split")
    return [combine.operand_source(i) for i in range(combine.num_operands())], [split.result(i) for i in range(split.num_results())]


def _packing(op: Any) -> list[Any]:
    """``op`` with its vector operand's combine and its vector result's split."""
    split = next(user for user in op.result(0).all_used_ops() if user.name() == "builtin.split")
    return [op.operand_source(0).get_defining_op(), op, split]


def _made_ops(anchor: Any, outs: list[Any]) -> list[Any]:
    """The op making ``anchor`` and the combine / split packing its vector operand and result."""
    op = anchor.get_defining_op()
    split = outs[0].get_defining_op() if outs else None
    return [o for o in (op.operand_source(0).get_defining_op(), op, split) if o is not None]


def _rewire(old: Any, new: Any) -> None:
    """Every reader of ``old`` reads ``new``."""
    if old.initialized():
        old.replace_all_uses_with(new)


def _index(raw: list[Any], op: Any) -> int:
    return next(i for i, other in enumerate(raw) if other.id() == op.id())
