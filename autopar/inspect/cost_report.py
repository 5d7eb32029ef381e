"""``DistributedProgram.cost``: predicted step time, comm bytes and peak memory per rank
(stage: cost report).

Time is the strategy search's pricing (:mod:`autopar.pricing`, one pricing for both),
asked for every rank: each op's roofline on the rank's local shapes (from the placements
compile planned) at the rates the profile's device achieves plus its fixed cost, every
micro-batch's forward and backward and the update, the step's program runs, the collectives
the rank takes part in (a per-micro-batch reshard once per micro-batch, a gradient bucket once
a step; where collectives run beside compute, what of the gradient buckets runs behind the
backward is not exposed), and a pipeline's bubble. The step is the slowest stage's, as
``price_plan`` prices it. Ops the cost model has no formula for are priced as pure memory
traffic and listed in ``unpriced``. Memory (:func:`autopar.cost_model.memory_per_rank`):
parameters and their gradients by placement, optimizer states from the program's persistable
state tensors by their placement, and the activations kept for backward — forward values
(feeds included) read by a backward op — times the micro-batches a pipeline stage holds at
once. The report names its cost profile and how it was chosen: ``Strategy(cluster=...)``, or
the hardware in use (``cpu-gloo`` without a visible GPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.cost_model import MemoryEstimate, TensorInfo, memory_per_rank, op_cost_or_traffic, tensor_bytes
from autopar.cost_model.cluster import profile_origin
from autopar.graph import Role
from autopar.spmd import ops_where
from autopar.units import format_bytes, format_time

FREE_OPS = ops_where("free")  # feeds, parameters, constants, builtin plumbing: no kernel time
COLLECTIVE_OPS = ops_where("collective")


@dataclass(frozen=True, slots=True)
class RankCost:
    """One rank's step: compute and collectives (seconds, bytes sent, count) of every
    micro-batch and the update; ``hidden``: of ``comm_time``, what runs behind its backward."""

    rank: int
    compute_time: float
    comm_time: float
    comm_bytes: int
    collectives: int
    memory: MemoryEstimate
    hidden: float = 0.0

    @property
    def step_time(self) -> float:
        """This rank alone (without a pipeline's bubble)."""
        return self.compute_time + self.comm_time - self.hidden

    @property
    def peak_memory(self) -> int:
        return self.memory.total


@dataclass(frozen=True, slots=True)
class CostReport:
    """Per-rank predictions; ``str()`` is a table."""

    cluster: str
    ranks: tuple[RankCost, ...]
    unpriced: tuple[str, ...] = ()
    profile: str = ""  # how the profile was chosen (Strategy(cluster=...) or the hardware in use)
    bubble: float = 0.0  # a pipeline's fill and drain
    step: float | None = None  # the slowest stage's step, bubble included (None: the slowest rank's)

    @property
    def step_time(self) -> float:
        if self.step is not None:
            return self.step
        return max((r.step_time for r in self.ranks), default=0.0) + self.bubble

    @property
    def comm_bytes(self) -> dict[int, int]:
        return {r.rank: r.comm_bytes for r in self.ranks}

    @property
    def peak_memory(self) -> dict[int, int]:
        return {r.rank: r.peak_memory for r in self.ranks}

    def __str__(self) -> str:
        head = ("rank", "compute", "comm", "comm bytes", "colls", "params", "grads", "opt states", "activations",
                "peak mem", "step")  # fmt: skip
        rows = [head]
        for r in self.ranks:
            m = r.memory
            rows.append((str(r.rank), format_time(r.compute_time), format_time(r.comm_time), format_bytes(r.comm_bytes),
                         str(r.collectives), format_bytes(m.parameters), format_bytes(m.gradients),
                         format_bytes(m.optimizer_states), format_bytes(m.activations), format_bytes(m.total),
                         format_time(r.step_time)))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = [f"predicted cost on {self.cluster} (one step: every micro-batch, the update, the bubble)"]
        if self.profile:
            lines.append(f"cost profile: {self.profile}")
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        hidden = max((r.hidden for r in self.ranks), default=0.0)
        if hidden:
            lines.append(f"gradient all_reduce run behind the backward: up to {format_time(hidden)} (not in the step)")
        if self.bubble:
            lines.append(f"pipeline bubble: {format_time(self.bubble)}")
        lines.append(f"step time (slowest rank): {format_time(self.step_time)}")
        if self.unpriced:
            lines.append(f"priced as memory traffic only (no FLOP formula): {', '.join(self.unpriced)}")
        return "\n".join(lines)


def _shape(value: Any) -> tuple[int, ...] | None:
    if value is None or not value.initialized() or not value.is_dense_tensor_type():
        return None
    return tuple(max(int(s), 1) for s in value.shape)


def _dtype(values: list[Any]) -> str:
    for v in values:
        if v is not None and v.initialized() and v.is_dense_tensor_type():
            return str(v.dtype).removeprefix("paddle.")
    return "float32"


def program_compute(program: Any, cluster: Any) -> float:
    """Roofline seconds of a rank program's ops read off the program itself (shapes from its
    values; no fixed cost per op): the check of the pricing's local shapes."""
    total = 0.0
    for op in program.global_block().ops:
        if op.name() not in FREE_OPS and op.name() not in COLLECTIVE_OPS:
            total += program_op_cost(op)[0].time(cluster)
    return total


def program_op_cost(op: Any) -> tuple[Any, bool]:
    """:func:`~autopar.cost_model.op_cost_or_traffic` of a PIR op on the shapes and dtype its
    values carry (the cost report's, and the kernel calibration's elements and FLOPs)."""
    ins = [s for s in map(_shape, op.operands_source()) if s is not None]
    outs = [s for s in map(_shape, op.results()) if s is not None]
    dtype = _dtype(list(op.results()) + list(op.operands_source()))
    attrs = {k: v for k, v in op.attrs().items() if k in ("transpose_x", "transpose_y")}
    return op_cost_or_traffic(op.name(), ins, outs, attrs, dtype=dtype if dtype.startswith(("float", "bfloat")) else "float32")


def saved_activations(graph: Any, resharded: frozenset[tuple[int, Any]] = frozenset()) -> list[Any]:
    """Forward values (activations and feeds) that a backward op reads: kept until backward.
    A read for the shape only (``add_grad``'s x and y: Paddle's no-need-buffer) keeps nothing,
    nor does a read served by a copy a forward reshard made (``resharded``: (op index, value)
    pairs; the copy is kept instead, :func:`kept_copies`)."""
    keys = []
    for key, value in graph.values.items():
        if value.kind not in ("activation", "feed") or graph.ops[key[0]].role is not Role.FORWARD:
            continue
        backward = [u for u in value.users if graph.ops[u].role is Role.BACKWARD and (u, key) not in resharded]
        if any(_reads_data(graph.ops[u], key) for u in backward):
            keys.append(key)
    return keys


def kept_copies(decisions: Any) -> tuple[list[TensorInfo], frozenset[tuple[int, Any]]]:
    """Resharded copies a forward read makes and a backward read reuses (the all-gathered input
    of a column-parallel linear under sequence parallelism, read again by its matmul_grad): kept
    until the backward in place of the value for that read. Also the (op index, value) reads
    they serve."""
    graph, reshards = decisions.serial(), decisions.reshards()
    planned = {r.index: r for r in reshards}
    kept, served = {}, set()
    for p in reshards:
        first = planned.get(p.shared_with) if p.shared_with is not None else None
        reader = graph.ops[p.op_index]
        if first is None or graph.ops[first.op_index].role is not Role.FORWARD or reader.role is not Role.BACKWARD:
            continue
        served.add((reader.index, p.key))
        if _reads_data(reader, p.key):
            value = graph.values[p.key]
            kept[first.index] = TensorInfo(f"{value.label} as {p.need}", value.shape, value.dtype, p.need)
    return list(kept.values()), frozenset(served)


def _reads_data(op: Any, key: Any) -> bool:
    return any(k == key and pos not in op.shape_only for pos, k in enumerate(op.inputs))


def cost_report(dist: Any) -> CostReport:
    """The :class:`CostReport` of a compiled program (see the module docstring)."""

    decisions = dist.decisions
    graph, placement = decisions.serial(), decisions.placement
    cluster = decisions.cluster
    params = [TensorInfo(v.name or v.label, v.shape, v.dtype, placement(k)) for k, v in graph.values.items()
              if v.kind == "parameter"]  # fmt: skip
    copies, served = kept_copies(decisions)
    acts = [TensorInfo(graph.values[k].label, graph.values[k].shape, graph.values[k].dtype, placement(k))
            for k in decisions.saved_activations(served)] + copies  # fmt: skip
    states = [(v, placement(k)) for k, v in graph.values.items() if v.kind == "state"]
    # ZeRO-2/3: each rank keeps only its shard of each gradient (stage 1 keeps it whole)
    zero = decisions.zero() if dist.strategy.zero_stage >= 2 else ()
    grads = {graph.values[z.param].name: z.sharded for z in zero if z.sharded is not None}
    memory = memory_per_rank(dist.mesh.ranks, params, acts, optimizer="sgd", grad_dists=grads)
    times, step = decisions.priced()
    stages = 1 + max(t.stage for t in times.values())
    ranks = []
    for rank in dist.mesh.ranks:
        t = times[rank]
        state_bytes = sum(tensor_bytes(v.shape, v.dtype, d, rank) for v, d in states)
        held = memory[rank].activations * _in_flight(dist.strategy.pipeline, t.stage, stages)
        mem = dataclasses.replace(memory[rank], optimizer_states=state_bytes, activations=held)
        ranks.append(RankCost(rank, t.compute, t.communication, t.sent, t.collectives, mem, t.hidden))
    origin = profile_origin(dist.strategy.cluster)
    return CostReport(cluster.name, tuple(ranks), _unpriced(graph), origin, step.bubble, step.step)


def _in_flight(pipeline: Any, stage: int, stages: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once (1F1B, ZB-H1: ``p - s``
    on stage ``s``; FThenB: all of them)."""
    if pipeline is None:
        return 1
    return pipeline.micro_batches if pipeline.schedule == "FThenB" else min(pipeline.micro_batches, stages - stage)


def _unpriced(graph: Any) -> tuple[str, ...]:
    """Op types the cost model prices as memory traffic only (no FLOP formula)."""
    names = set()
    for op in graph.ops:
        if op.name in FREE_OPS or op.name in COLLECTIVE_OPS or op.name in names:
            continue
        ins = [graph.values[k].shape for k in op.inputs if k is not None]
        outs = [graph.values[k].shape for k in op.outputs if k is not None]
        if not op_cost_or_traffic(op.name, ins, outs, dict(op.attrs))[1]:
            names.add(op.name)
    return tuple(sorted(name.removeprefix("pd_op.") for name in names))


def program_saved_bytes(program: Any) -> int:
    """Activation bytes a rank program keeps for its backward, read off the program itself (the
    memory model's check): the local sizes of the values made before its first gradient op and
    read at or after it (parameters, constants and optimizer states excluded; a read for the
    shape only keeps nothing). Take a native-form program: its collectives are ops in place."""
    import math

    from autopar.cost_model.cluster import dtype_bytes
    from autopar.graph import OPTIMIZER_OPS

    ops = program.global_block().ops
    first = next((i for i, op in enumerate(ops) if op.name().endswith("_grad")), len(ops))
    made = {}
    for op in ops[:first]:
        if op.name() not in ("builtin.parameter", "pd_op.full", "pd_op.full_int_array", "builtin.combine"):
            made.update((op.result(i).id, op.result(i)) for i in range(op.num_results()))
    kept = {}
    for op in ops[first:]:
        if op.name() in OPTIMIZER_OPS:  # optimizer states are persistable data, not activations
            continue
        for value in op.operands_source():
            if value.initialized() and value.id in made and not (op.name().endswith("_grad") and op.is_no_need_buffer(value)):
                kept[value.id] = value
    return sum(math.prod(v.shape) * dtype_bytes(str(v.dtype)) for v in kept.values())
