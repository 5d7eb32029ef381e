"""Rules as data: an op family described by an equation is one registration (stage: propagate).

:class:`EinsumRule` states a forward op by a function of (operand specs, attrs) that writes its
``"mk,kn->mn"``-style equation, plus how partial operands pass (``linearity``), which reduction
a contracted split leaves (``reduce_kind``) and, for the few kernels whose local result needs a
correction, a ``scale``. :class:`EquationGradRule` states the grad op of such an op by each
tensor operand's letters, which of them are incoming gradients and whose letters each gradient
takes. The engine (:mod:`autopar.spmd.base`) does both directions; no family needs a class of
its own unless it holds logic an equation cannot state (each such class says why).

Both skip absent operands (a ``None`` spec: ``layer_norm`` without scale, ``swiglu`` without
``y``): they are left out of the equation and stay ``None``; the gradient of an absent operand
is absent too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.spmd.base import (
    LINEAR_KINDS,
    RuleContext,
    RuleResult,
    SpmdRule,
    TensorSpec,
    einsum_backward,
    einsum_forward,
    einsum_grad,
)
from autopar.spmd.letters import equation as join_equation
from autopar.spmd.operands import keep_pending, spread

Specs = Sequence[TensorSpec | None]
Attrs = Mapping[str, Any]
# a value fixed for the family, or one read from the operands and attrs (pool2d's ``pooling_type``)
Choice = str | None | Callable[[Specs, Attrs], "str | None"]
# ``n_local / n_global`` style factor of a rank's local result (see SpmdRule.local_scale)
Scale = Callable[[Specs, Attrs, int], float]


def _choose(value: Choice, inputs: Specs, attrs: Attrs) -> str | None:
    return value(inputs, attrs) if callable(value) else value


def _count(tensors: int, inputs: Sequence[Any]) -> int:
    """How many leading operands are tensors: 0 all, ``k > 0`` the first k, ``k < 0`` all but
    the last ``-k`` (the others, an axis, a shape, scalars, are required whole)."""
    return len(inputs) if tensors == 0 else tensors if tensors > 0 else len(inputs) + tensors


@dataclass
class EinsumRule(SpmdRule):
    """A rule fully described by an equation built from the present tensor operands' specs and
    the attrs (a family is one registration, not a class). ``tensors``: which operands the
    equation describes (see :func:`_count`); absent ones are left out of the equation.
    ``linearity`` and ``reduce_kind`` may be read from the operands and attrs; ``scale`` is the
    local result's correction (mean over a split dim)."""

    equation: Callable[[Specs, Attrs], str]
    linearity: Choice = None
    reduce_kind: Choice = "sum"
    op_names: tuple[str, ...] = field(default=())
    tensors: int = 0
    alike_from: int = 1  # "alike": how many operands must be pending for the whole ones to follow
    scale: Scale | None = None

    def _present(self, inputs: Specs) -> list[int]:
        return [i for i in range(_count(self.tensors, inputs)) if inputs[i] is not None]

    def infer_forward(self, inputs: Specs, attrs: Attrs, ctx: RuleContext) -> RuleResult:
        present = self._present(inputs)
        specs = [inputs[i] for i in present]
        linearity = _choose(self.linearity, inputs, attrs)
        kind = _choose(self.reduce_kind, inputs, attrs) or "sum"
        additive = "additive" if linearity == "alike" else linearity
        result = einsum_forward(self.equation(inputs, attrs), specs, ctx, linearity=additive, reduce_kind=kind)
        if linearity == "alike":
            result = pending_alike(result, specs, range(len(specs)), self.alike_from)
        return spread(result, present, inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        """Outputs past the equation's (none in practice) say nothing."""
        present = self._present(inputs)
        eq = self.equation(inputs, attrs)
        described = outputs[: len(eq.split("->")[1].split(","))]
        return spread(einsum_backward(eq, [inputs[i] for i in present], described, ctx), present, inputs, ctx)

    def local_scale(self, inputs: Specs, attrs: Attrs, rank: int) -> float:
        return 1.0 if self.scale is None else self.scale(inputs, attrs, rank)


@dataclass
class EquationGradRule(SpmdRule):
    """The grad op of an equation-described op: ``letters(inputs, attrs)`` gives each tensor
    operand's letters (None: left out, required whole), the incoming gradient(s) at ``grad``
    (negative: counted from the last tensor operand). Gradient ``j`` takes the letters at
    ``results[j]`` (None: of every operand before the first incoming gradient); entries of
    ``letters`` past the tensor operands name a gradient's letters that no operand has
    (transpose_grad). Only the incoming gradients' pending sums pass through; operands read
    for their shape only (``shape_only``; None: all but the incoming gradients) keep theirs
    (no reduction for a shape), the others are made complete."""

    letters: Callable[[Specs, Attrs], Sequence[str | None]]
    grad: int | tuple[int, ...]
    tensors: int = 0
    results: tuple[int, ...] | None = (0,)
    shape_only: tuple[int, ...] | None = None
    scale: Scale | None = None

    def infer_forward(self, inputs: Specs, attrs: Attrs, ctx: RuleContext) -> RuleResult:
        n = _count(self.tensors, inputs)
        names = self.letters(inputs, attrs)
        grads = [g % n for g in ((self.grad,) if isinstance(self.grad, int) else self.grad)]
        results = self.results if self.results is not None else tuple(range(min(grads)))
        present = [i for i in range(n) if inputs[i] is not None and names[i] is not None]
        made = [j for j in results if j >= n or j in present]
        eq = join_equation([names[i] for i in present], [names[j] for j in made])
        specs = [inputs[i] for i in present]
        result = einsum_grad(eq, specs, ctx, grad_operands=[present.index(g) for g in grads if g in present])
        shape_only = self.shape_only if self.shape_only is not None else [i for i in range(n) if i not in grads]
        result = keep_pending(result, specs, [present.index(i) for i in shape_only if i in present])
        produced = iter(result.outputs)
        outputs = tuple(next(produced) if j in made else None for j in results)
        return RuleResult(spread(result, present, inputs, ctx).inputs, outputs, result.conflicts)

    def local_scale(self, inputs: Specs, attrs: Attrs, rank: int) -> float:
        return 1.0 if self.scale is None else self.scale(inputs, attrs, rank)


def pending_alike(result: RuleResult, specs: Specs, positions: Sequence[int], at_least: int = 1) -> RuleResult:
    """An additive op's operands at ``positions``: where at least ``at_least`` are pending sums
    (or averages) over a mesh dim no letter splits and the others are whole there, require all
    of them pending alike (the whole ones made partial locally) and leave the output pending."""
    required, outputs = list(result.inputs), list(result.outputs)
    known = [i for i in positions if specs[i] is not None and specs[i].dist is not None and required[i] is not None]
    if not known:
        return result
    split = {d for i in known for d in required[i].sharded_mesh_dims()}
    kinds: dict[int, set[str]] = {}
    holders: dict[int, int] = {}
    for i in known:
        for d, kind in specs[i].dist.partial:
            kinds.setdefault(d, set()).add(kind)
            holders[d] = holders.get(d, 0) + 1
    add = {
        d: next(iter(k)) for d, k in kinds.items()
        if d not in split and len(k) == 1 and next(iter(k)) in LINEAR_KINDS and holders[d] >= at_least
    }  # fmt: skip
    if not add:
        return result
    for i in positions:  # every operand, also those with no placement yet: all pending alike
        if required[i] is not None:
            required[i] = required[i].with_partial({**required[i].partial_dims, **add})
    outputs = [None if o is None else o.with_partial({**o.partial_dims, **add}) for o in outputs]
    return RuleResult(tuple(required), tuple(outputs), result.conflicts)
