"""Feeds that are indices, and their bounds: read off the serial graph at compile, checked on
the way in by the runtime (stage: graph -> runtime; the ValueTable of every RankPlan holds them).

A class label out of range reaches Paddle's kernels as it is: ``cross_entropy_with_softmax``
raises a bare IndexError from inside the interpreter, a label of 2**40 crashes its backward
(SIGSEGV), an embedding id of -1 reads memory before the table. So the feeds that reach an
op as an index — a label of ``cross_entropy`` / ``softmax_with_cross_entropy`` /
``nll_loss``, the ids of an ``embedding``, ``one_hot``'s input, the index of ``gather`` /
``index_select`` / ``take_along_axis`` — directly or through ops that only move or retype
their elements (reshape, squeeze, cast, concat, ...), are found in the serial graph with the
bound of each use (the class dim of the logits, the rows of the table), and every step's
feed is checked before it is sliced: a value out of range is an AutoparError naming the feed,
the op, the bound and the value. A feed that reaches an index op through a slice of it is
not checked (its other elements may be meant for another op).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.errors import AutoparError
from autopar.feed_names import WHOLE_BATCH

if TYPE_CHECKING:  # the runtime imports this module: no compiler module at run time
    from autopar.graph import OpNode, ProgramGraph, ValueKey

# ops whose result holds its input's elements unchanged (each one, or one of several inputs')
PASS_THROUGH = frozenset(
    f"pd_op.{name}{suffix}"
    for name in ("reshape", "squeeze", "unsqueeze", "flatten", "assign", "transpose", "cast", "expand", "concat")
    for suffix in ("", "_")
)
INTEGERS = ("int8", "int16", "int32", "int64", "uint8")


@dataclass(frozen=True, slots=True)
class IndexUse:
    """A feed read as an index: every element must lie in ``[low, bound)`` or equal ``ignored``.
    ``op``: the op reading it (``cross_entropy_with_softmax (op #12)``), ``operand`` the input;
    ``what``: where the bound comes from (``the classes: dim 1 of its input [8, 10]``)."""

    op: str
    operand: str
    bound: int
    what: str
    low: int = 0
    ignored: int | None = None

    def __str__(self) -> str:
        return f"the {self.operand} of {self.op}: [{self.low}, {self.bound}){self._ignored}, {self.what}"

    @property
    def _ignored(self) -> str:
        return f" or {self.ignored} (its ignore_index)" if self.ignored is not None else ""

    def check(self, feed: str, array: np.ndarray) -> None:
        bad = (array < self.low) | (array >= self.bound)
        if self.ignored is not None:
            bad &= array != self.ignored
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AutoparError(
                f"feed {feed!r} is the {self.operand} of {self.op}: each value must be in [{self.low}, {self.bound})"
                f"{self._ignored} ({self.what}); element {list(where)} is {array[where]} ({int(bad.sum())} of "
                f"{array.size} out of range)"
            )


def index_uses(graph: ProgramGraph) -> dict[str, tuple[IndexUse, ...]]:
    """Feed name -> the index uses its elements reach (feeds never read as an index absent)."""
    readers: dict[ValueKey, list[tuple[OpNode, int]]] = defaultdict(list)
    for op in graph.ops:
        for position, key in enumerate(op.inputs):
            if key is not None:
                readers[key].append((op, position))
    found: dict[str, list[IndexUse]] = defaultdict(list)
    for key, value in graph.values.items():
        if value.kind != "feed" or value.dtype not in INTEGERS or value.name is None:
            continue
        name = value.name.removesuffix(WHOLE_BATCH)
        for use in _uses(graph, readers, key):
            if use not in found[name]:
                found[name].append(use)
    return {name: tuple(uses) for name, uses in found.items() if uses}


def check_index_feed(name: str, array: np.ndarray, uses: Sequence[IndexUse]) -> None:
    """Refuse, by name, a feed element outside the bounds of the index ops it reaches."""
    if array.size and np.issubdtype(array.dtype, np.integer):
        for use in uses:
            use.check(name, array)


def _uses(graph: ProgramGraph, readers: Mapping[ValueKey, list[tuple[OpNode, int]]], start: ValueKey) -> Iterator[IndexUse]:
    """The index uses reached from ``start`` through pass-through ops."""
    seen, todo = {start}, [start]
    while todo:
        key = todo.pop()
        for op, position in readers.get(key, ()):
            use = _index_use(graph, op, position)
            if use is not None:
                yield use
            elif op.name in PASS_THROUGH:
                for out in op.outputs:
                    if out is not None and out not in seen and graph.values[out].dtype in INTEGERS:
                        seen.add(out)
                        todo.append(out)


def _index_use(graph: ProgramGraph, op: OpNode, position: int) -> IndexUse | None:
    """The bound ``op`` puts on its input ``position`` if that input is an index, else None."""
    operand = op.input_names[position] if position < len(op.input_names) else ""
    where = f"{op.short_name} (op #{op.index})"

    def dim(input_name: str, axis: int, what: str) -> tuple[int, str] | None:
        shape = _shape_of(graph, op, input_name)
        if shape is None or not -len(shape) <= axis < len(shape) or shape[axis] < 0:
            return None
        return shape[axis], f"{what}: dim {axis % len(shape)} of its {input_name} {list(shape)}"

    name, attrs = op.name, op.attrs
    found, low, ignored = None, 0, None
    if name == "pd_op.cross_entropy_with_softmax" and operand == "label" and not attrs.get("soft_label", False):
        found, ignored = dim("input", int(attrs.get("axis", -1)), "the classes"), int(attrs.get("ignore_index", -100))
    elif name == "pd_op.nll_loss" and operand == "label":
        found, ignored = dim("input", 1, "the classes"), int(attrs.get("ignore_index", -100))
    elif name in ("pd_op.embedding", "pd_op.embedding_") and operand == "x":
        found = dim("weight", 0, "the rows of the table")
    elif name == "pd_op.one_hot" and operand == "x":
        classes = _constant(graph, op, "num_classes")
        found = (int(classes), "the classes: its num_classes") if classes is not None and classes > 0 else None
    elif name in ("pd_op.gather", "pd_op.index_select") and operand == "index":
        axis = _constant(graph, op, "axis") if name == "pd_op.gather" else attrs.get("axis", 0)
        found = dim("x", int(axis), "the size indexed") if axis is not None else None
        low = -found[0] if found else 0  # negative indices count from the end
    elif name == "pd_op.take_along_axis" and operand == "indices":
        found = dim("arr", int(attrs.get("axis", 0)), "the size indexed")
        low = -found[0] if found else 0
    if found is None:
        return None
    bound, what = found
    if ignored is not None and low <= ignored < bound:
        ignored = None  # a class like the others
    return IndexUse(where, operand, bound, what, low, ignored)


def _shape_of(graph: ProgramGraph, op: OpNode, input_name: str) -> tuple[int, ...] | None:
    if input_name not in op.input_names:
        return None
    key = op.inputs[op.input_names.index(input_name)]
    return None if key is None else tuple(graph.values[key].shape)


def _constant(graph: ProgramGraph, op: OpNode, input_name: str) -> float | None:
    """The scalar a ``pd_op.full`` makes for input ``input_name`` (None if not a constant)."""
    if input_name not in op.input_names:
        return None
    key = op.inputs[op.input_names.index(input_name)]
    if key is None:
        return None
    producer = graph.producer(key)
    if producer.name != "pd_op.full" or "value" not in producer.attrs:
        return None
    try:
        return float(producer.attrs["value"])
    except (TypeError, ValueError):
        return None
