"""Text diff of the serial program against one rank program (stage: inspection).

Reads like a unified diff, one op per line, in the rank program's order::

    --- serial program: 47 ops
    +++ rank 0 on mesh(dp=2,mp=2)[0,1,2,3]: 36 changed, 11 added, 0 removed
    @@ forward @@
    ~ %15.0 f32[4,16]->[2,8] [S(0),S(1)] = matmul(x f32[4,8]->[2,8], linear_0.w_0 f32[8,16]->[8,8])
    + %+1 f32[2,8] [S(0),R] = all_reduce(%18.0 f32[2,8]) {reduce_type=0, ring_id=0}
    #     all_reduce(sum) over [0,1]: 64 B, 6.8us; %18.0 [S(0),P(sum)] -> [S(0),R]; pd_op.add#19 reads ...
    ~ %19.0 f32[4,8]->[2,8] [S(0),R] = add(%18.0->%+1 f32[2,8], linear_1.b_0 f32[8])

Marks: ``' '`` unchanged, ``~`` changed (local shapes ``serial->local``, operands rewired
``old->new``, attributes ``old -> new``), ``+`` added by autopar (collectives, slices,
scales, shape constants), ``-`` dropped from the rank program. A ``#`` line under a
collective says why it is there, over which group, bytes and predicted time. Each result
carries its placement. No memory address or op id is printed (see :mod:`autopar.inspect.view`),
so the text is stable across runs and serves as a golden file.
"""

from __future__ import annotations

from typing import Any

from autopar.collective_kinds import kind_of
from autopar.inspect.view import OpView, Port, RankView, rank_view
from autopar.units import format_bytes, format_time

MARKS = {"same": " ", "changed": "~", "added": "+", "removed": "-"}


def _type_change(port: Port, status: str) -> str:
    if status == "removed":
        return port.serial_type
    if port.changed:
        local = port.local_type
        dtype, bracket = local.split("[", 1) if "[" in local else ("", local)
        same_dtype = port.serial_type.startswith(dtype + "[") if dtype else False
        return f"{port.serial_type}->{'[' + bracket if same_dtype else local}"
    return port.local_type


def _operand(port: Port, status: str) -> str:
    if port.label == "null":
        return "null"
    label = f"{port.serial_label}->{port.label}" if port.rewired else port.label
    return f"{label} {_type_change(port, status)}"


def _result(port: Port, status: str) -> str:
    if port.label == "null":
        return "null"
    text = f"{port.label} {_type_change(port, status)}"
    return f"{text} {port.dist}" if port.dist is not None and status != "removed" else text


def op_line(op: OpView) -> str:
    """The one-line form of an op (without the collective note)."""
    results = ", ".join(_result(p, op.status) for p in op.results)
    operands = ", ".join(_operand(p, op.status) for p in op.operands)
    name = op.name.removeprefix("pd_op.")
    line = f"{MARKS[op.status]} {results + ' = ' if results else ''}{name}({operands})"
    if op.attrs:
        sep = ": " if op.status == "changed" else "="
        line += " {" + ", ".join(f"{k}{sep}{v}" for k, v in op.attrs.items()) + "}"
    return line


def comm_note(op: OpView) -> str:
    c = op.comm
    if c is None:
        return ""
    kind = f"{c.kind}({c.reduce})" if kind_of(c.kind).reduces else c.kind
    return (
        f"#     {kind} over {list(c.group)}: {format_bytes(c.bytes)}, {format_time(c.time)}; "
        f"{c.value} {c.src} -> {c.dst}; {c.reason}"
    )


def diff_lines(view: RankView, context: int | None = None) -> list[str]:
    """Body lines of the diff; ``context``: unchanged ops kept around each change (None: all)."""
    entries: list[tuple[OpView, list[str]]] = []
    for op in view.ops:
        lines = [op_line(op)]
        if op.comm is not None:
            lines.append(comm_note(op))
        entries.append((op, lines))
    keep = [True] * len(entries)
    if context is not None:
        hot = [i for i, (op, _) in enumerate(entries) if op.status != "same"]
        keep = [False] * len(entries)
        for i in hot:
            for j in range(max(0, i - context), min(len(entries), i + context + 1)):
                keep[j] = True
    out: list[str] = []
    role, gap = None, False
    for i, (op, lines) in enumerate(entries):
        if not keep[i]:
            gap = True
            continue
        if op.role != role or gap:
            where = f" from serial op {op.serial_index}" if gap and op.serial_index is not None else ""
            out.append(f"@@ {op.role.value}{where} @@")
            role, gap = op.role, False
        out.extend(lines)
    return out


def diff_text(dist: Any, rank: int, context: int | None = None, after: str | None = None) -> str:
    """The diff of ``rank``'s program (after the pass ``after``; default: all passes) against
    the serial one (see the module docstring)."""
    view = rank_view(dist, rank, after)
    counts = view.counts()
    serial_ops = sum(1 for op in view.ops if op.status != "added")
    stage = f" after {after}" if after else ""
    head = [
        f"--- serial program: {serial_ops} ops",
        f"+++ rank {rank}{stage} on {dist.mesh}: {counts['changed']} changed, {counts['added']} added, "
        f"{counts['removed']} removed, {counts['same']} unchanged",
    ]
    return "\n".join(head + diff_lines(view, context)) + "\n"
