"""embedding and embedding_grad (stage: propagate).

    embedding       ab,1h -> abh       (ids, weight -> out)
    embedding_grad  ab,1h,abh -> 1h    (ids, weight, out_grad -> weight_grad)

Ids keep their split (data / sequence parallel) and a hidden-dim split of the weight gives a
hidden-split output. The vocabulary dim stays whole: Paddle's ``embedding`` kernel looks ids
up in the local table, so a vocab-split table would need the masked ``c_embedding`` lookup
(Megatron's VocabParallelEmbedding), which the partition pass does not emit yet; Paddle's own
rule returns a partial output there. weight_grad scatters out_grad rows by id: it is partial
over the ids' mesh dims (each rank saw only its ids) and linear in out_grad.
"""

from __future__ import annotations

from autopar.spmd.base import SpmdRule, einsum_backward, einsum_forward, einsum_grad
from autopar.spmd.operands import letters
from autopar.spmd.registry import register


def embedding_letters(ids_ndim: int) -> tuple[str, str, str]:
    ids = letters(ids_ndim)
    hidden = "z"
    return ids, "1" + hidden, ids + hidden


@register("embedding")
class EmbeddingRule(SpmdRule):
    """``(ids, weight) -> out``: ``ab,1h -> abh``."""

    def infer_forward(self, inputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_forward(f"{ids},{weight}->{out}", inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_backward(f"{ids},{weight}->{out}", inputs, outputs, ctx)


@register("embedding_grad")
class EmbeddingGradRule(SpmdRule):
    """``(ids, weight, out_grad) -> weight_grad``: ``ab,1h,abh -> 1h``."""

    def infer_forward(self, inputs, attrs, ctx):
        ids, weight, out = embedding_letters(inputs[0].ndim)
        return einsum_grad(f"{ids},{weight},{out}->{weight}", inputs, ctx, grad_operands=[2])
