"""SPMD rule types and the einsum-style engine most rules are written with (stage: propagate).

A rule answers, for one op: given what is known of its inputs' placements, which placement
each input must have (a reshard is planned where it differs) and which placement each output
gets. ``infer_forward`` goes inputs -> outputs; ``infer_backward`` goes known outputs -> inputs
(used when a user annotates an intermediate or an output).

Most ops are described by an equation over dim letters, e.g. matmul ``mk,kn->mn``: a letter's
split is merged from every input that has an opinion; letters missing from an output make the
output *partial* over their mesh dims (a pending sum, or max for max-reductions). The digit
``1`` marks a broadcast dim of size one, which is never split. Families are registered as
data (:mod:`autopar.spmd.equations`); hand-written rules exist only for irregular ops
(reshape, cross-entropy, ...).

Partial inputs: an op that is linear in its inputs may consume them partial and keep the
result partial (``linearity="multi"``: matmul, multiply — at most one partial operand per mesh
dim; ``"additive"``: add, subtract — all operands partial alike; ``"alike"``: add_n, stack —
same-shape operands where, if some are partial and the others whole, the whole ones are made
partial locally (free) and the result stays partial: one reduction after the op instead of
one per partial operand). Everything else requires its inputs complete, so the planner
inserts the reduction in front of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh
from autopar.spmd.lowering import Lowering

LINEAR_KINDS = ("sum", "avg")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a rule sees of one operand: global shape and, if known, its placement."""

    shape: tuple[int, ...]
    dist: DistAttr | None = None
    dtype: str = "float32"
    priority: int = 0  # higher wins when inputs disagree (user annotation > derived)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class Conflict:
    """Inputs of one op asked for incompatible splits of the same dim (or mesh dim)."""

    where: str  # the dim letter / tensor dim / mesh dim the candidates compete for
    candidates: tuple[tuple[str, str], ...]  # (which operand, its proposal)
    chosen: str
    reason: str

    def __str__(self) -> str:
        cands = ", ".join(f"{who}: {what}" for who, what in self.candidates)
        return f"{self.where}: {{{cands}}} -> {self.chosen} ({self.reason})"


@dataclass(frozen=True, slots=True)
class RuleResult:
    """Required input placements and produced output placements (None: absent operand)."""

    inputs: tuple[DistAttr | None, ...]
    outputs: tuple[DistAttr | None, ...]
    conflicts: tuple[Conflict, ...] = ()


Resolver = Callable[[str, list[tuple[int, tuple[int, ...]]]], int]


@dataclass(frozen=True)
class RuleContext:
    """Mesh the op runs on, plus an optional resolver (the cost model's) for competing splits.

    ``resolve(where, candidates)`` gets ``[(operand index, mesh dims), ...]`` and returns the
    position of the winner; without it the default order decides (see :func:`merge_letters`).
    """

    mesh: ProcessMesh
    resolve: Resolver | None = None
    op_name: str = ""
    # builds a resolver for one einsum op: (equation, operand specs, mesh) -> Resolver
    resolver_factory: Callable[[str, Sequence[TensorSpec | None], ProcessMesh], Resolver] | None = None
    # which results of the op someone reads (None: unknown); grad rules use it, see einsum_grad
    live_outputs: tuple[bool, ...] | None = None

    def for_equation(self, equation: str, specs: Sequence[TensorSpec | None]) -> RuleContext:
        """This context with a resolver made for ``equation`` (when a factory is set)."""
        if self.resolve is not None or self.resolver_factory is None:
            return self
        return dataclasses.replace(self, resolve=self.resolver_factory(equation, specs, self.mesh))


class SpmdRule:
    """Base class: a rule for one or more op names. Subclasses override the two inferences."""

    op_names: tuple[str, ...] = ()
    # the op makes whatever split of its outputs a reader fixes, from the inputs it reads
    # (``infer_backward`` says how): a fill, an expand of a broadcast dim. Propagation then
    # makes a fixed output directly instead of making it whole and slicing it
    free_outputs: bool = False
    # the per-rank rewrite its ops need where the local kernel is wrong on the placements this rule
    # keeps (autopar.spmd.lowering); None: Paddle's kernel is right on every rank's piece
    lowering: Lowering | None = None

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        raise NotImplementedError

    def infer_backward(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        attrs: Mapping[str, Any],
        ctx: RuleContext,
    ) -> RuleResult:
        """Default: no opinion from outputs; run forward on the known inputs."""
        return self.infer_forward(inputs, attrs, ctx)

    def local_scale(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], rank: int) -> float:
        """Factor a rank's local kernel result must be multiplied by (1.0 for most ops).

        ``mean`` over a split dim divides by the local count; to be a correct partial sum it
        must divide by the global count, i.e. be scaled by n_local / n_global.
        """
        return 1.0


# ---- the einsum engine -----------------------------------------------------------------


def _proposal(spec: TensorSpec, letters: str) -> dict[str, tuple[int, ...]]:
    if spec.dist is None:
        return {}
    return {letter: dims for letter, dims in zip(letters, spec.dist.mapping) if letter != "1" and dims}


def _default_winner(mesh: ProcessMesh, candidates: list[tuple[int, tuple[int, ...]]], specs: Sequence[TensorSpec]) -> int:
    """Highest operand priority, then the split over more ranks, then the earlier operand."""

    def key(item: tuple[int, tuple[int, ...]]) -> tuple[int, int, int]:
        operand, dims = item
        return (-specs[operand].priority, -math.prod(mesh.shape[d] for d in dims), operand)

    return min(range(len(candidates)), key=lambda i: key(candidates[i]))


def merge_letters(
    equation_inputs: Sequence[str], specs: Sequence[TensorSpec], ctx: RuleContext
) -> tuple[dict[str, tuple[int, ...]], list[Conflict]]:
    """Merge each dim letter's split over all operands; every disagreement is a Conflict."""
    merged: dict[str, tuple[int, ...]] = {}
    conflicts: list[Conflict] = []
    used: set[int] = set()
    proposals = [_proposal(spec, letters) for spec, letters in zip(specs, equation_inputs)]
    order = [c for letters in equation_inputs for c in letters if c != "1"]
    sizes = _letter_sizes(equation_inputs, specs)
    for letter in _by_priority(dict.fromkeys(order), proposals, specs):
        candidates = [(i, p[letter]) for i, p in enumerate(proposals) if letter in p]
        distinct = list(dict.fromkeys(dims for _, dims in candidates))
        # a split into more pieces than the dim has elements would leave ranks empty pieces
        # (a split over several mesh dims whose minor ones are taken keeps its free major ones:
        # the sequence over (sep, mp) read by a column-parallel matmul stays split over sep)
        free = [
            (i, dims) for i, dims in ((i, _free_prefix(dims, used)) for i, dims in candidates)
            if dims and math.prod(ctx.mesh.shape[d] for d in dims) <= sizes.get(letter, 0)
        ]  # fmt: skip
        options = list(dict.fromkeys(dims for _, dims in free))
        if not options:
            if candidates:
                conflicts.append(_conflict(letter, candidates, (), "mesh dims already split another dim, or too few elements", ctx))
            continue
        choices = [next((i, d) for i, d in free if d == dims) for dims in options]
        if len(options) == 1:
            pick = 0
            reason = "" if len(distinct) == 1 else "mesh dims already split another dim"
        elif ctx.resolve is not None:
            pick = ctx.resolve(letter, choices)
            log = getattr(ctx.resolve, "choices", None)  # the cost model's resolver explains itself
            reason = log[-1][1].reason if log else "lower cost"
        else:
            pick, reason = _default_winner(ctx.mesh, choices, specs), "priority, then more ranks, then operand order"
        merged[letter] = options[pick]
        used |= set(options[pick])
        if reason:
            conflicts.append(_conflict(letter, candidates, options[pick], reason, ctx))
    return merged, conflicts


def _free_prefix(dims: tuple[int, ...], used: set[int]) -> tuple[int, ...]:
    """The major mesh dims of ``dims`` up to the first one already ``used``."""
    for n, d in enumerate(dims):
        if d in used:
            return dims[:n]
    return dims


def _by_priority(letters: Iterable[str], proposals: list[dict[str, tuple[int, ...]]], specs: Sequence[TensorSpec]) -> list[str]:
    """Letters in order of the highest priority proposing a split of them, then operand order: a
    mesh dim two letters both want goes to the higher-priority placement (a user's column-parallel
    weight keeps its split where a strategy split the activation's sequence over the same dim)."""
    def top(letter: str) -> int:
        return max((specs[i].priority for i, p in enumerate(proposals) if letter in p), default=0)

    return sorted(letters, key=lambda letter: -top(letter))


def _letter_sizes(equation_inputs: Sequence[str], specs: Sequence[TensorSpec | None]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for spec, letters in zip(specs, equation_inputs):
        if spec is None:
            continue
        for letter, size in zip(letters, spec.shape):
            if letter != "1":
                sizes[letter] = min(sizes.get(letter, size), size)
    return sizes


def _conflict(letter: str, candidates: list[tuple[int, tuple[int, ...]]], chosen: tuple[int, ...], reason: str, ctx: RuleContext) -> Conflict:
    def text(dims: tuple[int, ...]) -> str:
        return "/".join(ctx.mesh.dim_names[d] for d in dims) or "not split"

    return Conflict(
        where=f"dim '{letter}'",
        candidates=tuple((f"operand {i}", text(dims)) for i, dims in candidates),
        chosen=text(chosen),
        reason=reason,
    )


def attr_from_letters(mesh: ProcessMesh, letters: str, merged: Mapping[str, tuple[int, ...]], partial: Any = None) -> DistAttr:
    return DistAttr.of(mesh, tuple(merged.get(c, ()) if c != "1" else () for c in letters), partial)


def _partial_passthrough(
    specs: Sequence[TensorSpec], used: set[int], linearity: str | None
) -> tuple[list[dict[int, str]], dict[int, str]]:
    """Which input partials an op may keep, and the output partial they produce."""
    kept: list[dict[int, str]] = [{} for _ in specs]
    out: dict[int, str] = {}
    if linearity is None:
        return kept, out
    known = [i for i, s in enumerate(specs) if s.dist is not None]
    mesh_dims = {d for i in known for d in specs[i].dist.partial_dims}
    for d in sorted(mesh_dims - used):
        kinds = {i: specs[i].dist.partial_dims.get(d) for i in known}
        holders = [i for i, k in kinds.items() if k is not None]
        kind_set = {kinds[i] for i in holders}
        if len(kind_set) != 1 or next(iter(kind_set)) not in LINEAR_KINDS:
            continue
        kind = next(iter(kind_set))
        if linearity == "multi" and len(holders) == 1:
            kept[holders[0]][d] = kind
            out[d] = kind
        elif linearity == "first" and holders == [0]:  # x / y: linear in x for a whole y
            kept[0][d] = kind
            out[d] = kind
        elif linearity == "additive" and len(holders) == len(specs):
            for i in holders:
                kept[i][d] = kind
            out[d] = kind
    return kept, out


def einsum_forward(
    equation: str,
    specs: Sequence[TensorSpec],
    ctx: RuleContext,
    *,
    linearity: str | None = None,
    reduce_kind: str = "sum",
) -> RuleResult:
    """Forward inference for an op described by ``"mk,kn->mn"``-style equation.

    Output letters keep their merged split; sharded letters absent from an output make it
    partial (``reduce_kind``) over their mesh dims.
    """
    lhs, rhs = equation.split("->")
    in_letters, out_letters = lhs.split(","), rhs.split(",")
    _check_arity(equation, in_letters, specs)
    ctx = ctx.for_equation(equation, specs)
    merged, conflicts = merge_letters(in_letters, specs, ctx)
    used = {d for dims in merged.values() for d in dims}
    kept, passthrough = _partial_passthrough(specs, used, linearity)
    inputs = tuple(attr_from_letters(ctx.mesh, letters, merged, kept[i]) for i, letters in enumerate(in_letters))
    outputs = []
    for letters in out_letters:
        reduced = {d: reduce_kind for c, dims in merged.items() if c not in letters for d in dims}
        outputs.append(attr_from_letters(ctx.mesh, letters, merged, {**passthrough, **reduced}))
    return RuleResult(inputs, tuple(outputs), tuple(conflicts))


def einsum_backward(
    equation: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    ctx: RuleContext,
) -> RuleResult:
    """Infer inputs from known outputs: letters take the outputs' split, contracted ones stay whole."""
    lhs, rhs = equation.split("->")
    in_letters, out_letters = lhs.split(","), rhs.split(",")
    _check_arity(equation, out_letters, outputs)
    merged, conflicts = merge_letters(out_letters, outputs, ctx)
    in_attrs = tuple(attr_from_letters(ctx.mesh, letters, merged) for letters in in_letters)
    out_attrs = tuple(attr_from_letters(ctx.mesh, letters, merged) for letters in out_letters)
    return RuleResult(in_attrs, out_attrs, tuple(conflicts))


def einsum_grad(
    equation: str,
    specs: Sequence[TensorSpec],
    ctx: RuleContext,
    grad_operands: Sequence[int],
) -> RuleResult:
    """Rule of the grad op of an einsum-described forward op.

    ``specs`` are the grad op's operands: the forward operands it reads, then the output
    gradient(s) (their positions are ``grad_operands``); each grad op output is written with
    the letters of the forward input it is the gradient of. An input gradient keeps its input's
    letters and is partial (sum) over the mesh dims of sharded letters the input lacks; a
    partial output gradient passes through (backprop is linear in the incoming gradient) when
    the op has at most one live gradient, else it is reduced once up front.
    """
    lhs, rhs = equation.split("->")
    operand_letters = lhs.split(",")
    out_letters = rhs.split(",")
    _check_arity(equation, operand_letters, specs)
    ctx = ctx.for_equation(equation, specs)
    merged, conflicts = merge_letters(operand_letters, specs, ctx)
    used = {d for dims in merged.values() for d in dims}
    grad_inputs = list(grad_operands)
    passthrough = _grad_partials(specs, grad_inputs, used)
    if passthrough and ctx.live_outputs is not None and sum(ctx.live_outputs) > 1:
        # a pending sum kept through an op with several live gradients needs one reduction
        # per gradient later; reducing the incoming gradient once is Megatron's "g" operator
        passthrough = {}
    required = []
    for i, letters in enumerate(operand_letters):
        keep = passthrough if i in grad_inputs else {}
        required.append(attr_from_letters(ctx.mesh, letters, merged, keep))
    outputs = []
    for letters in out_letters:
        reduced = {d: "sum" for c, dims in merged.items() if c not in letters for d in dims}
        outputs.append(attr_from_letters(ctx.mesh, letters, merged, {**passthrough, **reduced}))
    return RuleResult(tuple(required), tuple(outputs), tuple(conflicts))


def _grad_partials(specs: Sequence[TensorSpec], grad_inputs: Sequence[int], used: set[int]) -> dict[int, str]:
    """Partial mesh dims shared by every incoming gradient (and not split by any letter)."""
    common: dict[int, str] | None = None
    for i in grad_inputs:
        dist = specs[i].dist
        partial = dict(dist.partial_dims) if dist is not None else {}
        common = partial if common is None else {d: k for d, k in common.items() if partial.get(d) == k}
    return {d: k for d, k in (common or {}).items() if d not in used and k in LINEAR_KINDS}


def _check_arity(equation: str, letters: Sequence[str], specs: Sequence[TensorSpec]) -> None:
    if len(letters) != len(specs):
        raise ValueError(f"equation {equation!r} has {len(letters)} operands, got {len(specs)} specs")
    for spec, item in zip(specs, letters):
        if len(item) != spec.ndim:
            raise ValueError(f"equation {equation!r}: operand {item!r} vs shape {list(spec.shape)}")


def replicated_result(ctx: RuleContext, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec | int]) -> RuleResult:
    """Everything whole on every rank: the safe answer for an op without a rule."""
    out_ndims = [o if isinstance(o, int) else o.ndim for o in outputs]
    return RuleResult(
        tuple(DistAttr.replicated(ctx.mesh, s.ndim) for s in inputs),
        tuple(DistAttr.replicated(ctx.mesh, n) for n in out_ndims),
    )
