"""The one registry of SPMD rules, keyed by op name (stage: propagate).

A plain dict filled by the explicit imports in ``autopar/spmd/__init__.py``. Registering a
name twice is an error, and lookup never depends on registration order. Names are Paddle's
PIR op names without the ``pd_op.`` prefix (``matmul``, ``matmul_grad``, ``adamw_``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from autopar.spmd.base import SpmdRule
from autopar.spmd.lowering import Lowering

RULES: dict[str, SpmdRule] = {}

R = TypeVar("R", bound=SpmdRule)


def register_rule(rule: SpmdRule, *op_names: str, lowering: Lowering | None = None) -> SpmdRule:
    """Register ``rule`` for ``op_names``; ``lowering``: the per-rank rewrite its ops need
    (:mod:`autopar.spmd.lowering`), declared on the rule."""
    if lowering is not None:
        if rule.lowering is not None and rule.lowering != lowering:
            raise ValueError(f"{type(rule).__name__} already declares the lowering {rule.lowering}, not {lowering}")
        rule.lowering = lowering
    for name in op_names:
        if name in RULES:
            raise ValueError(f"an SPMD rule for {name!r} is already registered ({type(RULES[name]).__name__})")
        RULES[name] = rule
    rule.op_names = tuple(rule.op_names) + tuple(op_names)
    return rule


def register(*op_names: str) -> Callable[[type[R]], type[R]]:
    """Class decorator: instantiate the rule class and register it under ``op_names``."""

    def wrap(cls: type[R]) -> type[R]:
        register_rule(cls(), *op_names)
        return cls

    return wrap


def op_key(op_name: str) -> str:
    """``pd_op.relu_`` -> ``relu_``; the registry's key space."""
    return op_name.split(".", 1)[1] if "." in op_name else op_name


def get_rule(op_name: str) -> SpmdRule | None:
    """The rule for ``op_name``; an inplace variant (``relu_``) falls back to ``relu``."""
    key = op_key(op_name)
    if key in RULES:
        return RULES[key]
    if key.endswith("_") and key[:-1] in RULES:
        return RULES[key[:-1]]
    return None


def lowerings() -> tuple[Lowering, ...]:
    """Every lowering a registered rule declares, in their declared order (one pass walks them)."""
    found: dict[str, Lowering] = {}
    for rule in RULES.values():
        if rule.lowering is not None and found.setdefault(rule.lowering.name, rule.lowering) != rule.lowering:
            raise ValueError(f"two different lowerings are named {rule.lowering.name!r}")
    ordered = sorted(found.values(), key=lambda lowering: lowering.order)
    for a, b in zip(ordered, ordered[1:]):
        if a.order == b.order:
            raise ValueError(f"the lowerings {a} and {b} declare the same order {a.order}")
    return tuple(ordered)
