"""einsum and einsum_grad (stage: propagate): the op's own equation is its rule.

    einsum       bij,bjk -> bik , (cache...) , (xshape...)   ``equation`` attr, 1 or 2 operands
    einsum_grad  bij,bjk,(cache...),bik -> bij,bjk            (x_shape..., inner_cache..., out_grad)

Every letter keeps the split its operands agree on; a split letter missing from the output (a
contraction, ``ij->j``) leaves the output a pending sum over its mesh dims. Paddle's Python
layer writes ``...`` as letters and unsqueezes the smaller operand, so a letter may be size 1
in one operand and larger in the other: a broadcast, written ``1`` there (never split). An
ellipsis still in the attribute is given fresh letters, broadcast the same way. A letter
repeated in one operand or in the output (a diagonal, ``ii->i``) is whole everywhere: two dims
of one tensor cannot be cut by one split. Operands are required complete: the kernel keeps
them for the grad op (below), which could not tell a kept pending sum.

Besides ``out`` the op makes, per operand, an ``inner_cache`` tensor (the operand after the
kernel's transpose, static shape ``[0]``) and an ``xshape`` value (the operand's shape, no
data). The grad op reads only these two and the output gradient: its ``x_shape`` operands
give the operands' *local* shapes and the caches their local data, laid out by the forward
op's placement. So the grad op requires ``x_shape`` and the caches exactly as they are (a
reshard of either would hand the kernel a cache that does not match its shape) and takes the
letters' splits from the ``x_shape`` operands alone; the output gradient is brought to them.
``xshape`` lies like its operand; the caches are declared whole (1-d, nothing reads them but
the grad op, which reads each rank's own).

A cache may alias its operand's buffer (no transpose needed). Paddle 3.3.1's in-place pass
does not know: an in-place op on the operand after the einsum (``h + update`` on the einsum's
input h becomes ``add_``) overwrites the cache, and even the serial program then computes
wrong gradients (``FLAGS_pir_apply_inplace_pass=0`` avoids it; recomputation, which remakes
the caches just before the grad op, does too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.spmd.base import (
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    einsum_backward,
    einsum_forward,
    einsum_grad,
)  # fmt: skip
from autopar.spmd.letters import ALPHABET, broadcast_letters, equation
from autopar.spmd.operands import replicated
from autopar.spmd.registry import declare, register


def parse(text: str, shapes: Sequence[Sequence[int]]) -> tuple[list[str], str] | None:
    """Per-operand letters and the output's, in the engine's notation (``1``: never split);
    None for an equation outside Paddle's grammar (lowercase letters, ``...``, ``->``)."""
    text = text.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(shapes) or any(c not in ALPHABET + "." for c in lhs.replace(",", "") + rhs):
        return None
    if not arrow:  # implicit output: the ellipsis, then the letters used once, sorted
        once = sorted(c for c in set(lhs) if c in ALPHABET and lhs.count(c) == 1)
        rhs = ("..." if "..." in lhs else "") + "".join(once)
    expanded = _expand_ellipsis(operands, rhs, shapes)
    if expanded is None:
        return None
    operands, rhs = expanded
    if any(len(names) != len(shape) for names, shape in zip(operands, shapes)):
        return None
    repeated = {c for names in [*operands, rhs] for c in names if c != "1" and names.count(c) > 1}
    sizes: dict[str, int] = {}
    for names, shape in zip(operands, shapes):
        for c, size in zip(names, shape):
            sizes[c] = max(sizes.get(c, 1), int(size))
    broadcast = [
        "".join("1" if c in repeated or (size == 1 and sizes[c] > 1) else c for c, size in zip(names, shape))
        for names, shape in zip(operands, shapes)
    ]  # fmt: skip
    return broadcast, "".join("1" if c in repeated else c for c in rhs)


def _expand_ellipsis(operands: list[str], rhs: str, shapes: Sequence[Sequence[int]]) -> tuple[list[str], str] | None:
    """``...`` replaced by fresh letters, right-aligned and broadcast across operands."""
    if not any("..." in names for names in operands) and "..." not in rhs:
        return operands, rhs
    spans = []
    for names, shape in zip(operands, shapes):
        named = len(names.replace("...", ""))
        spans.append(list(shape[: len(shape) - named]) if "..." in names else [])
    taken = "".join(operands) + rhs
    if len(set(taken) - {".", ","}) + max((len(s) for s in spans), default=0) > len(ALPHABET):
        return None
    per_operand, out = broadcast_letters(spans, taken=taken)
    operands = [names.replace("...", fresh) for names, fresh in zip(operands, per_operand)]
    return operands, rhs.replace("...", out)


def _letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], ctx: RuleContext) -> tuple[list[str], str]:
    text = str(attrs.get("equation", ""))
    found = None if any(s is None for s in inputs) else parse(text, [s.shape for s in inputs])
    if found is None:  # Paddle's Python layer never builds such an op; its kernel would refuse it
        shapes = [None if s is None else list(s.shape) for s in inputs]
        raise AutoparError(f"{ctx.op_name or 'einsum'}: cannot read the equation {text!r} for operands of shapes {shapes}")
    return found


def _extras(result: RuleResult, inputs: Sequence[TensorSpec], ctx: RuleContext) -> RuleResult:
    """``out`` plus each operand's cache (whole, 1-d) and xshape (like the operand)."""
    caches = tuple(DistAttr.replicated(ctx.mesh, 1) for _ in inputs)
    shapes = tuple(DistAttr.of(ctx.mesh, attr.mapping) for attr in result.inputs)
    return RuleResult(result.inputs, (result.outputs[0], *caches, *shapes), result.conflicts)


@register("einsum")
class EinsumOpRule(SpmdRule):
    """``(x...) -> (out, inner_cache..., xshape...)`` by the ``equation`` attribute. A class for
    the caches and xshapes beside the equation's one result."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        names, out = _letters(inputs, attrs, ctx)
        return _extras(einsum_forward(equation(names, [out]), inputs, ctx), inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        if not outputs or outputs[0] is None:
            return self.infer_forward(inputs, attrs, ctx)
        names, out = _letters(inputs, attrs, ctx)
        return _extras(einsum_backward(equation(names, [out]), inputs, outputs[:1], ctx), inputs, ctx)


@register("einsum_grad")
class EinsumGradRule(SpmdRule):
    """``(x_shape..., inner_cache..., out_grad) -> (x_grad...)`` (see the module docstring). Not
    data: splits come from the forward operands only, the caches are taken as they lie."""

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        count = (len(inputs) - 1) // 2
        shapes, caches, out_grad = list(inputs[:count]), inputs[count : 2 * count], inputs[-1]
        if count < 1 or len(inputs) != 2 * count + 1:
            raise AutoparError(f"{ctx.op_name or 'einsum_grad'}: expected (x_shape..., inner_cache..., out_grad), got {len(inputs)} operands")
        names, out = _letters(shapes, attrs, ctx)
        _check_agreement(names, shapes, ctx)
        # the splits come from the forward operands' placements only: the incoming gradient
        # keeps just its pending sum (linear), its splits are replaced by theirs
        bare = None if out_grad.dist is None else DistAttr.of(ctx.mesh, ((),) * out_grad.ndim, dict(out_grad.dist.partial))
        grad_spec = TensorSpec(out_grad.shape, bare, out_grad.dtype, out_grad.priority)
        result = einsum_grad(equation([*names, out], names), [*shapes, grad_spec], ctx, grad_operands=[count])
        kept = [s.dist if s.dist is not None else result.inputs[i] for i, s in enumerate(shapes)]
        as_they_are = [s.dist if s.dist is not None else replicated(ctx, s) for s in caches]
        return RuleResult((*kept, *as_they_are, result.inputs[count]), result.outputs, result.conflicts)


def _check_agreement(names: Sequence[str], shapes: Sequence[TensorSpec], ctx: RuleContext) -> None:
    """The forward op made every ``x_shape`` agree on each letter; if not, the caches cannot be
    trusted, and guessing would be silently wrong."""
    seen: dict[str, tuple[int, ...]] = {}
    for letters_, spec in zip(names, shapes):
        if spec.dist is None:
            continue
        for c, dims in zip(letters_, spec.dist.mapping):
            if c != "1" and seen.setdefault(c, dims) != dims:
                raise AutoparError(f"{ctx.op_name or 'einsum_grad'}: its x_shape operands disagree on dim '{c}' ({seen[c]} vs {dims})")
            if c == "1" and dims:
                raise AutoparError(f"{ctx.op_name or 'einsum_grad'}: an x_shape operand is split on a dim the equation keeps whole")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("einsum", matmul_like=True)
