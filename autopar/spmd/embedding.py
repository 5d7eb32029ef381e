"""embedding and embedding_grad (stage: propagate).

    embedding       ab,vh -> abh       (ids, weight -> out; out P(sum) over v's mesh dims)
    embedding_grad  ab,vh,abh -> vh    (ids, weight, out_grad -> weight_grad)

Ids keep their split (data / sequence parallel) and a hidden-dim split of the weight gives a
hidden-split output. A vocabulary split of the table (Megatron's VocabParallelEmbedding) is
kept: each rank looks up only the ids in its rows and gives zeros for the others, so the
output is a pending sum over the vocabulary's mesh dims (reduced where a reader needs it
whole: one all_reduce of B·S·H, none before a linear reader). Paddle's ``embedding`` kernel
looks ids up in the local table, so that masked lookup is a per-rank rewrite
(:mod:`autopar.passes.vocab_parallel`, decomposition in :mod:`autopar.spmd.vocab_parallel`).
weight_grad scatters out_grad rows by id: split like the table, partial over the ids' mesh
dims (each rank saw only its ids) and linear in out_grad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import letters
from autopar.spmd.registry import register_rule
from autopar.spmd.vocab_parallel import VOCAB_ROWS


def embedding_letters(ids_ndim: int) -> tuple[str, str, str]:
    """Letters of ids, weight (``vocab`` ``hidden``) and out."""
    ids = letters(ids_ndim)
    vocab, hidden = "y", "z"
    return ids, vocab + hidden, ids + hidden


def _embedding(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(ids, weight) -> out``: ``ab,vh -> abh``."""
    ids, weight, out = embedding_letters(inputs[0].ndim)
    return equation([ids, weight], [out])


def _embedding_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(ids, weight, out_grad) -> weight_grad``: ``ab,vh,abh -> vh``."""
    return list(embedding_letters(inputs[0].ndim))


register_rule(EinsumRule(_embedding), "embedding", lowering=VOCAB_ROWS)
register_rule(
    EquationGradRule(_embedding_grad_letters, grad=2, results=(1,), shape_only=()), "embedding_grad", lowering=VOCAB_ROWS
)
