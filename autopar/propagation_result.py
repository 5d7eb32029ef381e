"""What propagation decides, as values (stage: propagated): a placement per value, the rule
result per op, the reshard needs and the conflicts — and the placement overrides a strategy
layers on them.

:class:`PropagationResult` is frozen and its maps read-only: one analysis hands the same result
to every strategy compiled from it (``autopar.analyze``), so no pass may edit it. A strategy
that changes placements after propagation (ZeRO's shards) states its changes as a
:class:`PlacementOverride` and :meth:`PropagationResult.overridden` makes a new result with
them layered on top (a lookup the override does not answer falls through to the analysis').
The analysis' result stays what it was; nothing is cached by hand.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from autopar.dist_attr import DistAttr
from autopar.graph import ValueKey
from autopar.mesh import ProcessMesh
from autopar.spmd import RuleResult


class Priority(enum.IntEnum):
    """Who decided a placement; a higher one is never overridden by a lower one. ``STRATEGY``:
    annotations a Strategy makes (ZeRO's state sharding, sequence-parallel activations) — below
    the user's own, above anything a rule derives. Both are *fixed*: kept where the producer
    makes something else (a reshard right after the producer)."""

    DEFAULT = 0
    REQUIRED = 1
    DERIVED = 2
    STRATEGY = 3
    USER = 4

    @property
    def fixed(self) -> bool:
        return self >= Priority.STRATEGY


@dataclass(frozen=True, slots=True)
class ValueState:
    dist: DistAttr
    priority: Priority
    source: str  # "user", "default", or the op that decided it


@dataclass(frozen=True, slots=True)
class ConflictRecord:
    """One place where placements competed, and how it was resolved."""

    op: str
    values: tuple[str, ...]
    candidates: tuple[tuple[str, str], ...]  # (who, placement)
    chosen: str
    reason: str

    def __str__(self) -> str:
        cands = "; ".join(f"{who} wants {what}" for who, what in self.candidates)
        return f"{self.op} [{', '.join(self.values)}]: {cands} -> {self.chosen} ({self.reason})"


class SiteKind(enum.Enum):
    """Where a reshard applies in the program."""

    BEFORE_READ = "before read"  # right before op ``op`` reads operand ``slot``
    AFTER_PRODUCER = "after producer"  # right after op ``op`` makes result ``slot``
    WRITE_BACK = "write back"  # after op ``op`` updated operand ``slot`` in place through a resharded copy (ZeRO)
    REFRESH = "refresh"  # once the step's updates are done: operand ``slot`` of update ``op`` into another stage's copy


@dataclass(frozen=True, slots=True)
class ReshardSite:
    kind: SiteKind
    op: int  # serial op index
    slot: int  # operand position (BEFORE_READ, WRITE_BACK: the operand whose variable is written) or result position

    def __str__(self) -> str:
        return f"{self.kind.value} op {self.op}.{self.slot}"


@dataclass(frozen=True, slots=True)
class ReshardNeed:
    """A value must change placement from ``have`` to ``need`` at ``site``."""

    site: ReshardSite
    value: ValueKey
    have: DistAttr
    need: DistAttr

    @property
    def op(self) -> int:
        return self.site.op

    def __str__(self) -> str:
        return f"v{self.value[0]}.{self.value[1]} {self.have} -> {self.need} ({self.site})"


@dataclass(frozen=True)
class PropagationResult:
    """A placement for every value, each op's rule result and sub-mesh, the reshard needs (in
    program order) and the conflicts: read only (see the module docstring).

    ``base`` / ``override``: for a result a strategy derived, the analysis' result and the
    :class:`PlacementOverride` layered on it (None for propagation's own)."""

    states: Mapping[ValueKey, ValueState]
    op_results: Mapping[int, RuleResult]
    op_meshes: Mapping[int, ProcessMesh]
    conflicts: tuple[ConflictRecord, ...] = ()
    unsupported: tuple[str, ...] = ()
    reshards: tuple[ReshardNeed, ...] = ()
    rounds: int = 0
    base: PropagationResult | None = field(default=None, repr=False, compare=False)
    override: PlacementOverride | None = field(default=None, repr=False, compare=False)

    def dist(self, key: ValueKey) -> DistAttr:
        return self.states[key].dist

    def made(self, key: ValueKey) -> DistAttr:
        """The placement ``key``'s producer makes (its own, unless resharded right after)."""
        found = self.produced.get(key)
        return found if found is not None else self.dist(key)

    @functools.cached_property
    def produced(self) -> Mapping[ValueKey, DistAttr]:
        """Values whose producer makes another placement than they have (resharded right after it)."""
        return MappingProxyType({need.value: need.have for need in self.reshards if need.site.kind is SiteKind.AFTER_PRODUCER})

    def overridden(self, override: PlacementOverride) -> PropagationResult:
        """A new result: ``override``'s placements, rule results and reshard needs over this
        one's (a value or op it does not name keeps this result's answer; this one is unchanged).
        The needs stay in program order, each op's in their order (stable), so of two reads that
        share a reshard the first in the program emits it."""
        kept = [
            need for need in self.reshards
            if need.site not in override.dropped
            and not (need.site.kind is SiteKind.AFTER_PRODUCER and need.value in override.dropped_after_producer)
        ]  # fmt: skip
        return PropagationResult(
            _layered(self.states, override.states), _layered(self.op_results, override.op_results), self.op_meshes,
            self.conflicts, self.unsupported, tuple(sorted(kept + list(override.added), key=lambda need: need.op)),
            self.rounds, base=self, override=override,
        )  # fmt: skip


@dataclass(frozen=True)
class PlacementOverride:
    """A strategy's placements after propagation, as a value (ZeRO's shards, passes/zero_sharding.py):
    the value states and op rule results it replaces, the reshard needs whose sites it takes over
    (``dropped``; ``dropped_after_producer``: values no longer resharded right after their
    producer) and the needs it adds. ``reason`` names the strategy (``ZeRO stage 2``)."""

    reason: str
    states: Mapping[ValueKey, ValueState]
    op_results: Mapping[int, RuleResult]
    dropped: frozenset[ReshardSite] = frozenset()
    dropped_after_producer: frozenset[ValueKey] = frozenset()
    added: tuple[ReshardNeed, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "states", MappingProxyType(dict(self.states)))
        object.__setattr__(self, "op_results", MappingProxyType(dict(self.op_results)))


def _layered(below: Mapping, above: Mapping) -> Mapping:
    """``above`` over ``below``, read only. Built once as one map (a lookup is a dict's, as fast
    as the analysis' own: planning and emission look placements up per op and per rank)."""
    if not above:
        return below
    merged = dict(below)
    merged.update(above)
    return MappingProxyType(merged)


def frozen_result(
    states: Mapping[ValueKey, ValueState], op_results: Mapping[int, RuleResult], op_meshes: Mapping[int, ProcessMesh],
    conflicts: Iterable[ConflictRecord], unsupported: Iterable[str], reshards: Iterable[ReshardNeed], rounds: int,
) -> PropagationResult:  # fmt: skip
    """Propagation's result, its maps made read only (propagation builds them in place)."""
    return PropagationResult(
        MappingProxyType(states), MappingProxyType(op_results), MappingProxyType(op_meshes),
        tuple(conflicts), tuple(unsupported), tuple(reshards), rounds,
    )  # fmt: skip
