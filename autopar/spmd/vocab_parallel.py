"""Ops whose local kernel is wrong on a split row, and what each rank computes instead
(stage: propagate -> the per-rank lowering :data:`VOCAB_ROWS`, emitted by
:mod:`autopar.passes.vocab_parallel`).

The rules of :mod:`.embedding` and :mod:`.softmax` keep a split of a table's vocabulary dim or
of a normalized (class) axis; Paddle's kernels would compute on the local piece as if it were
the whole row. :func:`split_row` names such an op from the placements propagation gave it;
the decompositions below say what each rank computes instead (Megatron's vocabulary-parallel
embedding and cross-entropy), written once against a small set of kernels ``k``:

    embedding         out = lookup(ids - start | in range) * in_range          (no collective)
    embedding_grad    weight_grad = lookup_grad(ids - start | in range, out_grad * in_range)
    softmax           m = all_reduce_max(max_v x); s = all_reduce_sum(sum_v exp(x - m)); exp(x - m - log s)
    log_softmax       the same m, s; x - m - log s
    softmax_grad      out * (out_grad - all_reduce_sum(sum_v out * out_grad))
    log_softmax_grad  out_grad - exp(out) * all_reduce_sum(sum_v out_grad)
    cross_entropy     per rank r: m_r = max_v x, s_r = sum_v exp(x - m_r), t_r = sum_v x * [v == label],
                      all gathered in ONE all_gather of three values per row; m = max_r m_r,
                      s = sum_r s_r exp(m_r - m) (online softmax), t = sum_r t_r - m;
                      softmax = exp(x - m) / s, loss = (log s - t) * [label != ignore_index]
    cross_entropy_grad  (softmax - [v == label]) * loss_grad * [label != ignore_index]

``start`` / ``stop``: the rank's class (or table row) range; ``[v == label]`` compares the
global class index of each local column with the label. Every collective moves one to three
values per row (B·S values), never the row; the head's cross-entropy one all_gather where the
three all_reduces it needs one after another (max, then the sums) cost three launches. The pass runs them with Paddle ops and collectives
(``ProgramKernels``); the rule tests run them on numpy pieces of every rank at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.lowering import Lowering, OpSite
from autopar.spmd.operands import axis_attr
from autopar.spmd.registry import op_key


@dataclass(frozen=True, slots=True)
class SplitRow:
    """An op to rewrite: ``operand``'s dim ``axis`` (the class axis, or the table's vocabulary)
    is split over ``mesh_dims``."""

    op: str  # the decomposition: a key of DECOMPOSITIONS
    operand: int
    axis: int
    mesh_dims: tuple[int, ...]


def class_parallel(attrs: Mapping[str, Any]) -> bool:
    """Whether cross-entropy may keep a class split: a hard label, softmax applied."""
    return not attrs.get("soft_label", False) and attrs.get("use_softmax", True)


# op (without pd_op. and an inplace "_") -> (decomposition, operand holding the split row)
SPLIT_OPERAND = {
    "embedding": ("embedding", 1),
    "embedding_grad": ("embedding_grad", 1),
    "softmax": ("softmax", 0),
    "log_softmax": ("log_softmax", 0),
    "softmax_grad": ("softmax_grad", 0),
    "log_softmax_grad": ("log_softmax_grad", 0),
    "cross_entropy_with_softmax": ("cross_entropy", 0),
    "cross_entropy_with_softmax_grad": ("cross_entropy_grad", 1),
}


def split_row(op_name: str, attrs: Mapping[str, Any], inputs: Sequence[DistAttr | None]) -> SplitRow | None:
    """The rewrite ``op_name`` needs when its operands lie as ``inputs`` (the placements its
    rule required), or None when its local kernel is exact (no split row, or over one rank)."""
    key = op_key(op_name)
    key = key[:-1] if key.endswith("_") and key[:-1] in SPLIT_OPERAND else key
    if key not in SPLIT_OPERAND:
        return None
    if key.startswith("cross_entropy") and not class_parallel(attrs):
        return None
    name, operand = SPLIT_OPERAND[key]
    dist = inputs[operand] if operand < len(inputs) else None
    if dist is None:
        return None
    axis = 0 if key.startswith("embedding") else axis_attr(attrs, "axis", dist.ndim, default=-1)
    dims = dist.mapping[axis]
    if math.prod(dist.mesh.shape[d] for d in dims) <= 1:
        return None
    return SplitRow(name, operand, axis, tuple(dims))


def _match(site: OpSite) -> SplitRow | None:
    return split_row(site.name, site.attrs, site.inputs)


def _group(split: SplitRow) -> tuple[int, ...]:
    return split.mesh_dims


# declared by the rules of embedding, softmax and cross-entropy (and their grads); emitted by
# autopar.passes.vocab_parallel
VOCAB_ROWS = Lowering("vocab_parallel", "rows-rewritten", order=0, match=_match, group=_group)


# ---- the decompositions --------------------------------------------------------------------
# ``k`` provides: row_max, row_sum (over the split axis, kept as size 1), all_reduce(x, reduce,
# what), all_gather_rows(xs, what) (one collective: each row tensor's values of the group's
# ranks along the split axis, in group order), finite_or_zero(x) (0 where not finite), exp,
# log, subtract, multiply, divide, hits(label) ([global class == label], float, shaped like
# the row), picked(x, label) (the row sum of x where the class is the label: no product, a
# masked -inf logit times 0 is NaN), kept(label, ignore_index) (float, one per row), rows(ids) (ids - start
# where in range else 0, and the in-range mask as float with a trailing 1), lookup(ids, weight,
# padding_idx) and lookup_grad(ids, weight, out_grad, padding_idx) (Paddle's kernels, the global
# padding_idx made local).


def _row_max_and_sum(k: Any, x: Any) -> tuple[Any, Any]:
    m = k.all_reduce(k.row_max(x), "max", "row max")
    z = k.subtract(x, m)
    s = k.all_reduce(k.row_sum(k.exp(z)), "sum", "sum of exponentials")
    return z, s


def softmax(k: Any, x: Any) -> tuple[Any]:
    z, s = _row_max_and_sum(k, x)
    return (k.exp(k.subtract(z, k.log(s))),)


def log_softmax(k: Any, x: Any) -> tuple[Any]:
    z, s = _row_max_and_sum(k, x)
    return (k.subtract(z, k.log(s)),)


def softmax_grad(k: Any, out: Any, out_grad: Any) -> tuple[Any]:
    dot = k.all_reduce(k.row_sum(k.multiply(out, out_grad)), "sum", "row sum of out * out_grad")
    return (k.multiply(out, k.subtract(out_grad, dot)),)


def log_softmax_grad(k: Any, out: Any, out_grad: Any) -> tuple[Any]:
    total = k.all_reduce(k.row_sum(out_grad), "sum", "row sum of out_grad")
    return (k.subtract(out_grad, k.multiply(k.exp(out), total)),)


def cross_entropy(k: Any, logits: Any, label: Any, attrs: Mapping[str, Any]) -> tuple[Any, Any]:
    # one collective: every rank's row max, its sum of exponentials below that max and its
    # target logit, gathered; the row's sum of exponentials below the global max m is then
    # sum_r s_r exp(m_r - m) (online softmax). A rank's row of -inf shifts by 0, not -inf
    local_max = k.row_max(logits)
    sums = k.row_sum(k.exp(k.subtract(logits, k.finite_or_zero(local_max))))
    maxes, sums, targets = k.all_gather_rows(
        [local_max, sums, k.picked(logits, label)], "row max, sum of exponentials and target logit"
    )
    m = k.row_max(maxes)
    s = k.row_sum(k.multiply(sums, k.exp(k.subtract(k.finite_or_zero(maxes), m))))
    z = k.subtract(logits, m)
    e = k.exp(z)
    target = k.subtract(k.row_sum(targets), m)  # (rows whose label is ignored: no rank's hit; their loss is 0)
    loss = k.multiply(k.subtract(k.log(s), target), k.kept(label, attrs.get("ignore_index", -100)))
    return k.divide(e, s), loss


def cross_entropy_grad(k: Any, label: Any, softmax_: Any, loss_grad: Any, attrs: Mapping[str, Any]) -> tuple[Any]:
    weight = k.multiply(loss_grad, k.kept(label, attrs.get("ignore_index", -100)))
    return (k.multiply(k.subtract(softmax_, k.hits(label)), weight),)


def embedding(k: Any, ids: Any, weight: Any, attrs: Mapping[str, Any]) -> tuple[Any]:
    local, hit = k.rows(ids)
    return (k.multiply(k.lookup(local, weight, attrs.get("padding_idx", -1)), hit),)


def embedding_grad(k: Any, ids: Any, weight: Any, out_grad: Any, attrs: Mapping[str, Any]) -> tuple[Any]:
    local, hit = k.rows(ids)
    return (k.lookup_grad(local, weight, k.multiply(out_grad, hit), attrs.get("padding_idx", -1)),)


# name -> (decomposition, whether it takes the op's attrs); operands are the op's, in order
DECOMPOSITIONS: dict[str, tuple[Callable[..., tuple[Any, ...]], bool]] = {
    "embedding": (embedding, True),
    "embedding_grad": (embedding_grad, True),
    "softmax": (softmax, False),
    "log_softmax": (log_softmax, False),
    "softmax_grad": (softmax_grad, False),
    "log_softmax_grad": (log_softmax_grad, False),
    "cross_entropy": (cross_entropy, True),
    "cross_entropy_grad": (cross_entropy_grad, True),
}


def decompose(split: SplitRow, k: Any, operands: Sequence[Any], attrs: Mapping[str, Any]) -> tuple[Any, ...]:
    """Run ``split``'s decomposition with kernels ``k`` on the op's operands."""
    fn, takes_attrs = DECOMPOSITIONS[split.op]
    return fn(k, *operands, attrs) if takes_attrs else fn(k, *operands)


def local_padding(padding_idx: int, start: int, stop: int) -> int:
    """A table's padding row in a rank's rows [start, stop): its local index, or -1 (none here)."""
    return padding_idx - start if padding_idx >= 0 and start <= padding_idx < stop else -1
