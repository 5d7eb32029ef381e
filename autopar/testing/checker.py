"""Numerical check of an SPMD rule against the op on full tensors (the rule's ground truth).

Shard random full inputs by the placements the rule *requires* (partial inputs are split into
random pieces that reduce back to the full value), run the op on each rank's pieces, rebuild
each output from the placement the rule *infers* (partials reduced), and compare every rank's
piece with the same slice of the op applied to the full inputs. A rule that claims a tensor
is replicated while ranks hold different values fails here too.

``check_rule("matmul", fn, inputs, dists, attrs, mesh)`` is the one call a user needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.dist_attr import DistAttr
from autopar.mesh import ProcessMesh
from autopar.pieces import reduce_partials, scatter
from autopar.spmd import RuleContext, RuleResult, TensorSpec, get_rule

OpFn = Callable[[Sequence[np.ndarray], Mapping[str, Any]], Sequence[np.ndarray]]


class RuleCheckError(AssertionError):
    """A rule's inferred placements do not reproduce the full computation."""


@dataclass
class RuleCheck:
    """What a check saw: the rule's answer and the worst absolute error over outputs."""

    result: RuleResult
    max_error: float


def check_rule(
    op_name: str,
    fn: OpFn,
    inputs: Sequence[np.ndarray],
    dists: Sequence[DistAttr | None],
    attrs: Mapping[str, Any] | None = None,
    mesh: ProcessMesh | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-4,
    seed: int = 0,
    backward: Sequence[DistAttr | None] | None = None,
) -> RuleCheck:
    """Check the rule registered for ``op_name`` on these inputs; raise RuleCheckError if wrong.

    ``inputs`` mirror the op's operands (int-array operands such as ``axis`` as int64 arrays,
    absent optional operands as None); ``dists`` are the given input placements (None: no
    opinion). With ``backward`` (output
    placements), the rule's ``infer_backward`` is checked instead of ``infer_forward``.
    """
    attrs = dict(attrs or {})
    mesh = mesh or next(d.mesh for d in dists if d is not None)
    rule = get_rule(op_name)
    if rule is None:
        raise RuleCheckError(f"no SPMD rule registered for {op_name!r}")
    rng = np.random.default_rng(seed)
    specs = [None if x is None else TensorSpec(tuple(x.shape), d, str(x.dtype)) for x, d in zip(inputs, dists)]
    ctx = RuleContext(mesh, op_name=op_name)
    expected = [np.asarray(o) for o in fn(list(inputs), attrs)]
    if backward is None:
        result = rule.infer_forward(specs, attrs, ctx)
    else:
        out_specs = [TensorSpec(tuple(e.shape), d, str(e.dtype)) for e, d in zip(expected, backward)]
        result = rule.infer_backward(specs, out_specs, attrs, ctx)
    _check_arity(op_name, result, inputs, expected)
    local_inputs = [{r: None for r in mesh.ranks} if x is None else scatter(x, d, rng) for x, d in zip(inputs, result.inputs)]
    local_specs = specs
    local_outputs: list[dict[int, np.ndarray]] = [dict() for _ in expected]
    for rank in mesh.ranks:
        outs = fn([pieces[rank] for pieces in local_inputs], attrs)
        required = [None if s is None else TensorSpec(s.shape, d, s.dtype) for s, d in zip(local_specs, result.inputs)]
        scale = rule.local_scale(required, attrs, rank)
        for j, out in enumerate(outs):
            out = np.asarray(out)
            local_outputs[j][rank] = out * scale if scale != 1.0 else out
    worst = 0.0
    for j, (want, dist) in enumerate(zip(expected, result.outputs)):
        if dist is None:
            continue
        worst = max(worst, _compare(op_name, j, want, dist, local_outputs[j], rtol, atol, result))
    return RuleCheck(result, worst)


def _check_arity(op_name: str, result: RuleResult, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
    if len(result.inputs) != len(inputs) or len(result.outputs) != len(outputs):
        raise RuleCheckError(
            f"{op_name}: rule gave {len(result.inputs)} inputs / {len(result.outputs)} outputs, "
            f"the op has {len(inputs)} / {len(outputs)}"
        )
    for i, (x, d) in enumerate(zip(inputs, result.inputs)):
        if x is not None and d is None:
            raise RuleCheckError(f"{op_name}: rule gave no placement for input {i}")
        if x is not None and d.ndim != x.ndim:
            raise RuleCheckError(f"{op_name}: input {i} placement {d} has {d.ndim} dims, tensor has {x.ndim}")


def _compare(op_name, j, want, dist, pieces, rtol, atol, result) -> float:
    if dist.ndim != want.ndim:
        raise RuleCheckError(f"{op_name}: output {j} placement {dist} has {dist.ndim} dims, output has {want.ndim}")
    reduced = reduce_partials(pieces, dist)
    worst = 0.0
    for rank, got in reduced.items():
        piece = want[dist.local_slices(want.shape, rank)]
        if got.shape != piece.shape:
            raise RuleCheckError(f"{op_name}: output {j} on rank {rank} has shape {got.shape}, expected {piece.shape} for {dist}")
        if piece.size == 0:
            continue
        if want.dtype.kind in "fc":
            err = float(np.max(np.abs(got.astype(np.float64) - piece)))
            if not np.allclose(got, piece, rtol=rtol, atol=atol):
                raise RuleCheckError(
                    f"{op_name}: output {j} on rank {rank} differs by {err:.3g} from the full op "
                    f"(inputs {[str(d) for d in result.inputs]} -> output {dist})"
                )
            worst = max(worst, err)
        elif not np.array_equal(got, piece):
            raise RuleCheckError(f"{op_name}: output {j} on rank {rank} differs from the full op (output {dist})")
    return worst
