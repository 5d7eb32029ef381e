"""Micro-batching: the serial program as it runs on one micro-batch (stage: serial rewrite,
before propagation).

A pipeline splits each step's global batch into ``m`` equal micro-batches and runs forward and
backward once per micro-batch; the optimizer runs once per step on the gradients summed over
the micro-batches. Which values shrink, and how, is a sharding question: micro-batches are
data parallelism along a sequential axis. So this module propagates a split of every feed's
batch dim over a 1-d ``micro_batch`` mesh of size ``m`` with the ordinary SPMD rules, and
reads off:

- each value's shape on one micro-batch (the graph's shapes become these; every later stage,
  real propagation and partition included, works on one micro-batch);
- the local correction an op's rule asks for (a mean over the micro-batch is scaled by
  1/m so that losses and gradients become partial sums over the micro-batches);
- the values pending a sum over the micro-batches: the gradients the optimizer reads (the
  runtime accumulates them) and the losses (a fetch adds the micro-batches' pieces).

An op that needs a value whole over the batch before the optimizer (batch statistics, a
reshape folding the batch into another dim) cannot run one micro-batch at a time: refused
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.propagation import propagate
from autopar.spmd import TensorSpec, get_rule
from autopar.spmd.base import SpmdRule

SHAPE_ATTR_OPS = ("pd_op.reshape", "pd_op.reshape_", "pd_op.full")


@dataclass(frozen=True)
class MicroBatching:
    """The micro-batch analysis of one program (see the module docstring)."""

    count: int
    placements: Mapping[ValueKey, DistAttr]  # over the 1-d micro_batch mesh
    scales: Mapping[int, float]  # op index -> factor applied to its float results
    feeds: Mapping[str, int]  # feed name -> the dim split into micro-batches

    def pending_sum(self, key: ValueKey) -> bool:
        """Whether ``key`` is a partial sum over the micro-batches (add the pieces)."""
        return self.placements[key].partial_dims.get(0) == "sum"

    def split_dim(self, key: ValueKey) -> int | None:
        """The dim of ``key`` split over the micro-batches (None: not split)."""
        for dim, mesh_dims in enumerate(self.placements[key].mapping):
            if mesh_dims:
                return dim
        return None


def micro_batching(graph: ProgramGraph, count: int) -> MicroBatching:
    """Analyse ``graph`` for ``count`` micro-batches and give its values their micro-batch
    shapes (the program's own shapes stay in ``ValueNode.declared``)."""
    mesh = ProcessMesh(list(range(count)), ["micro_batch"])
    feeds, annotations = {}, {}
    for key, value in graph.values.items():
        if value.kind != "feed" or not value.shape:
            continue
        if value.shape[0] % count:
            raise AutoparError(
                f"micro-batching: feed {value.label!r} has {value.shape[0]} rows (dim 0), which {count} micro-batches "
                "do not divide evenly; choose micro_batches dividing the global batch"
            )
        feeds[value.name] = 0
        annotations[key] = DistAttr(mesh, [0] + [-1] * (len(value.shape) - 1))
    result = propagate(graph, mesh, annotations, {})
    for need in result.reshards:
        op = graph.ops[need.op]
        accumulated = op.role is Role.OPTIMIZER and need.have.partial_dims == {0: "sum"} and need.need.is_replicated
        if not accumulated:
            raise AutoparError(
                f"micro-batching: {op} reads {graph.values[need.value].label} as {need.need}, but one micro-batch "
                f"holds {need.have}; the op needs the whole batch at once and cannot run one micro-batch at a time"
            )
    for op in graph.ops:  # a training dropout's micro-batches would need different rows of one mask
        required = result.op_results.get(op.index)
        if op.name == "pd_op.dropout" and not op.attrs.get("is_test", False) and required is not None:
            if required.inputs[0] is not None and required.inputs[0].sharded_mesh_dims():
                raise AutoparError(
                    f"micro-batching: {op} (training dropout) draws one mask over the whole batch; its micro-batches "
                    "would each need different rows of it: run dropout outside the pipeline, or use one micro-batch"
                )
    placements = dict(result.states)
    _shrink(graph, {k: s.dist for k, s in placements.items()})
    scales = {op.index: _scale(graph, result.op_results[op.index], op) for op in graph.ops if op.index in result.op_results}
    return MicroBatching(count, {k: s.dist for k, s in placements.items()}, {k: f for k, f in scales.items() if f != 1.0}, feeds)


def _shrink(graph: ProgramGraph, placements: Mapping[ValueKey, DistAttr]) -> None:
    for key, value in graph.values.items():
        dist = placements.get(key)
        if dist is None or value.kind == "vector":
            continue
        shapes = {dist.local_shape(value.shape, r) for r in dist.mesh.ranks}
        if len(shapes) > 1:
            raise AutoparError(
                f"micro-batching: {value.label} of shape {list(value.shape)} would split unevenly into micro-batches "
                f"({sorted(shapes)}); choose micro_batches dividing it"
            )
        value.declared, value.shape = value.shape, shapes.pop()
    for op in graph.ops:  # sizes written into an op (a reshape's target, a full's shape) shrink with its result
        out = graph.values[op.outputs[0]] if op.outputs and op.outputs[0] is not None else None
        if op.name in SHAPE_ATTR_OPS and out is not None and out.declared not in (None, out.shape) and "shape" in op.attrs:
            op.attrs = {**op.attrs, "shape": list(out.shape)}


def _scale(graph: ProgramGraph, inferred, op) -> float:
    rule = get_rule(op.name)
    if rule is None or type(rule).local_scale is SpmdRule.local_scale:
        return 1.0
    specs = [
        None if key is None else TensorSpec(graph.values[key].program_shape, dist, graph.values[key].dtype)
        for key, dist in zip(op.inputs, inferred.inputs)
    ]
    return float(rule.local_scale(specs, op.attrs, 0))
