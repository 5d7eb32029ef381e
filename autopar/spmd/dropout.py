"""dropout and dropout_grad (stage: propagate).

    dropout (training)  abcd -> abcd,abcd     (x, seed_tensor, p -> out, mask): any split, x complete
    dropout (is_test)   abcd -> abcd,abcd     an elementwise scale: any split
    dropout_grad        abcd,abcd -> abcd     (mask, out_grad, p -> x_grad)

Distributed must equal serial, so every rank must drop exactly the elements the serial run
drops. The kernel draws its mask from a seeded generator over the *local* shape: two ranks
holding different rows would both draw the serial mask's first rows. So a training dropout on
a split input is rewritten per rank (:mod:`autopar.passes.dropout_slicing`): each rank draws
the mask over the serial shape with the op's seed and applies its own box of it — no
communication. Without a fixed seed (``fix_seed`` false: ``program.random_seed`` unset) ranks
would draw different masks; that is refused, naming the op, rather than silently diverging.
dropout_grad multiplies out_grad by the mask: elementwise, linear in out_grad.
"""

from __future__ import annotations

from autopar.errors import AutoparError
from autopar.spmd.base import SpmdRule, einsum_backward, einsum_forward, einsum_grad
from autopar.spmd.operands import letters, spread
from autopar.spmd.registry import register


@register("dropout")
class DropoutRule(SpmdRule):
    """``(x, seed_tensor, p) -> (out, mask)``."""

    def infer_forward(self, inputs, attrs, ctx):
        if not attrs.get("is_test", False) and not attrs.get("fix_seed", False) and inputs[1] is None:
            raise AutoparError(
                f"{ctx.op_name or 'dropout'} draws its mask without a fixed seed, so ranks would drop different "
                "elements than the serial run: set main_program.random_seed (or pass a seed) before building it"
            )
        names = letters(inputs[0].ndim)
        return spread(einsum_forward(f"{names}->{names},{names}", inputs[:1], ctx), [0], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names = letters(inputs[0].ndim)
        return spread(einsum_backward(f"{names}->{names},{names}", inputs[:1], outputs, ctx), [0], inputs, ctx)


@register("dropout_grad")
class DropoutGradRule(SpmdRule):
    """``(mask, out_grad, p) -> x_grad``: ``abcd,abcd -> abcd``."""

    def infer_forward(self, inputs, attrs, ctx):
        names = letters(inputs[0].ndim)
        return spread(einsum_grad(f"{names},{names}->{names}", inputs[:2], ctx, grad_operands=[1]), [0, 1], inputs, ctx)
