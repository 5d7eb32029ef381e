"""concat, split / split_with_num, slice and their grads (stage: propagate).

The axis an op concatenates, splits or slices along must be whole (its pieces' bounds would
not line up with a shard's); every other dim follows, merged over all operands:

    concat       a1c,a1c,... -> a1c          (axis 1; "1" = required whole)
    split        a1c -> a1c,a1c,...
    slice        a1c -> a1c  (decrease_axis drops the sliced dim: a1c -> ac)

All three only move data, so sum/avg partials pass through (concat: when every operand is
partial alike). Operands arrive flattened by the graph view: ``concat`` reads
``(x[0], ..., x[n-1], axis)`` (the tensors of its ``builtin.combine``), ``split`` produces
the tensors of its ``builtin.split``; ``axis``, ``sections``, ``starts``, ``ends`` are
int-array / scalar operands whose values are in ``attrs`` and are required replicated.
In PIR a split's backward is a ``concat`` (``split_grad`` reads ``(out_grad[0..n-1], axis)``
and gets the concat rule). Grad ops read the forward input for its shape, so it is required
split like the gradient it sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import axes_attr, axis_attr, letters
from autopar.spmd.registry import declare, register_rule


def _concat_equation(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x[0], ..., x[n-1], axis) -> out``: ``a1c,a1c->a1c``; the axis whole, the rest merged."""
    ndim = inputs[0].ndim
    names = letters(ndim, whole=[axis_attr(attrs, "axis", ndim)])
    return equation([names] * (len(inputs) - 1), [names])


register_rule(EinsumRule(_concat_equation, linearity="additive", tensors=-1), "concat", "split_grad")  # (split's grad concatenates)


def _concat_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x[0..n-1], out_grad, axis) -> x_grad[0..n-1]``: ``a1c,...,a1c,a1c -> a1c,...``."""
    ndim = inputs[0].ndim
    return [letters(ndim, whole=[axis_attr(attrs, "axis", ndim)])] * (len(inputs) - 1)


register_rule(EquationGradRule(_concat_grad_letters, grad=-1, tensors=-1, results=None, shape_only=()), "concat_grad")


def _split_count(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> int:
    if "num" in attrs:
        return int(attrs["num"])
    return len(attrs["sections"])


def _split_equation(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x, [sections], axis) -> out[0..n-1]``: ``a1c -> a1c,a1c,...``."""
    ndim = inputs[0].ndim
    names = letters(ndim, whole=[axis_attr(attrs, "axis", ndim)])
    return equation([names], [names] * _split_count(inputs, attrs))


register_rule(EinsumRule(_split_equation, linearity="multi", tensors=1), "split", "split_with_num")


def _unbind_equation(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``x -> out[0..n-1]`` along ``axis``: ``a1c -> ac,ac,...`` (the axis whole; the grad is
    ``stack``)."""
    ndim = inputs[0].ndim
    axis = axis_attr(attrs, "axis", ndim)
    names = letters(ndim, whole=[axis])
    return equation([names], [names[:axis] + names[axis + 1 :]] * inputs[0].shape[axis])


register_rule(EinsumRule(_unbind_equation, linearity="multi"), "unbind")


def _slice_letters(ndim: int, attrs: Mapping[str, Any]) -> tuple[str, str]:
    axes = axes_attr(attrs, "axes", ndim)
    names = letters(ndim, whole=axes)
    drop = set(axes_attr(attrs, "decrease_axis", ndim))
    return names, "".join(c for i, c in enumerate(names) if i not in drop)


def _slice_equation(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(input, starts, ends) -> out``: ``a1c -> a1c`` (sliced axes whole; decreased ones dropped)."""
    src, out = _slice_letters(inputs[0].ndim, attrs)
    return f"{src}->{out}"


register_rule(EinsumRule(_slice_equation, linearity="multi", tensors=1), "slice")


def _slice_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(input, out_grad, starts, ends) -> input_grad``: ``a1c,a1c -> a1c`` (input sizes the grad)."""
    return list(_slice_letters(inputs[0].ndim, attrs))


register_rule(EquationGradRule(_slice_grad_letters, grad=1, tensors=2, shape_only=()), "slice_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("concat", keeps_split=True, norm_plumbing=True)
declare("split", "split_with_num", "concat_grad", splits_pieces=True)
declare("concat", joins_pieces="concat")
declare("add_n", "add", joins_pieces="sum")
declare("slice", keeps_split=True, passes_ids=True, to_loss=True)
declare("split", "split_with_num", "unbind", keeps_split=True)
declare("split", "split_with_num", takes_apart=True)
