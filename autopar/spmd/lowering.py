"""Per-op lowerings a rule declares: ops whose local kernel is wrong on the placements its rule
keeps, and which each rank's program must compute differently (stage: propagate -> lowered).

A rule may keep a split that Paddle's kernel cannot run on the local piece: a vocabulary-split
row (softmax, cross-entropy, embedding), batch statistics over a split batch, a dropout mask
drawn over the local shape. Such a rule declares a :class:`Lowering` (``register_rule(...,
lowering=...)`` or a ``lowering`` class attribute); one pass (:mod:`autopar.passes.op_lowering`)
walks every lowering the registry declares (:func:`autopar.spmd.registry.lowerings`):

- ``match(site)`` (pure, here): the decision for one op from what propagation gave it, or None
  when the local kernel is exact;
- ``group(decision)``: the mesh dims of the collectives the lowering will emit (planned once,
  at compile time);
- the emission (Paddle ops in one rank's program) is the lowering's emitter in
  :mod:`autopar.passes.op_lowering` — kept out of this package because it emits planned
  reshards (``autopar.passes``), which depend on the rules.

A new per-op lowering (ring attention for context parallelism) is a ``Lowering`` declared by its
rule plus one emitter: the scaffold (which ops, which ranks, the insertion point) is the pass's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr


@dataclass(frozen=True, slots=True)
class OpSite:
    """What a lowering's ``match`` sees of one op: its name, attributes, the placements its rule
    required of its operands, their global shapes, and the dim of each operand micro-batching
    splits (None: not micro-batched); ``orders``: each operand's
    :class:`~autopar.rank_plan.SequenceOrder` under ``ContextParallel(balance="zigzag")``
    (None: in serial order)."""

    name: str
    attrs: Mapping[str, Any]
    inputs: tuple[DistAttr | None, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    micro_dims: tuple[int | None, ...]
    orders: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Lowering:
    """A per-op rewrite a rule declares (module docstring).

    ``name`` and ``ensures`` say what the rank program has after it (``dist.passes`` and the
    stage list show them); ``order`` fixes the order the pass runs the lowerings in (never the
    registration order); ``group`` is None for a lowering that emits no collective.
    """

    name: str
    ensures: str
    order: int
    match: Callable[[OpSite], Any]
    group: Callable[[Any], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.ensures:
            raise ValueError(f"a lowering needs a name and the stage it ensures, got {self.name!r} / {self.ensures!r}")

    def __str__(self) -> str:
        return self.name
