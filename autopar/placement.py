"""Placements: how one tensor lies along ONE mesh dim (stage: annotate / propagate / plan reshards).

A :class:`DistAttr` holds one placement per mesh dim; these values are what it hands out
(``attr.placements``), what the reshard planner and the Paddle conversions speak, so no code
builds or parses ``"S(0)"`` strings to learn a placement. They exist as values (frozen,
slotted, hashable, validated on construction) so that a bad placement fails where it is
made, with the value named, and so that a placement list can be compared and cached.

- ``Shard(dim)``: the tensor dim ``dim`` is split along this mesh dim; prints ``S(0)``.
- ``Replicate()``: every rank along this mesh dim holds the same piece; prints ``R``.
- ``Partial(reduce)``: a pending reduction (sum, avg, max, min) over this mesh dim; prints
  ``P(sum)``.

One tensor dim may be split over several mesh dims. Their *order* is part of the layout
(mixed radix, the first listed is the major digit, as JAX's ``P(("x", "y"))``), and a list of
per-mesh-dim placements states it as Paddle does: ``Shard(dim, shard_order=k)`` says this
mesh dim is the ``k``-th (0 = major) of the mesh dims splitting ``dim``. When those mesh dims
split in ascending mesh-dim order every ``shard_order`` may stay 0 (the default, what Paddle
and :attr:`DistAttr.placements` write for that common case); only another order needs it, and
prints it: ``S(0)#1``. :func:`parse_placement` inverts ``str``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autopar.errors import PlacementError

REDUCE_KINDS = ("sum", "avg", "max", "min")
_PADDLE_REDUCE = {"sum": "kRedSum", "avg": "kRedAvg", "max": "kRedMax", "min": "kRedMin"}
_SHARD_TEXT = re.compile(r"S\((-?\d+)\)(?:#(\d+))?")
_PARTIAL_TEXT = re.compile(r"P\((\w+)\)")


@dataclass(frozen=True, slots=True)
class Placement:
    """Base of the placement values; use ``isinstance(p, Shard)`` and friends to tell them apart."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` split along this mesh dim (``-1`` counts from the end, resolved by DistAttr).

    ``shard_order``: this mesh dim's position (0 = major) among the mesh dims that split
    ``dim``, needed only when they split it in another than ascending mesh-dim order.
    """

    dim: int
    shard_order: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise PlacementError(f"Shard dim must be an int tensor dim, got {self.dim!r}")
        if isinstance(self.shard_order, bool) or not isinstance(self.shard_order, int) or self.shard_order < 0:
            raise PlacementError(f"Shard shard_order must be an int >= 0, got {self.shard_order!r}")

    def __str__(self) -> str:
        return f"S({self.dim})" + (f"#{self.shard_order}" if self.shard_order else "")


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along this mesh dim holds the same piece."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """A pending reduction (``sum``, ``avg``, ``max`` or ``min``) over this mesh dim."""

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if not isinstance(self.reduce, str) or self.reduce not in REDUCE_KINDS:
            raise PlacementError(f"unknown partial reduce kind {self.reduce!r}; expected one of {REDUCE_KINDS}")

    def __str__(self) -> str:
        return f"P({self.reduce})"


def parse_placement(text: str) -> Placement:
    """Invert ``str``: ``"S(0)"``, ``"S(0)#1"``, ``"R"``, ``"P(sum)"``."""
    if not isinstance(text, str):
        raise PlacementError(f"parse_placement takes the text form (S(<dim>), R or P(<reduce>)), got {text!r}")
    item = text.strip()
    if item == "R":
        return Replicate()
    if m := _SHARD_TEXT.fullmatch(item):
        return Shard(int(m.group(1)), int(m.group(2) or 0))
    if m := _PARTIAL_TEXT.fullmatch(item):
        return Partial(m.group(1))
    raise PlacementError(f"cannot parse placement {text!r}; expected S(<dim>), R or P(<reduce>)")


# ---- Paddle conversions -------------------------------------------------------------------


def to_paddle_placement(placement: Placement) -> Any:
    """Paddle's ``Shard`` / ``Replicate`` / ``Partial`` for one of ours."""
    import paddle.distributed as pdist

    if isinstance(placement, Shard):
        if placement.shard_order:
            return pdist.Shard(placement.dim, shard_order=placement.shard_order)
        return pdist.Shard(placement.dim)
    if isinstance(placement, Partial):
        return pdist.Partial(getattr(pdist.ReduceType, _PADDLE_REDUCE[placement.reduce]))
    if isinstance(placement, Replicate):
        return pdist.Replicate()
    raise PlacementError(f"not an autopar placement: {placement!r}")


def from_paddle_placement(placement: Any) -> Placement:
    """One of ours for a Paddle placement; our own values pass through unchanged."""
    if isinstance(placement, Placement):
        return placement
    import paddle.distributed as pdist

    if isinstance(placement, pdist.Shard):
        if placement.get_split_factor() != 1:
            raise PlacementError(f"{placement!r}: Paddle's split_factor is not supported")
        return Shard(placement.get_dim(), placement.get_co_shard_order())
    if isinstance(placement, pdist.Partial):
        name = placement.reduce_type().name
        kind = next((k for k, v in _PADDLE_REDUCE.items() if v == name), None)
        if kind is None:
            raise PlacementError(f"Partial reduce type {name} is not supported; expected one of {REDUCE_KINDS}")
        return Partial(kind)
    if isinstance(placement, pdist.Replicate):
        return Replicate()
    raise PlacementError(f"not a placement: {placement!r}")
