"""Layer paths: the ``struct_name`` Paddle 3.3 records on every op an ``nn.Layer`` call makes
(``/Model/Decoder/DecoderLayer_3/Linear_1/``: the classes of the calls from the outermost; the
n-th call of a class under one parent is ``Class_n``), read the way users name layers.

Models nest their repeated blocks (``Model/Decoder/DecoderLayer_k``); a user naming
``"DecoderLayer"`` means those calls wherever they sit, and "each layer" (Megatron's full
recompute, a pipeline's units) means the repeated blocks, not the one ``Model`` call around
them. Shared by the pipeline cut and recompute.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

Path = tuple[str, ...]


def path_of(op: Any) -> Path:
    """An op's layer path (empty: made outside any layer)."""
    return tuple(part for part in str(op.attrs.get("struct_name") or "").split("/") if part)


def call_class(component: str) -> str:
    """``DecoderLayer_3`` -> ``DecoderLayer``."""
    return re.sub(r"_\d+$", "", component)


def repeated_depth(paths: Sequence[Path], times: int = 2) -> int | None:
    """The shallowest depth at which one layer class has at least ``times`` distinct calls
    (``Model/Decoder/DecoderLayer_k``: 3), or None."""
    deepest = max((len(p) for p in paths), default=0)
    for depth in range(1, deepest + 1):
        calls = {p[:depth] for p in paths if len(p) >= depth}
        counts = Counter(call_class(call[-1]) for call in calls)
        if counts and max(counts.values()) >= times:
            return depth
    return None


def match_end(path: Path, pattern: Sequence[str]) -> int | None:
    """Where the first run of ``path``'s components matching ``pattern`` ends (each a shell
    pattern matching a call's counted name ``Linear_2`` or its class ``Linear``), the run
    starting at any depth; a pattern whose first component is empty (written ``/Model/...``)
    matches from the top only. None: no match."""
    anchored = bool(pattern) and pattern[0] == ""
    pattern = [p for p in pattern if p]
    if not pattern:
        return None
    starts = [0] if anchored else range(len(path) - len(pattern) + 1)
    for start in starts:
        window = path[start : start + len(pattern)]
        if len(window) == len(pattern) and all(
            fnmatch.fnmatchcase(c, p) or fnmatch.fnmatchcase(call_class(c), p) for c, p in zip(window, pattern)
        ):
            return start + len(pattern)
    return None
