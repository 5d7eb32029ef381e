"""SPMD rules: one module per op family, all registered in :mod:`autopar.spmd.registry`.

Import order does not matter; each module registers its own op names once, with what other
stages know of them (``declare``: traits asked as ``ops_where(trait)``; ops without a rule in
:mod:`.op_traits`) and the per-op lowering a rule needs (:mod:`.lowering`).
"""

from autopar.spmd import (  # noqa: F401  (registration)
    attention,
    batch_norm,
    builtin,
    concat_split,
    conv,
    dropout,
    einsum,
    elementwise,
    embedding,
    fill,
    fused,
    gather_scatter,
    indexing,
    loss_scaling,
    masking,
    matmul,
    metrics,
    norm,
    norm_clip,
    op_traits,
    optimizer,
    pad_repeat,
    reduction,
    scan,
    shape_ops,
    softmax,
)
from autopar.spmd.base import Conflict, RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.registry import RULES, declare, get_rule, lowerings, ops_where, register, register_rule, trait_values

__all__ = [
    "RULES", "Conflict", "RuleContext", "RuleResult", "SpmdRule", "TensorSpec", "declare", "get_rule", "lowerings",
    "ops_where", "register", "register_rule", "trait_values",
]  # fmt: skip
