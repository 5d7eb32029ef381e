"""Small helpers shared by hand-written rules: constant operands, letters, partial filters.

Rules of ops with int-array / scalar operands (``reshape``'s shape, ``concat``'s axis, ...)
solve the tensor operands with the einsum engine and put the constants back replicated;
:func:`spread` does that. :func:`axis_attr` reads an axis that arrives either as an op
attribute or as the value of a ``pd_op.full`` operand (a float there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import RuleContext, RuleResult, TensorSpec

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def letters(ndim: int, whole: Sequence[int] = ()) -> str:
    """``abc...`` for ``ndim`` dims; dims in ``whole`` are written ``1`` (never split)."""
    return "".join("1" if i in whole else LETTERS[i] for i in range(ndim))


def replicated(ctx: RuleContext, spec: TensorSpec | None) -> DistAttr | None:
    return None if spec is None else DistAttr.replicated(ctx.mesh, spec.ndim)


def spread(
    result: RuleResult, tensors: Sequence[int], inputs: Sequence[TensorSpec | None], ctx: RuleContext
) -> RuleResult:
    """``result`` solved for ``inputs[tensors]`` only; every other operand replicated (or None)."""
    required = [replicated(ctx, s) for s in inputs]
    for pos, i in enumerate(tensors):
        required[i] = result.inputs[pos]
    return RuleResult(tuple(required), result.outputs, result.conflicts)


def axis_attr(attrs: Mapping[str, Any], name: str, ndim: int, default: int = 0) -> int:
    """An axis from ``attrs`` (int, float from ``pd_op.full``, or a one-element list), normalized."""
    value = attrs.get(name, default)
    if isinstance(value, (list, tuple)):
        value = value[0]
    axis = int(value)
    return axis % ndim if ndim else 0


def axes_attr(attrs: Mapping[str, Any], name: str, ndim: int) -> list[int]:
    """A list of axes from ``attrs`` (scalar or list), each normalized to ``[0, ndim)``."""
    value = attrs.get(name, [])
    items = value if isinstance(value, (list, tuple)) else [value]
    return [int(a) % ndim if ndim else 0 for a in items]


def axis_whole_letters(ndim: int, attrs: Mapping[str, Any], default: int = -1) -> str:
    """Letters of a tensor whose ``axis`` attr names a dim that must stay whole (softmax, topk)."""
    return letters(ndim, whole=[axis_attr(attrs, "axis", ndim, default=default)] if ndim else [])


def without_partial(dist: DistAttr | None) -> DistAttr | None:
    return None if dist is None or not dist.partial else DistAttr.of(dist.mesh, dist.mapping)


def partial_outside(dist: DistAttr | None, used: set[int], kinds: Sequence[str] | None = None) -> dict[int, str]:
    """``dist``'s partial mesh dims not in ``used`` (and of one of ``kinds`` if given)."""
    if dist is None:
        return {}
    return {d: k for d, k in dist.partial if d not in used and (kinds is None or k in kinds)}


def keep_pending(result: RuleResult, specs: Sequence[TensorSpec | None], positions: Sequence[int]) -> RuleResult:
    """Leave the partials of operands read for their shape only (add_grad's x, y; mean_grad's x).

    A pending sum changes no shape, so reducing it just for such an operand would be a wasted
    collective; only mesh dims the operand is not required split over are kept.
    """
    required = list(result.inputs)
    for i in positions:
        have = specs[i].dist if specs[i] is not None else None
        if have is None or not have.partial or required[i] is None:
            continue
        split = required[i].sharded_mesh_dims()
        required[i] = required[i].with_partial({d: k for d, k in have.partial if d not in split})
    return RuleResult(tuple(required), result.outputs, result.conflicts)
