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

from autopar.spmd.base import SpmdRule, einsum_backward, einsum_forward, einsum_grad
from autopar.spmd.operands import letters
from autopar.spmd.registry import register


def embedding_letters(ids_ndim: int) -> tuple[str, str, str]:
    """Letters of ids, weight (``vocab`` ``hidden``) and out."""
    ids = letters(ids_ndim)
    vocab, hidden = "y", "z"
    return ids, vocab + hidden, ids + hidden


@register("embedding")
class EmbeddingRule(SpmdRule):
    """``(ids, weight) -> out``: ``ab,vh -> abh``."""

    def infer_forward(self, inputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_forward(f"{ids},{weight}->{out}", inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_backward(f"{ids},{weight}->{out}", inputs, outputs, ctx)


@register("embedding_grad")
class EmbeddingGradRule(SpmdRule):
    """``(ids, weight, out_grad) -> weight_grad``: ``ab,vh,abh -> vh``."""

    def infer_forward(self, inputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_grad(f"{ids},{weight},{out}->{weight}", inputs, ctx, grad_operands=[2])
