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


# ---- what else the compiler knows of an op -----------------------------------------------------
# Facts other stages ask of an op by name, declared beside the op's rule (``declare``) or, for an
# op without a rule, in autopar/spmd/op_traits.py; asked as ``ops_where(trait)``. Every trait is
# named here with what it means; declaring an unknown one, or one op's trait twice with
# different values, is an error.
TRAIT_MEANINGS: dict[str, str] = {
    "keeps_split": "a column split passes through it on its way to a row-parallel matmul (autopar.suggest)",
    "neutral_source": "makes a constant, table or mask that does not decide a split (autopar.suggest)",
    "normalizing": "sees the whole hidden dim at once: a split cannot pass it (autopar.suggest)",
    "to_loss": "may stand between an output head and its loss (autopar.suggest)",
    "passes_ids": "token ids may pass it on their way from a feed to an embedding (autopar.suggest)",
    "sequence_local": "its output row (sequence position) depends only on the same row of its inputs (sequence parallelism)",
    "flops_per_element": "an elementwise op's FLOPs per output element (cost model)",
    "random": "draws random numbers: a clone would draw again (recompute)",
    "side_effect": "acts beyond its results (printing, communicating): never dead (dead-op removal)",
    "free": "costs no kernel time: feeds, parameters, constants, builtin plumbing (cost report, pricing)",
    "collective": "a collective op of a rank program (cost report)",
    "global_norm": "a per-gradient norm that global-norm clipping sums (causes)",
    "norm_plumbing": "what global-norm clipping does between the per-gradient norms and the scale (causes)",
    "rescales": "makes a clipped (or otherwise rescaled) gradient from the raw one (causes)",
    "matmul_like": "a matrix product (causes)",
    "takes_apart": "takes a dim apart by sizes (reshape, split): a split dim's pieces may not line up with them (explain's hint)",
    "shape_read": "returns its input's shape as a tensor: of a static shape, a constant (the static-shape rewrite)",
    "shape_attr": "writes a shape into an attribute (a reshape's target, a full's shape) that shrinks with a micro-batch",
    "contracts": "sums its input's last dim (a _grad: its rows) into each output: rounding grows with that length (autopar.check)",
    "updates_parameter": "an optimizer's in-place update of a parameter: its op is in the update phase (graph roles)",
    "loss_seed": "a constant that may seed the backward (the loss gradient's ones) (graph roles)",
    "packs_vector": "packs values into a vector or takes one apart (builtin.combine / split): the graph reads through it",
    "scales_in_place": "updates the gradients of dynamic loss scaling in place: readers after it read its results (the loss-scaling rewrite)",
    "moves_loss_scale": "moves dynamic loss scaling's scale and step counts from the agreed overflow flag, its operand 1 (pipeline split: the stages agree on it first)",
    "checks_overflow": "makes dynamic loss scaling's overflow flag (found_inf) from the gradients it reads: every rank holding a piece of them must agree on it (causes, pipeline split)",
    "cpu_float16": "reads and makes float16 as it is on Paddle's CPU build (a cast, a parameter or state read from the scope, a parameter refreshed from its master): the float16 O2 twin keeps it float16 (autopar.testing.amp)",
    "cpu_twinned": "its bfloat16 / float16 kernel cannot run (or is wrong) on Paddle's CPU build: the numerics twin runs its fp32 kernel on rounded inputs, given these attributes in order, or (\"on_master\") the update on the fp32 master (autopar.testing.amp)",
    "splits_pieces": "takes a tensor apart into equal pieces along one dim (split, concat_grad): pieces placed on the sub-meshes of a mesh dim's shards make it a view, no collective (autopar/sub_meshes.py)",
    "joins_pieces": "puts pieces together, \"concat\" along its axis or \"sum\": pieces from the sub-meshes of a mesh dim's shards make it a view (autopar/sub_meshes.py)",
    "attention_middle": "may stand between an attention core's scores and its softmax: a scale, a mask (autopar.attention_cores)",
    "zigzag_passes": "how a value's zig-zag order of the sequence passes it when its rule has no equation: \"reshape\" (followed by element count), \"in_place\" (dims kept in place, right-aligned), \"reduces\" (the reduced dims drop out) (autopar.zigzag_values)",
    "triangle": "keeps a matrix's triangle by a diagonal counted from its corner: a block of it shifts the diagonal (ring attention)",
    "optimizer_cost": "an optimizer update's (FLOPs per parameter element, optimizer states per parameter) (cost model)",
}
TRAITS: dict[str, dict[str, object]] = {}  # op name without "pd_op." (other dialects kept: "builtin.split") -> trait -> value


def _trait_key(op_name: str) -> str:
    return op_name.removeprefix("pd_op.")


def declare(*op_names: str, **traits: object) -> None:
    """Declare ``traits`` (names of :data:`TRAIT_MEANINGS`) of ``op_names`` (PIR names; ``pd_op.``
    may be left out, an in-place variant is its own name)."""
    unknown = sorted(set(traits) - set(TRAIT_MEANINGS))
    if unknown:
        raise ValueError(f"unknown op traits {unknown}; the traits are {sorted(TRAIT_MEANINGS)}")
    for name in op_names:
        known = TRAITS.setdefault(_trait_key(name), {})
        for trait, value in traits.items():
            if trait in known and known[trait] != value:
                raise ValueError(f"{name} already declares {trait}={known[trait]!r}, not {value!r}")
            known[trait] = value


def ops_where(trait: str, short: bool = False) -> frozenset[str]:
    """The ops declaring ``trait`` (truthy): full names (``pd_op.add``, ``builtin.split``), or with
    ``short`` the names without their dialect (``add``, ``split``: what ``OpNode.short_name`` is)."""
    if trait not in TRAIT_MEANINGS:
        raise ValueError(f"unknown op trait {trait!r}; the traits are {sorted(TRAIT_MEANINGS)}")
    keys = [key for key, traits in TRAITS.items() if traits.get(trait)]
    if short:
        return frozenset(key.rsplit(".", 1)[-1] for key in keys)
    return frozenset(key if "." in key else f"pd_op.{key}" for key in keys)


def trait_values(trait: str) -> dict[str, object]:
    """``{op name without pd_op.: value}`` of every op declaring ``trait`` (``flops_per_element``)."""
    if trait not in TRAIT_MEANINGS:
        raise ValueError(f"unknown op trait {trait!r}; the traits are {sorted(TRAIT_MEANINGS)}")
    return {key: traits[trait] for key, traits in sorted(TRAITS.items()) if trait in traits}
