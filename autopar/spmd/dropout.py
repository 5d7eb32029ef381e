"""dropout and dropout_grad (stage: propagate).

    dropout (training)  abcd -> abcd,abcd     (x, seed_tensor, p -> out, mask): any split, x complete
    dropout (is_test)   abcd -> abcd,abcd     an elementwise scale: any split
    dropout_grad        abcd,abcd -> abcd     (mask, out_grad, p -> x_grad)

Distributed must equal serial, so every rank must drop exactly the elements the serial run
drops. The kernel draws its mask from a seeded generator over the *local* shape: two ranks
holding different rows would both draw the serial mask's first rows. So a training dropout on
a split input is rewritten per rank (:mod:`autopar.passes.dropout_slicing`): each rank draws
the mask over the serial shape with the op's seed and applies its own box of it — no
communication; under micro-batching each micro-batch applies its rows of the whole step's
mask the same way; under ``ContextParallel(balance="zigzag")``, where the input carries the
sequence in zig-zag order, the serial mask is reordered alike (its elements, moved with the
values they multiply). Without a fixed seed (``fix_seed`` false: ``program.random_seed`` unset) ranks
would draw different masks; that is refused, naming the op, rather than silently diverging.
dropout_grad multiplies out_grad by the mask: elementwise, linear in out_grad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError
from autopar.spmd.base import RuleContext, RuleResult, TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.lowering import Lowering, OpSite
from autopar.spmd.operands import letters
from autopar.spmd.registry import declare, op_key, register_rule


def _dropout(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x, seed_tensor, p) -> (out, mask)``: ``abcd -> abcd,abcd``."""
    names = letters(inputs[0].ndim)
    return f"{names}->{names},{names}"


def _dropout_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(mask, out_grad, p) -> x_grad``: ``abcd,abcd -> abcd``."""
    return [letters(inputs[0].ndim)] * 2


@dataclass(frozen=True, slots=True)
class SlicedDropout:
    """A training dropout each rank applies its box of the serial mask with; ``micro_dim``: the
    dim of its input micro-batching splits (the mask is then drawn over the whole step);
    ``order``: its input's :class:`~autopar.rank_plan.SequenceOrder` when it carries the
    sequence in zig-zag order (the serial mask is then reordered alike before its box is cut)."""

    micro_dim: int | None
    order: Any = None


def sliced_dropout(site: OpSite) -> SlicedDropout | None:
    """The slicing a training dropout needs: its input split between ranks or micro-batches,
    or in zig-zag order (None: the local kernel draws the serial mask)."""
    if op_key(site.name) != "dropout" or site.attrs.get("is_test", False):
        return None
    required = site.inputs[0] if site.inputs else None
    micro_dim = site.micro_dims[0] if site.micro_dims else None
    order = site.orders[0] if site.orders else None
    if order is not None and order.unknown:
        raise AutoparError(
            f"{site.name} (training dropout) under ContextParallel(balance='zigzag'): where its input carries the "
            f"sequence is not known ({order.unknown}), so the serial mask cannot be reordered like it; use balance=None"
        )
    if (required is not None and required.sharded_mesh_dims()) or micro_dim is not None or order is not None:
        return SlicedDropout(micro_dim, order)
    return None


# declared by dropout's rule; emitted by autopar.passes.dropout_slicing (no collective)
DROPOUT_SLICES = Lowering("dropout_slicing", "dropout-sliced", order=2, match=sliced_dropout)


class DropoutRule(EinsumRule):
    """dropout's equation; a class only to refuse a training dropout without a fixed seed."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        if not attrs.get("is_test", False) and not attrs.get("fix_seed", False) and inputs[1] is None:
            raise AutoparError(
                f"{ctx.op_name or 'dropout'} draws its mask without a fixed seed, so ranks would drop different "
                "elements than the serial run: set main_program.random_seed (or pass a seed) before building it"
            )
        return super().infer_forward(inputs, attrs, ctx)


register_rule(DropoutRule(_dropout, tensors=1), "dropout", lowering=DROPOUT_SLICES)
register_rule(EquationGradRule(_dropout_grad_letters, grad=1, tensors=2, shape_only=()), "dropout_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("dropout", flops_per_element=2, keeps_split=True, sequence_local=True)
