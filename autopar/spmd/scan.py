"""cumsum and cumsum_grad: a scan keeps the split of the dim it scans (stage: propagate -> the
per-rank lowering `scan_carry`, emitted by `passes/scan_carry.py`).

    cumsum        abc -> abc      (x, axis -> out): every dim keeps its split, the scanned one too
    cumsum_grad   abc,abc -> abc  (x, out_grad, axis -> x_grad): the scan of out_grad the other way
    flatten       every dim whole (the flattened tensor's order crosses the dims' splits)

A scan along a split dim is its shards' local scans plus a carry: shard ``i``'s running sums
start after the totals of the shards before it (after it, for a ``reverse`` scan, and for
cumsum_grad, the forward's direction turned). So the rule keeps the split, and the lowering
adds, per rank, what the local kernel misses:

    local = cumsum(x_i)                          (the op itself, on the rank's piece)
    total = sum(x_i, axis, keepdim)              one row per shard
    carry = sum(all_gather(total)[shards before i], axis, keepdim)
    out   = local + carry

One all_gather of one row per shard (``parts`` rows of the other dims' local sizes) in place of
gathering the whole tensor, on the mesh dims splitting the scanned dim. Exact in real
arithmetic; in floating point the running sums are added in another order (exact for integers
and the 0/1 counts of a router's slots). Linear in x: a pending sum passes through (each rank
carries its own term's totals). A dim micro-batching splits is refused by name: one
micro-batch's scan cannot see the earlier micro-batches' totals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError
from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.lowering import Lowering, OpSite
from autopar.spmd.operands import axes_attr, letters
from autopar.spmd.registry import op_key, register_rule


def scan_axis(attrs: Mapping[str, Any], ndim: int) -> int | None:
    """The dim a cumsum (grad) scans; None when it scans the flattened tensor."""
    if attrs.get("flatten", False) or attrs.get("axis") in (None, []):
        return None
    return axes_attr(attrs, "axis", ndim)[0]


def _names(ndim: int, attrs: Mapping[str, Any]) -> str:
    return letters(ndim, whole=range(ndim)) if scan_axis(attrs, ndim) is None else letters(ndim)


def _cumsum(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``abc -> abc``: the placements propagation gives (the scanned dim's split kept)."""
    names = _names(inputs[0].ndim, attrs)
    return f"{names}->{names}"


def _along(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> str:
    """``a1c -> a1c``: what the op computes from its values' order (the scanned dim worked along)."""
    ndim = inputs[0].ndim
    axis = scan_axis(attrs, ndim)
    names = letters(ndim, whole=range(ndim) if axis is None else [axis])
    return f"{names}->{names}"


@dataclass
class ScanRule(EinsumRule):
    """cumsum's rule. ``equation`` is what an analysis of the values' order reads (the scanned
    dim worked along, ``1``: a sequence in zig-zag order does not pass it,
    :mod:`autopar.zigzag_values`); propagation keeps that dim's split (``kept``), which the
    lowering :data:`SCAN_CARRIES` makes exact."""

    kept: Callable[[Sequence[TensorSpec], Mapping[str, Any]], str] = _cumsum
    local_scale = SpmdRule.local_scale  # (a scan's local result is never rescaled)

    def infer_forward(self, inputs: Sequence[TensorSpec], attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        return EinsumRule.infer_forward(dataclasses.replace(self, equation=self.kept), inputs, attrs, ctx)

    def infer_backward(self, inputs: Any, outputs: Any, attrs: Mapping[str, Any], ctx: RuleContext) -> RuleResult:
        return EinsumRule.infer_backward(dataclasses.replace(self, equation=self.kept), inputs, outputs, attrs, ctx)


def _cumsum_grad_letters(inputs: Sequence[TensorSpec], attrs: Mapping[str, Any]) -> list[str]:
    names = _names(inputs[0].ndim, attrs)
    return [names, names]


@dataclass(frozen=True, slots=True)
class ScanCarry:
    """A scan whose dim ``axis`` is split over the mesh dims ``mesh_dims`` (its operand's
    placement: ``dist``): each rank adds the totals of the shards before it (``backward``: after
    it) to its local scan."""

    axis: int
    mesh_dims: tuple[int, ...]
    backward: bool
    dist: Any


def scan_carry(site: OpSite) -> ScanCarry | None:
    """The carry a cumsum (grad) needs: its scanned dim split between ranks (None: the local
    kernel is the scan). Refuses the dim split between micro-batches."""
    key = op_key(site.name)
    if key not in ("cumsum", "cumsum_grad"):
        return None
    slot = 1 if key == "cumsum_grad" else 0  # (the grad scans out_grad)
    required, shape = site.inputs[slot], site.shapes[slot]
    axis = scan_axis(site.attrs, len(shape)) if shape is not None else None
    if axis is None:
        return None
    micro = site.micro_dims[slot] if len(site.micro_dims) > slot else None
    if micro == axis:
        raise AutoparError(
            f"micro-batching: {site.name} scans dim {axis} of {list(shape)}, which micro-batching splits: one "
            "micro-batch's scan cannot see the totals of the micro-batches before it; scan per group of rows (a "
            "leading groups dim the micro-batches divide) or use one micro-batch"
        )
    if required is None or not required.mapping[axis]:
        return None
    backward = bool(site.attrs.get("reverse", False)) != (key == "cumsum_grad")
    return ScanCarry(axis, tuple(required.mapping[axis]), backward, required)


def _carry_group(carry: ScanCarry) -> tuple[int, ...]:
    return carry.mesh_dims


# declared by cumsum's rules; emitted by autopar.passes.scan_carry (one all_gather of one row per shard)
SCAN_CARRIES = Lowering("scan_carry", "scans-carried", order=3, match=scan_carry, group=_carry_group)

register_rule(ScanRule(_along, linearity="multi", tensors=1), "cumsum", lowering=SCAN_CARRIES)
register_rule(EquationGradRule(_cumsum_grad_letters, grad=1, tensors=2), "cumsum_grad", lowering=SCAN_CARRIES)
