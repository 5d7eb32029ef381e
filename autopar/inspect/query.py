"""``dist.decisions``: what compile decided, as values — the public query API (stage: inspection).

The command line, ``autopar/inspect/`` and the README ask these questions through this module
only, never the compile state: per value (its placement, who decided it and where it is made),
per reshard (what moved, which collectives, why, bytes, time), and per strategy feature (the
pipeline's stages, schedule and shared parameters; ZeRO's shards; sequence parallelism's
regions; recompute's rewrite). Every answer is a frozen value or a tuple of them, and prints
(``print(d.pipeline())``, ``str(d.zero())``) as a table naming layers and values as the user
knows them (:mod:`autopar.text_table`).

    d = dist.decisions
    d.value("linear_0.w_0")          # ValueDecision: placement [R,S(0)], decided by "user annotation"
    [r for r in d.reshards() if r.kinds == ("all_gather",)]
    d.pipeline().shared              # parameters read on several stages: owner and copies
    d.pipeline().layers[0]           # the layers stage 0 runs ("GPT/Embedding", "GPT/Block", ...)
    d.zero(), d.sequence(), d.recompute()
    d.ops()[8].layer                 # OpDecision: the serial op #8, its role, layer and operands
    d.serial().values[key].users     # SerialValue: a value as the program has it (shape, users)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from autopar.dist_attr import DistAttr
from autopar.graph import ProgramGraph, Role, ValueKey
from autopar.layer_paths import Path, call_class, path_of, repeated_depth
from autopar.mesh import ProcessMesh
from autopar.text_table import text_table

if TYPE_CHECKING:
    from autopar.collective import Collective
    from autopar.cost_model.cluster import Cluster
    from autopar.cost_model.precision import Precision
    from autopar.passes.results import ZeroShard
    from autopar.pricing import Price, RankTimes
    from autopar.rewrites.recompute import Recomputation
    from autopar.rewrites.sequence_parallel import SequenceSplit
    from autopar.schedule import Action


@dataclass(frozen=True, slots=True)
class ValueDecision:
    """One serial value: its placement (``produced``: what its op makes, when an annotation
    reshards it right after), who decided it (``decided_by``: "user annotation", "strategy",
    the rule of an op, "default", "cost model: ..."), and where it is made."""

    key: ValueKey
    label: str  # as the user knows it: a name, ``grad(W) %12.1``, ``%7.0``
    kind: str  # "parameter", "feed", "state", "activation", "constant"
    shape: tuple[int, ...]
    dtype: str
    placement: DistAttr
    produced: DistAttr
    decided_by: str
    producer: str  # the op making it, e.g. "pd_op.matmul#8"
    layer: str  # the layer path of its producer ("" when none is known)


@dataclass(frozen=True, slots=True)
class SerialValue:
    """One value of the analysed serial program as the program has it, before any placement:
    its name (parameters, feeds, states), kind, shape (one micro-batch's under a pipeline;
    ``program_shape`` the program's) and the ops reading it."""

    key: ValueKey
    name: str | None
    kind: str  # "parameter", "feed", "state", "activation", "constant", "vector"
    shape: tuple[int, ...]
    program_shape: tuple[int, ...]
    dtype: str
    users: tuple[int, ...]  # the indices of the ops reading it

    @property
    def label(self) -> str:
        """Its name, or ``%op.result`` (the short form; :meth:`Decisions.label` says more)."""
        return self.name or f"%{self.key[0]}.{self.key[1]}"


@dataclass(frozen=True, slots=True)
class OpDecision:
    """One op of the analysed serial program: what it is (``name``, ``attrs``), which part of
    the step it belongs to (``role``) and which layer (``layer``, "" when none is known), the
    values it reads and makes (keys; None for an absent operand or a result nobody needs).
    ``str`` is ``pd_op.matmul#8``."""

    index: int
    name: str
    role: Role
    layer: str
    inputs: tuple[ValueKey | None, ...]
    outputs: tuple[ValueKey | None, ...]
    shape_only: frozenset[int]  # input positions read for their shape only (no-need-buffer)
    recomputes: int | None  # a recompute clone: the forward op whose results it makes again
    attrs: Mapping[str, object] = field(default_factory=dict, compare=False)

    @property
    def short_name(self) -> str:
        return self.name.split(".", 1)[-1]

    def __str__(self) -> str:
        return f"{self.name}#{self.index}"


@dataclass(frozen=True, slots=True)
class SerialProgram:
    """The analysed serial program as values: its ops in program order (``ops[i].index == i``)
    and every value by key, in program order."""

    ops: tuple[OpDecision, ...]
    values: Mapping[ValueKey, SerialValue] = field(compare=False)

    def tensor_keys(self) -> Iterator[ValueKey]:
        """Every value but the vectors (``builtin.combine`` / ``split`` plumbing)."""
        return (k for k, v in self.values.items() if v.kind != "vector")


@dataclass(frozen=True, slots=True)
class ReshardDecision:
    """A value moved from one placement to another: where, by which steps, why, at what price."""

    index: int
    key: ValueKey
    value: str
    op: str  # the op the reshard serves (its reader; its producer for an after-producer site)
    op_index: int
    site: str  # "before read", "after producer", "write back", "refresh"
    have: DistAttr
    need: DistAttr
    kinds: tuple[str, ...]  # the planned steps, e.g. ("all_reduce",), ("slice",), ("send_recv",)
    bytes: int
    time: float
    reason: str
    shared_with: int | None  # an earlier reshard whose result this one reuses
    dtype: str = "float32"  # what its steps move (a gradient reduced in Strategy.reduce_dtype moves that)


class Reshards(tuple):
    """Every planned reshard (a tuple of :class:`ReshardDecision`); ``print`` it for a table:
    each value by name, the op it serves, from and to which placement, the steps, bytes, time and
    the cause (a reason's words before its first colon: ``gradient sync over dp in Linear_2``)."""

    __slots__ = ()

    def __str__(self) -> str:
        from autopar.units import format_bytes, format_time

        if not self:
            return "no reshard: every value is read where and as it is made"
        moved = [r for r in self if r.shared_with is None]
        total = f"{format_bytes(sum(r.bytes for r in moved))}, {format_time(sum(r.time for r in moved))} predicted"
        rows = [("value", "for", "site", "from -> to", "steps", "bytes", "time", "why")]
        rows += [(r.value, r.op, r.site, f"{r.have} -> {r.need}", " + ".join(r.kinds) or "-", f"{format_bytes(r.bytes)} {r.dtype}",
                  format_time(r.time), r.reason.split(": ", 1)[0] if r.shared_with is None else f"reuses reshard {r.shared_with}")
                 for r in self]  # fmt: skip
        return "\n".join([f"{len(self)} reshards ({total})", *text_table(rows, "  ")])


@dataclass(frozen=True, slots=True)
class SharedParameterDecision:
    """A parameter read on several pipeline stages: updated on ``owner``, copied to ``copies``
    once per step (empty when it is sharded: the others receive it at each read)."""

    name: str
    owner: ProcessMesh
    readers: tuple[ProcessMesh, ...]
    copies: tuple[ProcessMesh, ...]


@dataclass(frozen=True, slots=True)
class PipelineDecision:
    """Stages and schedule: ``meshes`` the pipeline ranks' sub-meshes, ``stages`` each stage's
    mesh index, ``actions`` each pipeline rank's verified actions (send / recv included),
    ``layers`` each stage's layers (layer paths cut at the model's repeated blocks, in forward
    order; "" for ops outside any layer). ``print`` it: a table per stage, rank and shared
    parameter."""

    meshes: tuple[ProcessMesh, ...]
    stages: tuple[int, ...]
    micro_batches: int
    schedule: str
    actions: tuple[tuple[Action, ...], ...]
    shared: tuple[SharedParameterDecision, ...]
    layers: tuple[tuple[str, ...], ...] = ()

    def __str__(self) -> str:
        root, named = _layer_names(self.layers)
        under = f" (layers of {root})" if root else ""
        lines = [f"pipeline: {len(self.stages)} stages on {len(self.meshes)} sub-meshes, {self.schedule}, "
                 f"{self.micro_batches} micro-batches{under}"]  # fmt: skip
        rows = [("stage", "ranks", "layers")]
        rows += [(str(s), _ranks(self.meshes[m]), ", ".join(named[s]) if s < len(named) else "?")
                 for s, m in enumerate(self.stages)]  # fmt: skip
        lines += text_table(rows, "  ")
        rows = [("pipeline rank", "ranks", "actions")]
        rows += [(str(i), _ranks(mesh), " ".join(map(str, self.actions[i]))) for i, mesh in enumerate(self.meshes)]
        lines += text_table(rows, "  ")
        if self.shared:
            rows = [("shared parameter", "updated on", "read on", "copied to")]
            rows += [(p.name, _ranks(p.owner), "; ".join(map(_ranks, p.readers)),
                      "; ".join(map(_ranks, p.copies)) or "none: sharded, received at each read") for p in self.shared]  # fmt: skip
            lines += text_table(rows, "  ")
        return "\n".join(lines)


def _ranks(mesh: ProcessMesh) -> str:
    return ",".join(map(str, mesh.ranks))


def stage_layers(graph: ProgramGraph, stage_of: Mapping[int, int], stages: int) -> tuple[tuple[str, ...], ...]:
    """The layers each stage runs: the layer paths of its forward ops cut at the depth of the
    model's repeated blocks (``GPT/Block_3``, not its ``Linear_1``; without repeated blocks one
    level below the layers all ops share), in forward order; "" for ops outside any layer."""
    forward = [
        (stage_of[op.index], path_of(op)) for op in graph.ops if op.role is Role.FORWARD and op.index in stage_of
    ]
    paths = [path for _, path in forward if path]
    depth = repeated_depth(paths) or len(_common(paths)) + 1
    out: list[dict[str, None]] = [{} for _ in range(stages)]
    for stage, path in forward:
        out[stage].setdefault("/".join(path[:depth]), None)
    return tuple(tuple(names) for names in out)


def _common(paths: Sequence[Path]) -> Path:
    first = min(paths, default=(), key=len)
    for i, part in enumerate(first):
        if any(p[i] != part for p in paths):
            return first[:i]
    return first


def _layer_names(layers: tuple[tuple[str, ...], ...]) -> tuple[str, list[list[str]]]:
    """For printing: the model all layers sit in (its path), and each stage's layers below it,
    runs of three or more consecutive calls of one class written ``Block_2 … Block_5``, a layer
    split between stages marked ``(part)``."""
    paths = {name: tuple(name.split("/")) for stage in layers for name in stage if name}
    common = _common(list(paths.values()))
    if len(paths) == 1:
        common = common[:-1]
    spread = Counter(name for stage in layers for name in stage)
    named = []
    for stage in layers:
        groups: list[tuple[Path, list[str]] | str] = []  # runs (parent, calls) or plain text
        rest_of_model = []  # after the layers: the model's own ops, ops outside any layer
        for name in stage:
            rest = paths[name][len(common) :] if name else ()
            last = groups[-1] if groups else None
            if not name or not rest:
                rest_of_model.append(f"{paths[name][-1]}'s own ops" if name else "outside any layer")
            elif spread[name] > 1:
                groups.append("/".join(rest) + " (part)")
            elif isinstance(last, tuple) and last[0] == rest[:-1] and _next_call(last[1][-1], rest[-1]):
                last[1].append(rest[-1])
            else:
                groups.append((rest[:-1], [rest[-1]]))
        named.append([group if isinstance(group, str) else _run_text(*group) for group in groups] + rest_of_model)
    return "/".join(common), named


def _next_call(call: str, then: str) -> bool:
    """``then`` is the call of ``call``'s class right after it (``Block`` -> ``Block_1``)."""

    def number(name: str) -> int:
        found = re.search(r"_(\d+)$", name)
        return int(found.group(1)) if found else 0

    return call_class(then) == call_class(call) and number(then) == number(call) + 1


def _run_text(parent: Path, run: list[str]) -> str:
    prefix = "".join(f"{p}/" for p in parent)
    if len(run) < 3:
        return ", ".join(prefix + call for call in run)
    return f"{prefix}{run[0]} … {prefix}{run[-1]}"


class ZeroDecisions(tuple):
    """ZeRO's decisions: a tuple of :class:`~autopar.passes.zero_sharding.ZeroShard` (one per
    parameter update, iterate and index it as before) with the ``stage`` and each update's
    parameter ``layers``; ``print`` it for a table."""

    stage: int
    layers: tuple[str, ...]

    def __new__(cls, shards: tuple[ZeroShard, ...] = (), stage: int = 0, layers: tuple[str, ...] = ()) -> ZeroDecisions:
        made = super().__new__(cls, shards)
        made.stage, made.layers = stage, layers or ("",) * len(shards)
        return made

    def __str__(self) -> str:
        if not self:
            return "ZeRO: off"
        sharded = sum(z.sharded is not None for z in self)
        lines = [f"ZeRO stage {self.stage}: {sharded} of {len(self)} parameter updates sharded"]
        rows = [("parameter", "layer", "ranks", "whole", "sharded", "why")]
        rows += [(z.label, layer or "-", _ranks(z.whole.mesh), str(z.whole), "-" if z.sharded is None else str(z.sharded),
                  z.reason) for z, layer in zip(self, self.layers)]  # fmt: skip
        return "\n".join(lines + text_table(rows, "  "))


@dataclass(frozen=True, slots=True)
class SequenceDecision:
    """Sequence parallelism: the mesh dim (``axis``) and each value it placed (``values``:
    :class:`~autopar.rewrites.sequence_parallel.SequenceSplit`, split along ``seq_dim`` or, at
    a region's edge, whole), with the layer making each (``layers``). ``print`` it for a table."""

    axis: str
    values: tuple[SequenceSplit, ...]
    layers: tuple[str, ...]

    def __str__(self) -> str:
        split = sum(v.seq_dim is not None for v in self.values)
        lines = [f"sequence parallel over {self.axis!r}: {split} activations split along the sequence, "
                 f"{len(self.values) - split} kept whole at region edges"]  # fmt: skip
        rows = [("value", "layer", "sequence dim", "why")]
        rows += [(v.label, layer or "-", "whole" if v.seq_dim is None else str(v.seq_dim), v.why)
                 for v, layer in zip(self.values, self.layers)]  # fmt: skip
        return "\n".join(lines + text_table(rows, "  "))


def _serial_program(graph: ProgramGraph) -> SerialProgram:
    from autopar.causes import layer_of

    ops = tuple(
        OpDecision(op.index, op.name, op.role, layer_of(graph, op.index), tuple(op.inputs), tuple(op.outputs),
                   op.shape_only, op.recomputes, MappingProxyType(dict(op.attrs)))
        for op in graph.ops
    )  # fmt: skip
    values = {
        key: SerialValue(key, v.name, v.kind, tuple(v.shape), tuple(v.program_shape), v.dtype, tuple(v.users))
        for key, v in graph.values.items()
    }
    return SerialProgram(ops, MappingProxyType(values))


class Decisions:
    """The query API of one DistributedProgram (``dist.decisions``); see the module docstring."""

    def __init__(self, dist: Any, state: Any) -> None:
        """``state``: what compile decided for ``dist`` (its CompileState; only this API reads it)."""
        self._dist = dist
        self._state = state
        self._serial: SerialProgram | None = None

    # ---- the program as analysed ---------------------------------------------------------
    def serial(self) -> SerialProgram:
        """The analysed serial program's ops (roles, layers, operands) and values (shapes, users)."""
        if self._serial is None:
            self._serial = _serial_program(self._state.graph)
        return self._serial

    def ops(self) -> tuple[OpDecision, ...]:
        """The analysed serial program's ops, in program order (``serial().ops``)."""
        return self.serial().ops

    def saved_activations(self, served: frozenset[tuple[int, ValueKey]] = frozenset()) -> tuple[ValueKey, ...]:
        """Forward values a backward op reads, kept until the backward (a read for the shape
        only keeps nothing, nor does a read in ``served``: (op index, value) pairs a kept reshard
        copy serves)."""
        from autopar.inspect.cost_report import saved_activations

        return tuple(saved_activations(self._state.graph, served))

    @property
    def program(self) -> Any:
        """The serial program compile analysed (recompute's rewrite of yours, when it applies):
        a Paddle program, the one to run for a serial reference."""
        return self._state.graph.program

    @property
    def cluster(self) -> Cluster:
        """The cost model's cluster the plan was priced on."""
        return self._state.cluster

    def label(self, key: ValueKey) -> str:
        """A value as the user knows it (``grad(W) %12.1``, ``updated W``, names)."""
        return self._state.label(key)

    # ---- values ------------------------------------------------------------------------
    def value(self, item: Any) -> ValueDecision:
        """The decision for a Value of the serial program, a name, or a value key."""
        key = item if isinstance(item, tuple) else self._dist.key(item)
        return self._value(key)

    def placement(self, item: Any) -> DistAttr:
        """A value's final placement (``value(item).placement``, without the rest)."""
        key = item if isinstance(item, tuple) else self._dist.key(item)
        return self._state.propagation.dist(key)

    def values(self, kinds: tuple[str, ...] = ()) -> Iterator[ValueDecision]:
        """Every placed value (of ``kinds`` when given), in program order."""
        for key in self._state.graph.tensor_keys():
            if key in self._state.propagation.states and (not kinds or self._state.graph.values[key].kind in kinds):
                yield self._value(key)

    def _value(self, key: ValueKey) -> ValueDecision:
        from autopar.causes import layer_of

        graph, propagation = self._state.graph, self._state.propagation
        value, state = graph.values[key], propagation.states[key]
        decided = {"user": "user annotation", "strategy": "strategy", "default": "default"}.get(state.source, state.source)
        return ValueDecision(
            key, self.label(key), value.kind, tuple(value.shape), value.dtype, state.dist, propagation.made(key), decided,
            str(graph.ops[key[0]]), layer_of(graph, key[0]),
        )  # fmt: skip

    # ---- communication -----------------------------------------------------------------
    def reshards(self) -> Reshards:
        """Every planned reshard, in plan order (a tuple that prints as a table)."""
        out = []
        for planned in self._state.reshards:
            need = planned.need
            out.append(ReshardDecision(
                planned.index, need.value, self.label(need.value), str(self._state.graph.ops[need.op]), need.op,
                need.site.kind.value, need.have, need.need, tuple(step.kind.value for step in planned.plan.steps),
                planned.plan.bytes, planned.plan.time, planned.reason, planned.shared_with, planned.plan.dtype,
            ))  # fmt: skip
        return Reshards(out)

    def collectives(self, rank: int) -> list[Collective]:
        """``rank``'s collectives in program order (``dist.comm_ops(rank)``)."""
        return self._dist.comm_ops(rank)

    # ---- strategy features -------------------------------------------------------------
    def pipeline(self) -> PipelineDecision | None:
        plan = self._state.pipeline
        if plan is None:
            return None
        return PipelineDecision(
            plan.meshes, plan.stages, plan.micro_batches, plan.schedule_name,
            tuple(tuple(plan.actions[r]) for r in range(len(plan.meshes))), self._shared(),
            stage_layers(self._state.graph, plan.stage_of, len(plan.stages)),
        )  # fmt: skip

    def _shared(self) -> tuple[SharedParameterDecision, ...]:
        from autopar.causes import updates
        from autopar.shared_parameters import reader_meshes

        graph, propagation = self._state.graph, self._state.propagation
        out = []
        for update, _ in updates(graph):
            param = update.inputs[0]
            readers = reader_meshes(graph, param, propagation.op_meshes)
            if len(readers) < 2:
                continue
            owner = propagation.op_meshes.get(update.index, readers[0])
            whole = not (propagation.dist(param).sharded_mesh_dims() or propagation.dist(param).partial)
            copies = tuple(m for m in readers if m != owner) if whole else ()
            out.append(SharedParameterDecision(graph.values[param].label, owner, tuple(readers), copies))
        return tuple(out)

    def zero(self) -> ZeroDecisions:
        """ZeRO's decision per parameter update (:class:`~autopar.passes.zero_sharding.ZeroShard`:
        the shard placement, or why it stays whole), a tuple that prints as a table; empty
        without ZeRO."""
        from autopar.causes import parameter_layer

        graph = self._state.graph
        zero = tuple(self._state.zero)
        return ZeroDecisions(zero, self._dist.strategy.zero_stage, tuple(parameter_layer(graph, z.param) for z in zero))

    def sequence(self) -> SequenceDecision | None:
        """Sequence parallelism's mesh dim and the values it placed (each a
        :class:`~autopar.rewrites.sequence_parallel.SequenceSplit`), or None."""
        from autopar.causes import layer_of

        regions = self._state.sequence
        if regions is None:
            return None
        layers = tuple(layer_of(self._state.graph, v.key[0]) for v in regions.values)
        return SequenceDecision(regions.axis, tuple(regions.values), layers)

    def rewrites(self) -> tuple[tuple[str, str], ...]:
        """Each serial rewrite that ran (:mod:`autopar.rewrites`) and its one-line report, in order."""
        return tuple(self._state.rewrites)

    def priced(self) -> tuple[dict[int, RankTimes], Price]:
        """The step as the search prices it (:mod:`autopar.pricing`, one pricing for
        ``dist.cost`` and ``price_plan``): each rank's :class:`RankTimes` and the step's
        :class:`Price` (bubble, step)."""
        from autopar.pricing import rank_times, step_price

        times = rank_times(self._state, self._state.mesh.ranks)
        return times, step_price(self._state, times)

    def price(self, precision: Precision | None = None) -> Price:
        """The step's :class:`Price` as the search prices a candidate (:func:`autopar.pricing.price`:
        the first and last rank of each pipeline rank's mesh stand for it; ``priced()`` asks every
        rank). What ``autopar.suggest`` ranks plans by. ``precision``: a
        :class:`~autopar.cost_model.precision.Precision` (None: every value in its own dtype)."""
        from autopar.cost_model.precision import AS_BUILT
        from autopar.pricing import price

        return price(self._state, precision or AS_BUILT)

    def recompute(self) -> Recomputation | None:
        """Recompute's rewrite and report (:class:`~autopar.rewrites.recompute.Recomputation`: ``print``
        it), or None."""
        return self._state.recompute
