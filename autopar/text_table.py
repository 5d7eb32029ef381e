"""One text table for every printed answer (stage: inspection; no dependencies).

The query API's answers (``dist.decisions``), a step's timeline and ``autopar.suggest``'s plans
print as tables a person reads: a header row, columns padded to their widest cell, and a long
last column (a rank's actions, a reason) wrapped under itself instead of running off the line.

    print("\\n".join(text_table([("rank", "actions"), ("0", "0F0 0F1 0B0 0B1")])))
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence

WIDTH = 120  # wrap the last column so that a row stays within about this many characters


def text_table(
    rows: Iterable[Sequence[str]], indent: str = "", width: int = WIDTH, right: Sequence[int] = ()
) -> list[str]:
    """The lines of ``rows`` (the first is the header) as a table: columns two spaces apart,
    padded to their widest cell (right-aligned for the column indices in ``right``), the last
    column wrapped to keep each line within ``width`` (never narrower than 40 characters)."""
    rows = [tuple(str(cell) for cell in row) for row in rows]
    if not rows:
        return []
    columns = max(len(row) for row in rows)
    rows = [row + ("",) * (columns - len(row)) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(columns - 1)]
    lead = len(indent) + sum(w + 2 for w in widths)
    room = max(width - lead, 40)
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        last = textwrap.wrap(row[-1], room, break_on_hyphens=False) or [""]
        lines.append((indent + "  ".join([*cells, last[0]])).rstrip())
        lines += [(" " * lead + more).rstrip() for more in last[1:]]
    return lines
