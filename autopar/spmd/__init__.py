"""SPMD rules: one module per op family, all registered in :mod:`autopar.spmd.registry`.

Import order does not matter; each module registers its own op names once.
"""

from autopar.spmd import (  # noqa: F401  (registration)
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
    masking,
    matmul,
    metrics,
    norm,
    norm_clip,
    optimizer,
    pad_repeat,
    reduction,
    shape_ops,
    softmax,
)
from autopar.spmd.base import Conflict, RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.registry import RULES, get_rule, register, register_rule

__all__ = ["RULES", "Conflict", "RuleContext", "RuleResult", "SpmdRule", "TensorSpec", "get_rule", "register", "register_rule"]
