"""Index-driven reads and writes: take_along_axis, put_along_axis, gather_nd, scatter,
masked_select, and their grads (stage: propagate). Each is one equation; shown for 3-d
tensors, ``axis=1``:

    take_along_axis  a1c,abc -> abc        (arr, indices): out lies like indices; the axis of
                                           arr is whole, the axis of indices may be split (each
                                           rank looks up its own rows); a non-axis dim is
                                           shared when arr and indices have the same size
                                           there, else whole in both (the kernel addresses arr
                                           by the index's local position)
    put_along_axis   a1c,a1c,a1c -> a1c    (arr, indices, values): the axis whole everywhere
                                           (every rank must see every write to its rows), a
                                           non-axis dim shared only when all three agree on
                                           its size; any ``reduce`` mode then stays row-local
    gather_nd        11c,ab1 -> abc        (x, index [..., k]): the k indexed dims of x whole,
                                           the index's batch dims split freely, the rest of x
                                           carried to the output
    scatter          1b,1,1b -> 1b         (x, index, updates): the written dim whole
                                           everywhere (an overwrite is not a sum of pieces)
    masked_select    11,11 -> 1            (x, mask): whole; see below

take_along_axis, gather_nd and masked_select are linear in their data (a pending sum passes).
The grads take the same letters: take_along_axis_grad and gather_nd_grad add the incoming
gradient into zeros of arr's shape, so letters of the index that arr lacks leave the result
a pending sum; put_along_axis_grad and scatter_grad give both gradients (arr's and values' /
x's and updates'). Only the incoming gradient's pending sum passes; an operand is left partial
only where Paddle reads it for its shape only (gather_nd_grad's and masked_select_grad's x,
scatter_grad's updates).

masked_select's output is 1-d with a data-dependent length: rank r's rows select a number of
elements only the mask knows. A placement splits a dim into fixed pieces (``shard_bounds``),
so a batch-split masked_select would claim pieces its ranks do not hold, and a concatenation
in rank order is no placement the planner can express. So x, the mask and the output are
whole, as without a rule, but the reason is stated here instead of left to a warning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.spmd.base import TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import equation
from autopar.spmd.operands import LETTERS, axis_attr
from autopar.spmd.registry import register_rule


def _along_axis(arr: Sequence[int], index: Sequence[int], axis: int, *, axis_split: bool) -> tuple[str, str]:
    """arr's and indices' letters: a dim shared where the sizes agree (never the axis of arr);
    the axis of indices gets its own letter when ``axis_split``."""
    arr_names, index_names = [], []
    for d, (a, i) in enumerate(zip(arr, index)):
        letter = LETTERS[d]
        if d == axis:
            arr_names.append("1")
            index_names.append(letter if axis_split else "1")
        elif a == i:
            arr_names.append(letter)
            index_names.append(letter)
        else:
            arr_names.append("1")
            index_names.append("1")
    return "".join(arr_names), "".join(index_names)


def _take(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    arr, index = _along_axis(inputs[0].shape, inputs[1].shape, axis_attr(attrs, "axis", inputs[0].ndim), axis_split=True)
    return equation([arr, index], [index])


def _take_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(arr, indices, out_grad) -> arr_grad``."""
    arr, index = _along_axis(inputs[0].shape, inputs[1].shape, axis_attr(attrs, "axis", inputs[0].ndim), axis_split=True)
    return [arr, index, index]


def _put_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """put_along_axis's letters for (arr, indices, values): a dim split only when all three
    agree on its size (operands of another rank: all whole)."""
    shapes = [s.shape for s in inputs[:3]]
    if len({len(s) for s in shapes}) != 1:
        return ["1" * len(s) for s in shapes]
    axis = axis_attr(attrs, "axis", len(shapes[0]))
    names = "".join(LETTERS[d] if d != axis and len({s[d] for s in shapes}) == 1 else "1" for d in range(len(shapes[0])))
    return [names] * 3


def _put(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    names = _put_letters(inputs, attrs)
    return equation(names, names[:1])


def _put_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(arr, indices, values, out, out_grad) -> (arr_grad, values_grad)``: out and out_grad
    lie like arr."""
    names = _put_letters(inputs, attrs)
    return [*names, names[0], names[0]]


def _gather_nd_letters(x_shape: Sequence[int], index_shape: Sequence[int]) -> tuple[str, str, str]:
    """x, index and out letters: ``11c,ab1 -> abc`` for x [N0, N1, C], index [A, B, 2]."""
    k = int(index_shape[-1]) if index_shape else 0
    batch = LETTERS[: len(index_shape) - 1]
    rest = LETTERS[len(batch) : len(batch) + len(x_shape) - k]
    return "1" * k + rest, batch + "1", batch + rest


def _gather_nd(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    x, index, out = _gather_nd_letters(inputs[0].shape, inputs[1].shape)
    return equation([x, index], [out])


def _gather_nd_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, index, out_grad) -> x_grad``."""
    return list(_gather_nd_letters(inputs[0].shape, inputs[1].shape))


def _rows_whole(ndim: int) -> str:
    """``1bc``: the written (first) dim whole, the others split alike."""
    return "1" + LETTERS[1:ndim]


def _scatter(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``(x, index, updates) -> out``."""
    names = _rows_whole(inputs[0].ndim)
    return equation([names, "1" * inputs[1].ndim, _rows_whole(inputs[2].ndim)], [names])


def _scatter_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(index, updates, out_grad) -> (x_grad, updates_grad)``: x_grad lies like out_grad."""
    return ["1" * inputs[0].ndim, _rows_whole(inputs[1].ndim), _rows_whole(inputs[2].ndim)]


def _whole(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """masked_select: ``11,11 -> 1`` (see the module docstring)."""
    return equation(["1" * s.ndim for s in inputs[:2]], ["1"])


def _whole_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``(x, mask, out_grad) -> x_grad``, all whole."""
    return ["1" * s.ndim for s in inputs[:3]]


register_rule(EinsumRule(_take, linearity="multi"), "take_along_axis")
register_rule(EquationGradRule(_take_grad_letters, grad=2, tensors=3, shape_only=()), "take_along_axis_grad")
register_rule(EinsumRule(_put), "put_along_axis")
register_rule(EquationGradRule(_put_grad_letters, grad=4, tensors=5, results=(0, 2), shape_only=()), "put_along_axis_grad")
register_rule(EinsumRule(_gather_nd, linearity="multi"), "gather_nd")
register_rule(EquationGradRule(_gather_nd_grad_letters, grad=2, tensors=3, shape_only=(0,)), "gather_nd_grad")
register_rule(EinsumRule(_scatter), "scatter")
register_rule(EquationGradRule(_scatter_grad_letters, grad=2, tensors=3, results=(2, 1), shape_only=(1,)), "scatter_grad")
register_rule(EinsumRule(_whole, linearity="multi"), "masked_select")
register_rule(EquationGradRule(_whole_grad_letters, grad=2, tensors=3, shape_only=(0,)), "masked_select_grad")
