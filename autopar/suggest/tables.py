"""What ``autopar.suggest`` hands back, in words (stage: strategy search, its answers).

A plan's annotations (:class:`PlacementTable`: value key -> DistAttr, as before, that prints
with each value's name, kind, shape, layer and which tensor dims split over which mesh dims)
and the candidates the search skipped (:class:`Skipped`, :class:`SkippedPlans`: the mesh shape
and the strategy's features in a few words, why) read as tables, not as value ids and whole
Strategy reprs; a program still reads them as mappings and tuples.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.graph import ProgramGraph, Role, ValueKey
from autopar.strategy import Strategy
from autopar.text_table import text_table


def strategy_words(strategy: Strategy) -> str:
    """A strategy's features in a few words (``ZeRO-1, recompute, 1F1B m=4``; ``-``: none)."""
    out = []
    if strategy.zero_stage:
        out.append(f"ZeRO-{strategy.zero_stage}")
    if strategy.sequence_parallel:
        out.append("SP")
    if strategy.context_parallel is not None:
        context = strategy.context_parallel
        out.append(f"CP {context.method}{' zigzag' if context.balance else ''}")
    if strategy.recompute:
        out.append("recompute")
    pipeline = strategy.pipeline
    if pipeline is not None and pipeline.stages == 1:
        out.append(f"accumulate m={pipeline.micro_batches}")
    elif pipeline is not None:
        out.append(f"{pipeline.schedule} m={pipeline.micro_batches}")
    return ", ".join(out) or "-"


@dataclass(frozen=True, slots=True)
class PlacedValue:
    """How a plan's annotated value is known to the user."""

    label: str  # its name (``linear_0.w_0``, ``x``) or ``%7.0``
    kind: str  # "parameter", "feed", ...
    shape: tuple[int, ...]
    layer: str  # the layer that reads it first ("" when none is known)
    first_read: int  # the index of the first forward op reading it (program order)


class PlacementTable(Mapping):
    """A plan's annotations: value key -> :class:`~autopar.dist_attr.DistAttr` (a read-only
    mapping, equal to the dict it was made from), with :attr:`info` saying what each key is
    ``print`` it for a table."""

    __slots__ = ("_placements", "info")

    def __init__(self, placements: Mapping[ValueKey, DistAttr], graph: ProgramGraph) -> None:
        self._placements = dict(placements)
        self.info = {key: _placed(graph, key) for key in self._placements}

    def __getitem__(self, key: ValueKey) -> DistAttr:
        return self._placements[key]

    def __iter__(self) -> Iterator[ValueKey]:
        return iter(self._placements)

    def __len__(self) -> int:
        return len(self._placements)

    def __repr__(self) -> str:
        return f"PlacementTable({self._placements!r})"

    def by_name(self) -> dict[str, DistAttr]:
        """The placements by value name (unnamed values by their ``%op.result`` label)."""
        return {self.info[key].label: attr for key, attr in self._placements.items()}

    def __str__(self) -> str:
        if not self._placements:
            return "no annotation: every value replicated"
        meshes = {attr.mesh for attr in self._placements.values()}
        one = next(iter(meshes)) if len(meshes) == 1 else None
        rows = [("value", "kind", "shape", "layer", "placement", "split")]
        for key in sorted(self._placements, key=lambda k: (self.info[k].kind != "feed", self.info[k].first_read, k)):
            attr, value = self._placements[key], self.info[key]
            split = split_words(attr) if one is None else split_words(attr).removesuffix(f" on {one}")
            rows.append((value.label, value.kind, str(list(value.shape)), value.layer or "-", str(attr), split))
        head = [f"annotations on {one}:"] if one is not None else []
        return "\n".join(head + text_table(rows, "  " if head else ""))


def split_words(attr: DistAttr) -> str:
    """Which tensor dims a placement splits over which mesh dims (``dim 0 over dp``), partial
    sums, or ``whole``, and on which mesh (``... on mesh(dp=2)[0,1]``)."""
    names = attr.mesh.dim_names
    parts = [f"dim {d} over {' x '.join(names[m] for m in dims)}" for d, dims in enumerate(attr.mapping) if dims]
    parts += [f"partial {op} over {names[m]}" for m, op in attr.partial]
    return f"{', '.join(parts) or 'whole'} on {attr.mesh}"


def _placed(graph: ProgramGraph, key: ValueKey) -> PlacedValue:
    value = graph.values[key]
    readers = sorted(i for i in value.users if graph.ops[i].role is Role.FORWARD)
    layer = next(
        (str(graph.ops[i].attrs["struct_name"]).strip("/") for i in readers if graph.ops[i].attrs.get("struct_name")),
        "",
    )
    return PlacedValue(value.label, value.kind, tuple(value.shape), layer, readers[0] if readers else len(graph.ops))


@dataclass(frozen=True, slots=True)
class Skipped:
    """A candidate the search skipped: a mesh shape (``strategy`` None: the whole shape) or one
    strategy on it, and why. Unpacks as before: ``where, why = skipped``."""

    shape: Any  # autopar.suggest.search.Shape
    why: str
    strategy: Strategy | None = None
    world: int = 0  # the devices searched over (a shape on fewer says so)

    @property
    def where(self) -> str:
        """``dp=2 x pp=2``, ``dp=2 (2 of 3 devices)`` or ``dp=2 x pp=2 [ZeRO-1, 1F1B m=4]``."""
        n = self.shape.world
        shape = f"{self.shape} ({n} of {self.world} devices)" if n < self.world else str(self.shape)
        return shape if self.strategy is None else f"{shape} [{strategy_words(self.strategy)}]"

    def __iter__(self) -> Iterator[str]:
        return iter((self.where, self.why))

    def __getitem__(self, index: int) -> str:
        return (self.where, self.why)[index]

    def __len__(self) -> int:
        return 2

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


class SkippedPlans(tuple):
    """The candidates a search skipped (a tuple of :class:`Skipped`); ``print`` it for a table."""

    __slots__ = ()

    def __str__(self) -> str:
        if not self:
            return "nothing skipped"
        return "\n".join(text_table([("skipped", "why"), *((s.where, s.why) for s in self)]))
