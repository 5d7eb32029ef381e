"""Sequence parallelism: the activations between tensor-parallel regions split along the
sequence (stage: propagate -> sequence-parallel annotations -> propagate again).

Tensor parallelism (Megatron) leaves the values between its regions — the residual stream,
layer norms, dropouts — whole on every rank of the tensor-parallel axis: each rank repeats
the same norm and keeps the same activation. Sequence parallelism (Korthikanti et al. 2022)
splits them along the sequence over that axis instead. Nothing new has to be written for it:
those values are annotated ``Shard(seq)`` on the axis (strategy priority: below the user's
annotations, above anything a rule derives) and propagation and the reshard planner do the
rest — the row-parallel output's pending sum becomes a ``reduce_scatter`` into the split
residual stream, the column-parallel input an ``all_gather`` out of it, and their backward
mirrors; the wire volume of an all_gather plus a reduce_scatter equals one all_reduce's.

Which values: after a first propagation of the user's annotations, every forward activation
(floating point, two dims or more, its sequence dim — the one before the last — long enough
to split) that

* is made by a *sequence-local* op (elementwise, a norm over the last dim, dropout),
* is whole on the axis (neither split nor pending a sum there): it lies outside the tensor-
  parallel regions, where every rank holds and computes the same thing, and
* is connected, through other such values, to a tensor-parallel region (made from a row-
  parallel output's pending sum, or read by a column-parallel op): a bias add after an LM head
  that is not tensor-parallel is not.

The region's edges keep their placement: a split value read by anything else (an LM head) is
whole (gathered once, forward); a value made outside and read by the region (the embedding's
output: an embedding over split ids would make the table's gradient a pending sum) stays whole
and is sliced, and its gradient is gathered out of the region for the producer's grad op. The
parameters applied inside the region (norm scales and biases, row-parallel biases) get
gradients that are sums over the sequence pieces: all-reduced over the axis (a few values,
fused with the other gradients), as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import OpNode, ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult
from autopar.spmd import ops_where

# ops whose output row (sequence position) depends only on the same row of their inputs (declared beside their rules)
SEQUENCE_LOCAL = ops_where("sequence_local", short=True)
FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True, slots=True)
class SequenceSplit:
    """One activation split along its sequence dim (``seq_dim``), or, at the region's edge,
    kept whole on the axis (``seq_dim`` None): what and why, for explain."""

    key: ValueKey
    label: str
    seq_dim: int | None
    why: str


@dataclass(frozen=True, slots=True)
class SequenceRegions:
    """What sequence parallelism decided: the mesh dim, and each value it places."""

    axis: str  # the tensor-parallel mesh dim's name (stage sub-meshes keep the names)
    values: tuple[SequenceSplit, ...]

    def annotations(self, graph: ProgramGraph, first: PropagationResult) -> dict[ValueKey, DistAttr]:
        """Strategy annotations: split values get the axis on their sequence dim (after the dims
        already splitting it, e.g. a data-parallel batch); edge values keep their placement; the
        recomputation of a value (autopar.rewrites.recompute) is placed like it."""
        from autopar.recompute_clones import clone_outputs

        made = {}
        for v in self.values:
            dist = first.dist(v.key)
            if v.seq_dim is not None:
                mapping = [tuple(dims) for dims in dist.mapping]
                mapping[v.seq_dim] = (*mapping[v.seq_dim], dist.mesh.dim_names.index(self.axis))
                dist = DistAttr(dist.mesh, mapping=mapping, partial=dist.partial)
            made[v.key] = dist
        for key, clones in clone_outputs(graph).items():  # a recomputed value is placed as the forward's
            if key in made:
                made.update(dict.fromkeys(clones, made[key]))
        return made


def tensor_parallel_axis(graph: ProgramGraph, first: PropagationResult, mesh: ProcessMesh, asked: bool | str) -> str:
    """The mesh dim sequence parallelism splits over: the one named, or the only mesh dim that
    splits parameters after the first propagation."""
    if isinstance(asked, str):
        if asked not in mesh.dim_names:
            raise AutoparError(
                f"Strategy.sequence_parallel={asked!r}: the mesh has no dim of that name (its dims: {list(mesh.dim_names)})"
            )
        return asked
    names = sorted({first.dist(k).mesh.dim_names[d] for k, v in graph.values.items() if v.kind == "parameter"
                    for d in first.dist(k).sharded_mesh_dims()})  # fmt: skip
    if len(names) == 1:
        return names[0]
    if not names:
        raise AutoparError(
            "Strategy.sequence_parallel=True needs tensor parallelism: no parameter is split over any mesh dim "
            "(annotate column- and row-parallel weights, e.g. [None, 'mp'] and ['mp', None])"
        )
    raise AutoparError(
        f"Strategy.sequence_parallel=True: parameters are split over mesh dims {names}; name the tensor-parallel "
        f"one, e.g. Strategy(sequence_parallel={names[-1]!r})"
    )


def sequence_regions(graph: ProgramGraph, first: PropagationResult, mesh: ProcessMesh, asked: bool | str) -> SequenceRegions:
    """The values sequence parallelism places, from the first propagation (module docstring)."""
    axis = tensor_parallel_axis(graph, first, mesh, asked)
    split = _next_to_tensor_parallel(graph, first, axis, dict(_candidates(graph, first, axis)))
    exits = {key for key in split if not all(_stays_in_region(graph, first, axis, split, reader, key) for reader in _forward_readers(graph, key))}
    values = []
    for key, op in split.items():
        label = graph.values[key].label
        if key in exits:
            values.append(SequenceSplit(key, label, None, f"read whole after {op}: the sequence-parallel region ends"))
        else:
            values.append(SequenceSplit(key, label, len(graph.values[key].shape) - 2, f"made by {op} between tensor-parallel regions"))
    for key, grad_key, reader in _entries(graph, first, axis, split, exits):
        label = graph.values[key].label
        values.append(SequenceSplit(key, label, None, f"made outside the region; {reader} reads its slice"))
        if grad_key is not None:
            values.append(SequenceSplit(grad_key, graph.values[grad_key].label, None,
                                        f"gradient of {label}: gathered where backward leaves the region"))
    return SequenceRegions(axis, tuple(sorted(values, key=lambda v: v.key)))


def _candidates(graph: ProgramGraph, first: PropagationResult, axis: str) -> list[tuple[ValueKey, str]]:
    found = []
    for op in graph.ops:
        if op.role is not Role.FORWARD or op.short_name not in SEQUENCE_LOCAL or not op.outputs or op.outputs[0] is None:
            continue
        key = op.outputs[0]
        value, dist = graph.values[key], first.dist(key)
        if value.kind != "activation" or value.dtype not in FLOATS or len(value.shape) < 2:
            continue
        if axis not in dist.mesh.dim_names or _on(dist, axis) or value.shape[-2] < dist.mesh.shape[dist.mesh.dim_names.index(axis)]:
            continue
        found.append((key, str(op)))
    return found


def _next_to_tensor_parallel(graph: ProgramGraph, first: PropagationResult, axis: str, candidates: dict[ValueKey, str]) -> dict[ValueKey, str]:
    """The candidates connected (through each other) to a tensor-parallel region: made from a
    row-parallel output's pending sum, or read by a tensor-parallel op. A residual stream is one
    such group; a bias add after a replicated LM head is not part of any."""
    linked: dict[ValueKey, set[ValueKey]] = {key: set() for key in candidates}
    start = []
    for key in candidates:
        producer = graph.ops[key[0]]
        for k in producer.inputs:
            if k in linked:
                linked[key].add(k)
                linked[k].add(key)
        pending = any(k is not None and _on(first.dist(k), axis, splits=False) for k in producer.inputs)
        if pending or any(_tensor_parallel(first, axis, reader, key) for reader in _forward_readers(graph, key)):
            start.append(key)
    reached = set(start)
    while start:
        for k in linked[start.pop()] - reached:
            reached.add(k)
            start.append(k)
    return {key: op for key, op in candidates.items() if key in reached}


def _tensor_parallel(first: PropagationResult, axis: str, reader: OpNode, key: ValueKey) -> bool:
    """Another operand of ``reader`` is split over the axis (it reads ``key`` whole: an all_gather)."""
    return any(k is not None and k != key and _on(first.dist(k), axis, pending=False) for k in reader.inputs)


def _on(dist: DistAttr, axis: str, splits: bool = True, pending: bool = True) -> bool:
    """``dist`` splits a dim over the named mesh dim, or has a sum pending over it."""
    if axis not in dist.mesh.dim_names:
        return False
    index = dist.mesh.dim_names.index(axis)
    return (splits and index in dist.sharded_mesh_dims()) or (pending and index in dist.partial_dims)


def _forward_readers(graph: ProgramGraph, key: ValueKey) -> list[OpNode]:
    return [graph.ops[u] for u in graph.values[key].users if graph.ops[u].role is Role.FORWARD]


def _stays_in_region(graph: ProgramGraph, first: PropagationResult, axis: str, split: dict, reader: OpNode, key: ValueKey) -> bool:
    """A reader of a split value that keeps the region: a sequence-local op making a split value,
    or a tensor-parallel op (another of its operands is split over the axis; it reads this one
    whole: an all_gather)."""
    if reader.short_name in SEQUENCE_LOCAL:
        return bool(reader.outputs) and reader.outputs[0] in split
    return _tensor_parallel(first, axis, reader, key)


def _entries(graph: ProgramGraph, first: PropagationResult, axis: str, split: dict, exits: set) -> list[tuple[ValueKey, ValueKey | None, OpNode]]:
    """Values made outside the region (whole on the axis) that a region op reads — a local
    slice forward. They keep their placement (else propagation would carry the split back into
    their producer: an embedding over split ids makes the table's gradient a pending sum), and
    so does their gradient, which comes out of the region split: the producer's grad op reads
    it gathered, as the backward of Megatron's scatter into the region does."""
    found = []
    for key, value in graph.values.items():
        if key in split or value.kind != "activation" or graph.ops[key[0]].role is not Role.FORWARD:
            continue
        readers = [r for r in _forward_readers(graph, key) if r.short_name in SEQUENCE_LOCAL and r.outputs and r.outputs[0] in split and r.outputs[0] not in exits]
        if not readers or _on(first.dist(key), axis):
            continue
        found.append((key, _gradient_read_by_grad_op(graph, key), readers[0]))
    return found


def _gradient_read_by_grad_op(graph: ProgramGraph, key: ValueKey) -> ValueKey | None:
    """The gradient of ``key`` as its producer's grad op reads it (``out_grad``), if any."""
    producer = key[0]
    for op in graph.ops:
        if op.forward_op != producer:
            continue
        grads = [k for k, name in zip(op.inputs, op.input_names) if k is not None and name.endswith("_grad")
                 and graph.values[k].shape == graph.values[key].shape]  # fmt: skip
        if len(grads) == 1:
            return grads[0]
    return None
