"""Shape ops: reshape, flatten, squeeze, unsqueeze, transpose and their grads (stage: propagate).

reshape / flatten / squeeze / unsqueeze are all *reshapes*: the input and output dims fall
into groups of equal element count (``[6, 12, 48, 24] -> [1, 72, 48, 4, 6]`` groups as
``(6,12)->(72)``, ``(48)->(48)``, ``(24)->(4,6)``, plus the lone size-1 dim). In row-major
order only a split of a group's *leading* dim maps to contiguous blocks of the other side,
so that split carries over to the other side's leading dim (as Paddle's reshape rule and
PyTorch's view rules do); every other dim of a group is required whole. With uneven splits
(``numpy.array_split`` bounds) blocks only line up when both leading dims are divisible by
the number of parts, or the group is one dim of the same size on both sides: otherwise the
split is dropped (the planner gathers).

    reshape  ab,c -> (ab)c        a split of a -> a split of (ab); a split of b -> whole
    transpose abc -> cab          a permutation: letters follow

Reshapes move data only, so any partial passes through. A grad (``x, out_grad -> x_grad``)
is the reshape back; its ``x`` operand gives the kernel the local output shape, so ``x`` is
required split like ``x_grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh
from autopar.spmd.base import (
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    merge_letters,
)  # fmt: skip
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.operands import letters, partial_outside, replicated
from autopar.spmd.registry import declare, register, register_rule

Mapping_ = tuple[tuple[int, ...], ...]
Group = tuple[tuple[int, ...], tuple[int, ...]]


# ---- shape arithmetic (also used by the partition pass for local target shapes) ----------


def resolve_shape(in_shape: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Paddle's target shape: ``0`` copies the input dim at that index, one ``-1`` is inferred."""
    out = [int(in_shape[i]) if int(t) == 0 else int(t) for i, t in enumerate(target)]
    if out.count(-1) > 1:
        raise ValueError(f"reshape target {list(target)} has more than one -1")
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        out[out.index(-1)] = math.prod(in_shape) // known if known else 0
    if math.prod(out) != math.prod(in_shape):
        raise ValueError(f"cannot reshape {list(in_shape)} to {list(target)}")
    return tuple(out)


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group]:
    """Minimal groups of ``src`` dims and ``dst`` dims with equal element counts.

    A size-1 dim without a size-1 partner is a group of its own with an empty other side.
    Tensors with no elements form one group of all dims (nothing is split then).
    """
    if math.prod(src) == 0:
        return [(tuple(range(len(src))), tuple(range(len(dst))))]
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        one_i = i < len(src) and src[i] == 1
        one_j = j < len(dst) and dst[j] == 1
        if one_i or one_j or i == len(src) or j == len(dst):
            groups.append(((i,) if one_i or j == len(dst) else (), (j,) if one_j or i == len(src) else ()))
            i, j = i + bool(groups[-1][0]), j + bool(groups[-1][1])
            continue
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def _carries(group: Group, src: Sequence[int], dst: Sequence[int], parts: int) -> bool:
    gi, gj = group
    if not gi or not gj:
        return False
    if len(gi) == 1 and len(gj) == 1:
        return src[gi[0]] == dst[gj[0]] and src[gi[0]] > 1
    return src[gi[0]] % parts == 0 and dst[gj[0]] % parts == 0


def carry_splits(
    src: Sequence[int], dst: Sequence[int], mapping: Mapping_, mesh: ProcessMesh
) -> tuple[Mapping_, Mapping_]:
    """(the ``src`` splits that survive, the ``dst`` splits they become) for a reshape."""
    kept: list[tuple[int, ...]] = [()] * len(src)
    out: list[tuple[int, ...]] = [()] * len(dst)
    for group in reshape_groups(src, dst):
        if not group[0]:
            continue
        dims = mapping[group[0][0]]
        if dims and _carries(group, src, dst, math.prod(mesh.shape[d] for d in dims)):
            kept[group[0][0]] = dims
            out[group[1][0]] = dims
    return tuple(kept), tuple(out)


def local_target_shape(in_shape: Sequence[int], out_shape: Sequence[int], local_in: Sequence[int]) -> tuple[int, ...]:
    """A rank's reshape target when its input piece is ``local_in`` (splits per :func:`carry_splits`)."""
    out = list(out_shape)
    for gi, gj in reshape_groups(in_shape, out_shape):
        if gi and gj and local_in[gi[0]] != in_shape[gi[0]]:
            out[gj[0]] = out_shape[gj[0]] * local_in[gi[0]] // in_shape[gi[0]]
    return tuple(out)


def flatten_shape(shape: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    if not shape:
        return (1,)
    start, stop = start % len(shape), stop % len(shape)
    return tuple(shape[:start]) + (math.prod(shape[start : stop + 1]),) + tuple(shape[stop + 1 :])


def squeeze_shape(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """Paddle's squeeze: listed size-1 dims go (all size-1 dims if none listed)."""
    if not shape:
        return ()
    drop = {a % len(shape) for a in axes} if axes else set(range(len(shape)))
    return tuple(s for i, s in enumerate(shape) if not (i in drop and s == 1))


def unsqueeze_shape(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """Paddle's unsqueeze: insert size-1 dims one axis at a time (negative: from the end)."""
    out = list(shape)
    for axis in axes:
        pos = axis + len(out) + 1 if axis < 0 else axis
        out.insert(min(pos, len(out)), 1)
    return tuple(out)


# ---- rules ---------------------------------------------------------------------------------


def reshape_forward(x: TensorSpec, out_shape: Sequence[int], ctx: RuleContext) -> tuple[DistAttr, DistAttr]:
    """(required x, out) for reshaping ``x`` to ``out_shape``; partials pass through."""
    if x.dist is None:
        return DistAttr.replicated(ctx.mesh, x.ndim), DistAttr.replicated(ctx.mesh, len(out_shape))
    kept, out = carry_splits(x.shape, out_shape, x.dist.mapping, ctx.mesh)
    used = {d for dims in kept for d in dims}
    partial = partial_outside(x.dist, used)
    return DistAttr.of(ctx.mesh, kept, partial), DistAttr.of(ctx.mesh, out, partial)


@dataclass
class ReshapeLikeRule(SpmdRule):
    """``x (+ int-array operands) -> out``, a reshape to ``target(inputs, attrs)``. Not an
    equation: splits are carried through groups of merged / split dims (:func:`carry_splits`)."""

    target: Callable[[Sequence[TensorSpec | None], Mapping[str, Any]], tuple[int, ...]]

    def infer_forward(self, inputs, attrs, ctx):
        x_attr, out_attr = reshape_forward(inputs[0], self.target(inputs, attrs), ctx)
        return RuleResult((x_attr,) + tuple(replicated(ctx, s) for s in inputs[1:]), (out_attr,))

    def infer_backward(self, inputs, outputs, attrs, ctx):
        """The output's leading-dim splits map back to the input; the output then follows."""
        out = outputs[0]
        if out.dist is None:
            return self.infer_forward(inputs, attrs, ctx)
        _, x_mapping = carry_splits(out.shape, inputs[0].shape, out.dist.mapping, ctx.mesh)
        x = TensorSpec(inputs[0].shape, DistAttr.of(ctx.mesh, x_mapping), inputs[0].dtype)
        return self.infer_forward([x, *inputs[1:]], attrs, ctx)


def _reshape_target(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``reshape(x, shape)``: the target is ``attrs["shape"]`` (values of the shape operand)."""
    if "shape" not in attrs:
        raise ValueError("reshape rule needs the target shape in attrs['shape']")
    return resolve_shape(inputs[0].shape, attrs["shape"])


def _flatten_target(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``flatten(x)`` over ``start_axis..stop_axis``: ``abcd -> a(bc)d``."""
    return flatten_shape(inputs[0].shape, int(attrs.get("start_axis", 0)), int(attrs.get("stop_axis", -1)))


def _squeeze_target(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``squeeze(x, axis)``: ``a1c -> ac`` (size-1 dims are never split)."""
    return squeeze_shape(inputs[0].shape, _raw_axes(attrs))


def _unsqueeze_target(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """``unsqueeze(x, axis)``: ``ac -> a1c``."""
    return unsqueeze_shape(inputs[0].shape, _raw_axes(attrs))


register_rule(ReshapeLikeRule(_reshape_target), "reshape")
declare("reshape", takes_apart=True)
declare("reshape", "reshape_", shape_attr=True)
register_rule(ReshapeLikeRule(_flatten_target), "flatten")
register_rule(ReshapeLikeRule(_squeeze_target), "squeeze")
register_rule(ReshapeLikeRule(_unsqueeze_target), "unsqueeze")


def _raw_axes(attrs: Mapping[str, Any]) -> list[int]:
    value = attrs.get("axis", [])
    return [int(a) for a in (value if isinstance(value, (list, tuple)) else [value])]


@register("reshape_grad", "flatten_grad", "squeeze_grad", "unsqueeze_grad")
class ReshapeGradRule(SpmdRule):
    """``(x, out_grad, [axis]) -> x_grad``: x_grad = reshape(out_grad, x.shape).

    x_grad's splits merge out_grad's (mapped back through the reshape) with x's own (first
    out_grad's); ``x`` (its shape only is read) is required split like x_grad, keeping any
    partial it has; out_grad's partials pass through to x_grad. Not an equation, as reshape.
    """

    def infer_forward(self, inputs, attrs, ctx):
        x, grad = inputs[0], inputs[1]
        mesh = ctx.mesh
        blocked = set(grad.dist.partial_dims) if grad.dist is not None else set()
        proposals = []
        if grad.dist is not None:
            proposals.append(
                TensorSpec(
                    x.shape,
                    DistAttr.of(mesh, carry_splits(grad.shape, x.shape, grad.dist.mapping, mesh)[1]),
                    priority=grad.priority,
                )
            )
        if x.dist is not None:
            own = carry_splits(x.shape, grad.shape, x.dist.mapping, mesh)[0]
            own = tuple(dims if not blocked & set(dims) else () for dims in own)
            proposals.append(TensorSpec(x.shape, DistAttr.of(mesh, own), priority=x.priority))
        names = letters(x.ndim)
        merged, conflicts = merge_letters([names] * len(proposals), proposals, ctx)
        x_mapping = tuple(merged.get(c, ()) for c in names)
        kept, g_mapping = carry_splits(x.shape, grad.shape, x_mapping, mesh)
        used = {d for dims in kept for d in dims}
        passthrough = partial_outside(grad.dist, used)
        required = [
            DistAttr.of(mesh, kept, partial_outside(x.dist, used | set(passthrough))),
            DistAttr.of(mesh, g_mapping, passthrough),
        ] + [replicated(ctx, s) for s in inputs[2:]]
        return RuleResult(tuple(required), (DistAttr.of(mesh, kept, passthrough),), tuple(conflicts))


def _perm(attrs: Mapping[str, Any], ndim: int) -> list[int]:
    return [int(p) % ndim for p in attrs.get("perm", list(range(ndim))[::-1])]


def _transpose(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``abc -> cab`` for ``perm = [2, 0, 1]``: splits follow their dim; partials pass through."""
    names = letters(inputs[0].ndim)
    return f"{names}->{''.join(names[p] for p in _perm(attrs, inputs[0].ndim))}"


def _transpose_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    """``out_grad -> x_grad``: the transpose by the inverse permutation (``cab -> abc``); x_grad's
    letters follow out_grad's (no operand has them)."""
    names = letters(inputs[0].ndim)
    return ["".join(names[p] for p in _perm(attrs, inputs[0].ndim)), names]


register_rule(EinsumRule(_transpose, linearity="multi", tensors=1), "transpose")
register_rule(EquationGradRule(_transpose_grad_letters, grad=0, tensors=1, results=(1,), shape_only=()), "transpose_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("flatten", "reshape", "squeeze", "unsqueeze", keeps_split=True, passes_ids=True, to_loss=True)
declare("transpose", keeps_split=True, to_loss=True)
declare("reshape", "flatten", "squeeze", "unsqueeze", zigzag_passes="reshape")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
