"""Why a collective is there, in the user's terms: the layer and the feature (stage: reshard
planning; read again by inspection).

Every collective's reason (``dist.comm_ops(rank)``, ``autopar explain``, the diffs) starts with
its *cause*: the feature that needs it — gradient sync, global-norm clipping, row-parallel
output, tensor-parallel input gradient, vocabulary-parallel embedding, batch-norm statistics,
the vocabulary-parallel head, a pipeline stage boundary, an op without an SPMD rule — and the
layer it belongs to, e.g. ``row-parallel output in GPT/TransformerLayer_1/Linear_3``.

The layer is the ``struct_name`` Paddle records on each op a static ``nn.Layer`` call makes
(``/GPT/TransformerLayer_1/Linear_3/``: the classes of the calls, a per-parent counter telling
repeated calls apart; measured on Paddle 3.3.1: forward ops only — grad, optimizer and
clipping ops carry none, ``paddle.static.name_scope`` leaves nothing). A grad op takes its forward
op's layer; a gradient, its update and the clipping that reads it take the layer of the
parameter (its first forward reader's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.graph import ProgramGraph, Role, ValueKey, once_per_graph
from autopar.spmd import ops_where

NORM_OPS = ops_where("global_norm", short=True)
# what global-norm clipping does between the per-gradient norms and the scale it applies
NORM_PLUMBING = ops_where("norm_plumbing", short=True)
# how a clipped (or otherwise rescaled) gradient is made from the raw one
RESCALES = ops_where("rescales", short=True)
MATMULS = ops_where("matmul_like", short=True)
OVERFLOW_CHECKS = ops_where("checks_overflow", short=True)
LAYERS_SHOWN = 3


def layer_of(graph: ProgramGraph, index: int) -> str:
    """The layer an op belongs to: its ``struct_name`` (grad ops: their forward op's; optimizer
    ops: the layer of the parameter they update), "" when none is known."""
    op = graph.ops[index]
    struct = op.attrs.get("struct_name", "")
    if struct:
        return str(struct).strip("/")
    if op.forward_op is not None:
        return layer_of(graph, op.forward_op)
    if op.role is Role.OPTIMIZER:
        for key in op.outputs:  # a gradient's sum over its contributions, clipping's rescale
            gradient = gradients(graph).get(key) if key is not None else None
            if gradient is not None:
                return parameter_layer(graph, gradient.param)
        if op.inputs and op.inputs[0] is not None:
            return parameter_layer(graph, op.inputs[0])
    return ""


def parameter_layer(graph: ProgramGraph, param: ValueKey) -> str:
    """The layer of a parameter: that of its first forward reader with a ``struct_name``."""
    for user in graph.values[param].users:
        if graph.ops[user].role is Role.FORWARD and graph.ops[user].attrs.get("struct_name"):
            return str(graph.ops[user].attrs["struct_name"]).strip("/")
    return ""


@dataclass(frozen=True, slots=True)
class Gradient:
    """A value holding a parameter's gradient: the raw one backward makes, or the rescaled one
    (clipped) an update reads."""

    param: ValueKey
    update: int  # the optimizer op reading it (directly or through the rescale)
    clipped: bool


@once_per_graph
def updates(graph: ProgramGraph) -> tuple[tuple[Any, Any], ...]:
    """The parameter updates (optimizer ops with a rule), each with its rule."""
    from autopar.spmd import get_rule
    from autopar.spmd.optimizer import OptimizerRule

    found = ((op, get_rule(op.name)) for op in graph.ops)
    return tuple((op, rule) for op, rule in found if isinstance(rule, OptimizerRule) and op.inputs and op.inputs[0] is not None)


@once_per_graph
def gradients(graph: ProgramGraph) -> dict[ValueKey, Gradient]:
    """Each update's gradient operand, and behind it (through ``multiply`` / ``scale`` / ``cast``
    by something smaller: global-norm clipping's factor) the raw gradient backward made."""
    out: dict[ValueKey, Gradient] = {}
    for op, rule in updates(graph):
        param = op.inputs[0]
        for i in rule.like_param:
            key = op.inputs[i] if i < len(op.inputs) else None
            if key is None or graph.values[key].kind != "activation":
                continue
            raw = _unscaled(graph, key)
            out[key] = Gradient(param, op.index, clipped=raw != key)
            if raw != key:
                out.setdefault(raw, Gradient(param, op.index, clipped=False))
    return out


def _unscaled(graph: ProgramGraph, key: ValueKey) -> ValueKey:
    """``key`` followed back through rescales by a smaller operand (a scalar factor)."""
    shape = graph.values[key].shape
    for _ in range(4):
        producer = graph.ops[key[0]]
        if producer.short_name not in RESCALES:
            return key
        same = [k for k in producer.inputs if k is not None and graph.values[k].shape == shape]
        if len(same) != 1 or graph.values[same[0]].kind != "activation":
            return key
        key = same[0]
    return key


def from_norms(graph: ProgramGraph, key: ValueKey, depth: int = 10) -> bool:
    """Whether ``key`` is made from gradient norms (global-norm clipping's squared norms, their
    sums and the clip factor ``clip_norm / max(sqrt(sum), clip_norm)``) within ``depth`` ops."""
    frontier, seen = [key], set()
    for _ in range(depth):
        nxt = []
        for k in frontier:
            producer = graph.ops[k[0]]
            if producer.short_name in NORM_OPS:
                return True
            if producer.short_name in NORM_PLUMBING and k not in seen:
                seen.add(k)
                nxt += [i for i in producer.inputs if i is not None]
        frontier = nxt
    return False


def value_layer(graph: ProgramGraph, key: ValueKey) -> str:
    """The layer of a value: a gradient's or a parameter's is the parameter's, another value's
    its producer's."""
    gradient = gradients(graph).get(key)
    if gradient is not None:
        return parameter_layer(graph, gradient.param)
    if graph.values[key].kind == "parameter":
        return parameter_layer(graph, key)
    return layer_of(graph, key[0])


def in_layer(feature: str, layer: str) -> str:
    """``feature in layer`` (just the feature when no layer is known)."""
    return f"{feature} in {layer}" if layer else feature


def layers_text(layers: Sequence[str]) -> str:
    """Distinct layer paths in order, at most a few, for a collective serving several."""
    distinct = list(dict.fromkeys(layer for layer in layers if layer))
    shown = ", ".join(distinct[:LAYERS_SHOWN])
    return shown + (f" +{len(distinct) - LAYERS_SHOWN} more" if len(distinct) > LAYERS_SHOWN else "")


def reshard_cause(state: Any, need: Any) -> str:
    """The feature and layer behind a planned reshard (see the module docstring)."""
    graph = state.graph
    reader, producer = graph.ops[need.op], graph.ops[need.value[0]]
    reduced = {d for d, _ in need.have.partial} - set(need.need.partial_dims)
    gradient = gradients(graph).get(need.value)
    if gradient is not None:
        layer = parameter_layer(graph, gradient.param)
        if reader.short_name in NORM_OPS:
            return in_layer("global-norm clipping", layer)
        over = "/".join(need.have.mesh.dim_names[d] for d in sorted(reduced))
        return in_layer(f"gradient sync over {over}" if reduced else "gradient reshard", layer)
    if from_norms(graph, need.value):
        return "global-norm clipping"
    if need.have.mesh != need.need.mesh:
        summed = [gradients(graph).get(key) for key in reader.outputs if key is not None]
        shared = next((g for g in summed if g is not None), None) if reader.role is Role.OPTIMIZER else None
        if shared is not None:  # a stage's part of a shared parameter's gradient, to the update's stage
            name = graph.values[shared.param].label
            cause = in_layer("pipeline shared parameter", parameter_layer(graph, shared.param))
            return f"{cause} (a stage's part of grad({name}), summed over its micro-batches, sent once per step)"
        return in_layer("pipeline stage boundary", layer_of(graph, reader.index) or layer_of(graph, producer.index))
    if str(reader) in state.propagation.unsupported:
        return in_layer(f"no SPMD rule for {reader.short_name}", layer_of(graph, reader.index))
    if reduced and producer.short_name in OVERFLOW_CHECKS:  # each rank checked only its pieces of the gradients
        return "loss scaling overflow flag (found_inf) agreed over " + "/".join(need.have.mesh.dim_names[d] for d in sorted(reduced))
    if reduced:
        origin = _partial_origin(state, need.value, reduced)
        return in_layer(_partial_feature(origin), layer_of(graph, origin.index) or layer_of(graph, reader.index))
    gathered = need.have.sharded_mesh_dims() - need.need.sharded_mesh_dims()
    feature = f"gathered for {reader.short_name}" if gathered else f"resharded for {reader.short_name}"
    cause = in_layer(feature, layer_of(graph, reader.index) or layer_of(graph, producer.index))
    if gathered and reader.role is Role.FORWARD and reader.short_name.removesuffix("_") in LAYOUT_READERS:
        cause += f" ({LAYOUT_HINT})"
    return cause


# a split that a reshape or a split into chunks cannot carry (ops declaring takes_apart), and how to keep it (explain)
LAYOUT_READERS = ops_where("takes_apart", short=True)
LAYOUT_HINT = (
    "the pieces of the split dim do not line up with what this op takes apart: a fused q/k/v "
    "projection split by columns and laid out [3, heads, head_dim] puts q's and k's columns on one "
    "rank; lay it out [heads, 3, head_dim] (or use separate q, k, v projections) so that each rank's "
    "columns hold whole heads and the split is kept"
)


def _partial_origin(state: Any, key: ValueKey, mesh_dims: set[int]) -> Any:
    """The op that made the pending sum over ``mesh_dims`` that ``key`` carries: followed back
    through the ops that only passed it on (they read an operand pending over those dims)."""
    graph, results = state.graph, state.propagation.op_results
    producer = graph.ops[key[0]]
    for _ in range(len(graph.ops)):
        result = results.get(producer.index)
        consumed = result.inputs if result is not None else ()
        passed = [
            k for k, attr in zip(producer.inputs, consumed)
            if k is not None and attr is not None and mesh_dims & set(attr.partial_dims)
        ]  # fmt: skip
        if not passed:
            return producer
        producer = graph.ops[passed[0][0]]
    return producer


def _partial_feature(producer: Any) -> str:
    """What leaves a pending sum behind its producer."""
    name = producer.short_name
    recomputed = producer.recomputes is not None  # a clone re-running a forward op
    if producer.role is Role.FORWARD or recomputed:
        if name in MATMULS:
            return "recomputed row-parallel output" if recomputed else "row-parallel output"
        if name.startswith("embedding"):
            return "vocabulary-parallel embedding"
        if name == "data":
            return "Partial-annotated feed"
        return f"partial {name} output"
    if producer.role is Role.BACKWARD:
        return "tensor-parallel input gradient"
    return f"partial {name} output"
