"""One rank program read against the serial program, op by op (stage: inspection).

The text diff (:mod:`autopar.inspect.diff`) and the graphviz rendering
(:mod:`autopar.inspect.render`) both walk the same :class:`RankView`: every op of the rank
program in program order, marked ``same`` / ``changed`` / ``added``, plus the serial ops the
rank dropped (``removed``, at their serial position), each with its operands and results as
stable labels, serial and local shapes, placements, and the :class:`Collective` it carries.

Labels never contain memory addresses or op ids: a serial value is named as in the graph
(``linear_0.w_0``, ``x``, ``%15.0`` = result 0 of serial op 15), a value the rank program added
is ``%+k`` (k-th added value in program order), so the views of two runs print identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.collective import Collective
from autopar.dist_attr import DistAttr
from autopar.graph import Role

NOISE_ATTRS = frozenset({"op_callstack", "stop_gradient", "place", "struct_name", "persistable"})
DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
          "bool": "b1", "int8": "i8", "uint8": "u8"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Port:
    """One operand or result: its label, serial and local type, placement (None: not a serial value)."""

    label: str
    serial_type: str = ""  # "f32[4,16]"; "" for a value the rank added
    local_type: str = ""
    dist: DistAttr | None = None
    serial_label: str = ""  # the operand the serial op read here (differs when rewired)
    kind: str = ""  # the serial value's kind: "parameter", "feed", "state", "constant", "activation"

    @property
    def changed(self) -> bool:
        return bool(self.serial_type) and self.serial_type != self.local_type

    @property
    def rewired(self) -> bool:
        return bool(self.serial_label) and self.serial_label != self.label


@dataclass
class OpView:
    status: str  # "same", "changed", "added", "removed"
    name: str
    operands: list[Port]
    results: list[Port]
    role: Role
    serial_index: int | None = None
    layer: str = ""
    attrs: dict[str, str] = field(default_factory=dict)  # shown attrs (added ops) or "name: old -> new" (changed)
    comm: Collective | None = None

    @property
    def short_name(self) -> str:
        return self.name.split(".", 1)[-1]

    @property
    def is_constant(self) -> bool:
        return self.name in ("pd_op.full_int_array", "pd_op.full")


@dataclass
class RankView:
    rank: int
    ops: list[OpView]

    def counts(self) -> dict[str, int]:
        out = {"same": 0, "changed": 0, "added": 0, "removed": 0}
        for op in self.ops:
            out[op.status] += 1
        return out


def type_text(value: Any) -> str:
    """``f32[4,16]`` for a dense tensor value, ``null`` / ``vec`` otherwise."""
    if value is None or not value.initialized():
        return "null"
    if not value.is_dense_tensor_type():
        return "vec"
    dtype = str(value.dtype).removeprefix("paddle.")
    return f"{DTYPES.get(dtype, dtype)}[{','.join(str(int(s)) for s in value.shape)}]"


def attr_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(attr_text(v) for v in value) + "]"
    if isinstance(value, str):
        return value
    return str(value).removeprefix("paddle.")


def shown_attrs(op: Any) -> dict[str, str]:
    return {k: attr_text(v) for k, v in sorted(op.attrs().items()) if k not in NOISE_ATTRS}


def rank_view(dist: Any, rank: int, after: str | None = None) -> RankView:
    """Rank ``rank``'s program (as it is after the pass ``after``, default: all passes) read
    against the serial program."""
    plan = dist.rank_plan(rank, after=after)
    graph = dist.decisions.serial()
    serial_ops = list(dist.decisions.program.global_block().ops)  # (the serial program after recompute's rewrite, if any)
    serial_labels = {
        r.id: graph.values[(i, j)].label
        for i, op in enumerate(serial_ops)
        for j, r in enumerate(op.results())
        if (i, j) in graph.values
    }
    rank_ops = list(plan.program.global_block().ops)
    by_position = {position: i for i, position in enumerate(plan.op_positions)}
    labels: dict[str, str] = {}
    keys: dict[str, Any] = {}
    for i, position in enumerate(plan.op_positions):
        op = rank_ops[position]
        for j in range(op.num_results()):
            key = (i, j)
            labels[op.result(j).id] = graph.values[key].label if key in graph.values else f"%{i}.{j}"
            keys[op.result(j).id] = key
    comms = {position: c for c, position in plan.collectives}
    views: list[OpView] = []
    pending: list[OpView] = []  # added ops take the role of the serial op that follows them
    added_values = 0
    for position, op in enumerate(rank_ops):
        index = by_position.get(position)
        if index is None:
            for j in range(op.num_results()):
                added_values += 1
                labels[op.result(j).id] = f"%+{added_values}"
            pending.append(_added_view(op, labels, keys, dist, comms.get(position)))
            continue
        view = _kept_view(graph, serial_ops[index], op, index, labels, keys, serial_labels, dist)
        for added in pending:
            added.role, added.layer = view.role, view.layer
        views.extend(pending)
        pending = []
        views.append(view)
    for added in pending:
        added.role = views[-1].role if views else Role.FORWARD
        added.layer = views[-1].layer if views else ""
    views.extend(pending)
    return RankView(rank, views)


def _dist_of(dist: Any, label_key: Any) -> DistAttr | None:
    if label_key is None or label_key not in dist.values:
        return None
    return dist.values.info(label_key).placement


def _ports(
    values: list[Any], labels: dict[str, str], keys: dict[str, Any], dist: Any, serial: list[Any] | None
) -> list[Port]:
    ports = []
    for pos, value in enumerate(values):
        label = labels.get(value.id, "?") if value.initialized() else "null"
        key = keys.get(value.id) if value.initialized() else None
        port_serial = serial[pos] if serial is not None else None
        serial_label, serial_type = "", ""
        if port_serial is not None:
            serial_label, serial_type = port_serial
        kind = dist.values.info(key).kind if key is not None and key in dist.values else ""
        ports.append(Port(label, serial_type, type_text(value), _dist_of(dist, key), serial_label, kind))
    return ports


def _serial_ports(values: list[Any], serial_labels: dict[str, str]) -> list[tuple[str, str]]:
    return [((serial_labels.get(v.id, "?") if v.initialized() else "null"), type_text(v)) for v in values]


def _kept_view(graph, serial_op, op, index, labels, keys, serial_labels, dist) -> OpView:
    node = graph.ops[index]
    serial_in = _serial_ports(list(serial_op.operands_source()), serial_labels)
    serial_out = _serial_ports(list(serial_op.results()), serial_labels)
    operands = _ports(list(op.operands_source()), labels, keys, dist, serial_in)
    results = _ports(list(op.results()), labels, keys, dist, serial_out)
    old, new = shown_attrs(serial_op), shown_attrs(op)
    attrs = {
        k: f"{old.get(k, '-')} -> {new.get(k, '-')}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    }
    changed = attrs or any(p.changed or p.rewired for p in operands + results)
    return OpView("changed" if changed else "same", node.name, operands, results, node.role, index,
                  node.layer, attrs)  # fmt: skip


def _added_view(op: Any, labels: dict[str, str], keys: dict[str, Any], dist: Any, comm: Collective | None) -> OpView:
    operands = _ports(list(op.operands_source()), labels, keys, dist, None)
    results = [Port(labels[r.id], "", type_text(r), comm.dst if comm else None) for r in op.results()]
    return OpView("added", op.name(), operands, results, Role.FORWARD, None, "", shown_attrs(op), comm)
