"""Partition pass: a rank's program with local shapes (stage: propagated -> partitioned).

For the rank asked, a clone of the serial program where every value carries its local shape
(uneven splits included), feeds (``pd_op.data``) declare local shapes, shape constants that
the executor would otherwise apply globally (reshape targets, ``full`` shapes) are rewritten,
and ops whose local kernel is not the exact partial (a mean over a split dim divides by the
local count) get the rule's ``local_scale`` applied right after them.

The serial program is only cloned, never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from autopar.graph import VECTOR_OPS, OpNode
from autopar.passes.base import CompileState, Pass, RankProgram, declared
from autopar.spmd import TensorSpec, get_rule
from autopar.spmd.base import SpmdRule

RESHAPE_OPS = ("pd_op.reshape", "pd_op.reshape_")
EXPAND_OPS = ("pd_op.expand",)  # operand 1: the target shape, global in the serial program


@dataclass(frozen=True)
class Partition(Pass):
    """``pipelined``: the Strategy places pipeline stages, so a value on another stage's mesh is
    left to pipeline_split (without stages such a value is an error)."""

    pipelined: bool = declared()

    name: ClassVar[str] = "partition"
    emit_requires: ClassVar[tuple[str, ...]] = ("propagated",)
    emit_ensures: ClassVar[str] = "partitioned"

    def emit(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        with paddle.static.program_guard(rp.program):
            self._local_shapes(state, rp)
            self._shape_constants(state, rp)
            self._local_scales(state, rp)
            paddle.pir.reset_insertion_point_to_end()
        if state.startup is not None:
            rp.startup = self._rank_startup(state, rp.rank)

    def _rank_startup(self, state: CompileState, rank: int) -> Any:
        """The serial startup with each sharded tensor sliced right before it is stored.

        The initializers still draw the full tensor (same seed, same values as serial); each
        rank keeps its own piece, so initial values equal the serial ones exactly.
        """
        import paddle

        startup = state.startup.clone()
        with paddle.static.program_guard(startup):
            for op in list(startup.global_block().ops):
                name = _stored_name(op)
                key = state.graph.by_name.get(name) if name else None
                if key is None:
                    continue
                dist = state.propagation.dist(key)
                if rank not in dist.mesh.ranks:
                    continue  # another stage's parameter: initialized whole (unused on this rank)
                shape = state.graph.values[key].shape
                slices = dist.local_slices(shape, rank)
                axes = [t for t, s in enumerate(slices) if (s.start, s.stop) != (0, shape[t])]
                if not axes:
                    continue
                paddle.pir.set_insertion_point(op)
                piece = paddle._C_ops.slice(
                    op.operand_source(0), axes, [slices[t].start for t in axes], [slices[t].stop for t in axes], [1] * len(axes), []
                )
                piece.persistable = True  # set_parameter / shadow_output store a persistable var
                op.operand(0).set_source(piece)
            paddle.pir.reset_insertion_point_to_end()
        return startup

    def _local_shapes(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        for key in state.graph.tensor_keys():
            value = state.graph.values[key]
            dist = state.propagation.dist(key)
            if rp.rank not in dist.mesh.ranks:
                continue  # another stage's or sub-mesh's value: erased by pipeline_split / sub_meshes
            local = dist.local_shape(value.shape, rp.rank)
            # a value annotated unlike what its producer makes is resharded right after the
            # producer: the producer's own result has the produced placement's shape
            made = produced_shape(state, key, rp.rank) or local
            if made == value.program_shape:
                continue
            pir_value = rp.value(key)
            pir_value.set_type(paddle.pir.create_shaped_type(pir_value.type(), list(made)))
            op = state.graph.ops[key[0]]
            if op.name == "pd_op.data":
                rp.ops[key[0]].set_int_array_attr("shape", list(made))

    def _shape_constants(self, state: CompileState, rp: RankProgram) -> None:
        """Reshape and expand targets and ``full`` shapes name global sizes: give them the local ones."""
        import paddle

        for op in state.graph.ops:
            if not _holds(state, op.outputs[0] if op.outputs else None, rp.rank):
                continue
            if op.name in RESHAPE_OPS or op.name in EXPAND_OPS:
                out = op.outputs[0]
                local = produced_shape(state, out, rp.rank) or _local(state, out, rp.rank)
                if local == state.graph.values[out].program_shape:
                    continue
                pir_op = rp.ops[op.index]
                paddle.pir.set_insertion_point(pir_op)
                target = paddle._pir_ops.full_int_array(list(local), paddle.int64, paddle.CPUPlace())
                pir_op.operand(1).set_source(target)
            elif op.name == "pd_op.full" and op.outputs[0] is not None:
                local = produced_shape(state, op.outputs[0], rp.rank) or _local(state, op.outputs[0], rp.rank)
                if local != state.graph.values[op.outputs[0]].program_shape:
                    rp.ops[op.index].set_int_array_attr("shape", list(local))

    def _local_scales(self, state: CompileState, rp: RankProgram) -> None:
        import paddle

        for op in state.graph.ops:
            if op.name in VECTOR_OPS or op.index not in state.propagation.op_results:
                continue
            if rp.rank not in state.propagation.op_meshes[op.index].ranks:
                continue
            factor = local_scale(state, op, rp.rank)
            if state.micro is not None:  # a mean over one micro-batch: a partial sum over them
                factor *= state.micro.scales.get(op.index, 1.0)
            if factor == 1.0:
                continue
            pir_op = rp.ops[op.index]
            paddle.pir.set_insertion_point_after(pir_op)
            for key in op.outputs:
                if key is None or not state.graph.values[key].dtype.startswith(("float", "bfloat")):
                    continue
                produced = rp.value(key)
                # the factor as a tensor of the value's own dtype: scale's float attribute is
                # float32, which would round n_local / n_global in a float64 program
                weight = paddle._C_ops.full([], float(factor), produced.dtype, paddle.CPUPlace())
                scaled = paddle._C_ops.scale(produced, weight, 0.0, True)
                rp.replaced[key] = scaled
                users = [u for u in produced.all_used_ops() if u.id() != scaled.get_defining_op().id()]
                for user in users:
                    for i in range(user.num_operands()):
                        if user.operand_source(i).is_same(produced):
                            user.operand(i).set_source(scaled)


def _holds(state: CompileState, key: Any, rank: int) -> bool:
    return key is None or key not in state.propagation.states or rank in state.propagation.dist(key).mesh.ranks


def _local(state: CompileState, key: Any, rank: int) -> tuple[int, ...]:
    return state.propagation.dist(key).local_shape(state.graph.values[key].shape, rank)


def _stored_name(op: Any) -> str | None:
    """The scope name a startup op stores its operand under (parameters and states)."""
    if op.name() == "builtin.set_parameter":
        return str(op.attrs()["parameter_name"])
    if op.name() == "builtin.shadow_output":
        return str(op.attrs()["output_name"])
    return None


def produced_shape(state: CompileState, key: Any, rank: int) -> tuple[int, ...] | None:
    """The local shape ``key``'s producer makes on ``rank`` when an annotation reshards it
    right after the producer (None when the producer already makes the final placement)."""
    produced = state.propagation.produced.get(key)
    return None if produced is None else produced.local_shape(state.graph.values[key].shape, rank)


def local_scale(state: CompileState, op: OpNode, rank: int) -> float:
    """The rule's correction factor for ``op``'s local result on ``rank`` (1.0 for most ops)."""
    rule = get_rule(op.name)
    if rule is None or type(rule).local_scale is SpmdRule.local_scale:
        return 1.0  # the rule keeps the default: local results need no correction
    required = state.propagation.op_results[op.index].inputs
    specs: list[Any] = []
    for key, dist in zip(op.inputs, required):
        if key is None:
            specs.append(None)
            continue
        value = state.graph.values[key]
        specs.append(TensorSpec(value.shape, dist, value.dtype))
    return float(rule.local_scale(specs, op.attrs, rank))
