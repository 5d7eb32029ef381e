"""Graphviz rendering of one rank program against the serial one (stage: inspection).

Ops are boxes, values are edges labelled ``name  local type  placement``. What autopar
added stands out: collectives are filled red with their kind, group, bytes, predicted time
and reason (which value, from which placement to which); local slices / scales are yellow;
ops the rank dropped are grey and dashed. Forward, backward and optimizer ops sit in their
own clusters. Shape constants are left out.

Big programs stay readable: with ``collapse`` (automatic above ``max_nodes`` ops) the ops of
one layer (``struct_name``; grad ops follow their forward op) fold into one box, collectives
stay separate, and a run of layers that repeat the same structure is drawn once with ``× n``.
``layer=`` renders one layer only. The ``.dot`` text is deterministic; ``dot`` (Debian's
``graphviz`` package) turns it into SVG when it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autopar.collective_kinds import kind_of
from autopar.graph import Role
from autopar.inspect.view import OpView, RankView
from autopar.op_kinds import SOURCE_OPS
from autopar.units import format_bytes, format_time

COMM_FILL, LOCAL_FILL, REMOVED_FILL = "#f4a09c", "#fff2a8", "#eeeeee"
ROLE_FILL = {Role.FORWARD: "#f3f9f1", Role.BACKWARD: "#f4f1fa", Role.OPTIMIZER: "#f7f7f7"}
INLINE_KINDS = ("parameter", "state")  # drawn inside the op box that reads them, not as nodes


def quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _wrap(text: str, width: int = 48) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


@dataclass
class Node:
    """One box of the picture: an op, or a folded group of ops."""

    name: str
    label: str
    role: Role
    style: dict[str, str] = field(default_factory=dict)
    ops: list[OpView] = field(default_factory=list)


def _op_node(op: OpView, name: str) -> Node:
    short = op.short_name
    where = f" #{op.serial_index}" if op.serial_index is not None else " (added)"
    style = {"shape": "box", "style": "filled", "fillcolor": "white"}
    if op.comm is not None:
        c = op.comm
        kind = f"{c.kind.upper()} ({c.reduce})" if kind_of(c.kind).reduces else c.kind.upper()
        label = "\n".join([
            kind,
            f"group {list(c.group)} · {format_bytes(c.bytes)} {c.dtype} · {format_time(c.time)}",
            f"{c.value}: {c.src} → {c.dst}",
            _wrap(f"why: {c.reason}"),
        ])  # fmt: skip
        style = {"shape": "box", "style": "filled,bold,rounded", "fillcolor": COMM_FILL, "color": "#c0392b",
                 "penwidth": "2", "fontname": "Helvetica-Bold"}  # fmt: skip
        return Node(name, label, op.role, style, [op])
    if op.status == "added":
        label = f"{short} (added: local step)\n→ {', '.join(p.local_type for p in op.results)}"
        style = {"shape": "box", "style": "filled", "fillcolor": LOCAL_FILL}
        return Node(name, label, op.role, style, [op])
    if op.status == "removed":
        style = {"shape": "box", "style": "dashed,filled", "fillcolor": REMOVED_FILL, "fontcolor": "#777777"}
        return Node(name, f"{short}{where} (removed)", op.role, style, [op])
    if op.name in SOURCE_OPS:
        port = op.results[0]
        label = f"{port.label}\n{port.local_type} {port.dist or ''}".rstrip()
        if port.changed:
            label += f"\n(serial {port.serial_type})"
        style = {"shape": "ellipse", "style": "filled", "fillcolor": "#e8f0fe" if op.name == "pd_op.data" else "white"}
        return Node(name, label, op.role, style, [op])
    shapes = ", ".join(
        f"{p.serial_type} → {p.local_type}" if p.changed else p.local_type for p in op.results if p.label != "null"
    )
    inline = [p for p in op.operands if p.kind in INLINE_KINDS]
    if op.role is Role.OPTIMIZER:
        inline = inline[:1]
    reads = "".join(f"\n· {p.label} {p.local_type} {p.dist or ''}".rstrip() for p in inline)
    return Node(name, f"{short}{where} → {shapes}{reads}", op.role, style, [op])


def _inlined_source(op: OpView) -> bool:
    return op.name in SOURCE_OPS and bool(op.results) and op.results[0].kind in INLINE_KINDS


def _edge_label(op: OpView, position: int) -> str:
    port = op.operands[position]
    return f"{port.label}\n{port.local_type}{' ' + str(port.dist) if port.dist is not None else ''}"


def _groups(ops: Sequence[OpView]) -> list[list[OpView]]:
    """Consecutive ops of one layer and role form a group; a collective is a group of its own."""
    groups: list[list[OpView]] = []
    for op in ops:
        key = (op.role, op.layer)
        last = groups[-1] if groups else None
        if last and op.comm is None and last[-1].comm is None and (last[-1].role, last[-1].layer) == key and op.layer:
            last.append(op)
        else:
            groups.append([op])
    return groups


def _signature(group: list[OpView]) -> tuple:
    return tuple((op.name, op.status, tuple(p.local_type for p in op.results), op.comm.kind if op.comm else "")
                 for op in group)  # fmt: skip


def _repeats(signatures: list[tuple], max_period: int = 16) -> list[tuple[int, int, int]]:
    """Runs of repeated group sequences: (start, period, count) with count >= 2, greedy left to right."""
    runs, i = [], 0
    while i < len(signatures):
        best = (1, 1)  # (covered, period)
        for period in range(1, max_period + 1):
            count = 1
            while signatures[i + count * period : i + (count + 1) * period] == signatures[i : i + period] and \
                    len(signatures[i + count * period : i + (count + 1) * period]) == period:  # fmt: skip
                count += 1
            if count >= 2 and count * period > best[0]:
                best = (count * period, period)
        covered, period = best
        if covered > 1:
            runs.append((i, period, covered // period))
            i += covered
        else:
            i += 1
    return runs


def _group_node(group: list[OpView], name: str, count: int, last_layer: str) -> Node:
    if len(group) == 1 and count == 1:
        return _op_node(group[0], name)
    first = group[0]
    if len(group) == 1:
        node = _op_node(first, name)
        node.label = f"× {count}\n" + node.label
        return node
    title = first.layer or first.short_name
    if count > 1:
        title = f"{title} … {last_layer} (× {count}, same structure)" if last_layer else f"{title} (× {count})"
    names = [op.short_name for op in group]
    outs = [p for p in group[-1].results if p.label != "null"]
    out = f"→ {outs[0].local_type} {outs[0].dist or ''}".rstrip() if outs else ""
    label = f"{title}\n{len(group)} ops: {_wrap(', '.join(names), 40)}\n{out}".rstrip()
    style = {"shape": "box3d" if count > 1 else "box", "style": "filled", "fillcolor": "white"}
    if any(op.status == "added" for op in group):
        style["fillcolor"] = LOCAL_FILL
    return Node(name, label, first.role, style, list(group))


def _build_nodes(ops: list[OpView], collapse: bool) -> tuple[list[Node], dict[int, str]]:
    """The nodes, and for each op (by position in ``ops``) the node that shows it."""
    nodes: list[Node] = []
    owner: dict[int, str] = {}
    position = {id(op): i for i, op in enumerate(ops)}
    if not collapse:
        for i, op in enumerate(ops):
            nodes.append(_op_node(op, f"n{i}"))
            owner[i] = f"n{i}"
        return nodes, owner
    groups = _groups([op for op in ops if op.name not in SOURCE_OPS])
    runs = {start: (period, count) for start, period, count in _repeats([_signature(g) for g in groups])}
    g = 0
    while g < len(groups):
        period, count = runs.get(g, (1, 1))
        for k in range(period):
            group = groups[g + k]
            last = groups[g + (count - 1) * period + k][0].layer
            name = f"g{g + k}"
            nodes.append(_group_node(group, name, count, last if last != group[0].layer else ""))
            for rep in range(count):
                for op in groups[g + rep * period + k]:
                    owner[position[id(op)]] = name
        g += period * count
    return nodes, owner


def render_dot(view: RankView, title: str = "", collapse: bool | None = None, max_nodes: int = 120,
               layer: str | None = None) -> str:  # fmt: skip
    """The DOT text of ``view`` (see the module docstring)."""
    ops = [op for op in view.ops if not op.is_constant and not _inlined_source(op)]
    if layer is not None:
        ops = [op for op in ops if op.layer == layer]
    if collapse is None:
        collapse = len(ops) > max_nodes
    nodes, owner = _build_nodes(ops, collapse)
    producer: dict[str, int] = {}
    for i, op in enumerate(ops):
        for port in op.results:
            if port.label != "null":
                producer[port.label] = i
    lines = [
        "digraph rank_program {",
        f"  label={quote(title)}; labelloc=t; fontsize=18; fontname=Helvetica;",
        "  rankdir=TB; nodesep=0.3; ranksep=0.35;",
        '  node [fontname=Helvetica, fontsize=10]; edge [fontname=Helvetica, fontsize=8, color="#555555"];',
    ]
    for role in Role:
        members = [n for n in nodes if n.role is role]
        if not members:
            continue
        lines.append(f"  subgraph cluster_{role.value} {{")
        lines.append(
            f'    label={quote(role.value)}; style=filled; color="#cccccc"; fillcolor={quote(ROLE_FILL[role])};'
        )
        for node in members:
            attrs = ", ".join(f"{k}={quote(v)}" for k, v in node.style.items())
            lines.append(f"    {node.name} [label={quote(node.label)}, {attrs}];")
        lines.append("  }")
    lines += _edges(ops, owner, producer, collapse)
    lines += _legend()
    lines.append("}")
    return "\n".join(lines) + "\n"


def _edges(ops: list[OpView], owner: dict[int, str], producer: dict[str, int], collapse: bool) -> list[str]:
    seen: set[tuple[str, str]] = set()
    lines = []
    for i, op in enumerate(ops):
        if i not in owner:
            continue
        for pos, port in enumerate(op.operands):
            src_index = producer.get(port.label)
            if src_index is None or src_index not in owner:
                continue
            src, dst = owner[src_index], owner[i]
            if src == dst or (src, dst) in seen:
                continue
            seen.add((src, dst))
            if ops[src_index].role is not op.role and ops[src_index].role is Role.FORWARD and op.comm is None:
                # a forward value kept for backward: drawn light, without bending the layout
                lines.append(f'  {src} -> {dst} [style=dotted, color="#bbbbbb", constraint=false, arrowsize=0.5];')
                continue
            comm = op.comm is not None or ops[src_index].comm is not None
            style = ', color="#c0392b", fontcolor="#c0392b", penwidth=1.8' if comm else ""
            lines.append(f"  {src} -> {dst} [label={quote(_edge_label(op, pos))}{style}];")
    return lines


def _legend() -> list[str]:
    rows = [
        ("collective inserted by autopar", COMM_FILL),
        ("local step inserted (slice / scale)", LOCAL_FILL),
        ("op of the serial program (local shapes)", "white"),
        ("dropped from this rank", REMOVED_FILL),
    ]
    cells = "".join(
        f'<TR><TD BGCOLOR="{color}" WIDTH="18"> </TD><TD ALIGN="LEFT">{text}</TD></TR>' for text, color in rows
    )
    table = f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">{cells}' \
            '<TR><TD COLSPAN="2" ALIGN="LEFT">edges: value, local type, placement</TD></TR></TABLE>>'  # fmt: skip
    return ["  subgraph cluster_legend {", '    label="legend"; fontsize=10; color="#999999";',
            f"    legend [shape=plaintext, label={table}];", "  }"]  # fmt: skip


def dot_available() -> bool:
    return shutil.which("dot") is not None


def render_svg(dot_path: Path) -> Path:
    """Run graphviz ``dot`` on ``dot_path``; the SVG lands beside it."""
    svg = dot_path.with_suffix(".svg")
    subprocess.run(["dot", "-Tsvg", str(dot_path), "-o", str(svg)], check=True, capture_output=True, timeout=120)
    return svg
