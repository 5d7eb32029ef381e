"""Which ops of a program the rules' lowerings rewrite, and how (stage: propagated).

The walk every per-op lowering shares (:mod:`autopar.spmd.lowering`): each op whose rule
declares a lowering is shown to its ``match`` as an :class:`~autopar.spmd.lowering.OpSite`;
the decisions come back grouped by lowering in their declared order. The pass
(:mod:`autopar.passes.op_lowering`) and the pricing read the same list.
"""

from __future__ import annotations

from typing import Any

from autopar.graph import OpNode
from autopar.passes.base import CompileState
from autopar.spmd import get_rule
from autopar.spmd.lowering import Lowering, OpSite
from autopar.spmd.registry import lowerings
from autopar.zigzag_values import sequence_orders


def op_site(state: CompileState, op: OpNode) -> OpSite | None:
    """What a lowering sees of ``op`` (None: propagation gave it no placements)."""
    result = state.propagation.op_results.get(op.index)
    if result is None:
        return None
    micro = state.micro
    orders = sequence_orders(state.graph, state.zigzag)  # (zig-zag: the operands' order)
    return OpSite(
        op.name,
        op.attrs,
        tuple(result.inputs),
        tuple(state.graph.values[k].shape if k is not None else None for k in op.inputs),
        tuple(
            micro.split_dim(k) if micro is not None and k is not None and k in micro.placements else None
            for k in op.inputs
        ),
        tuple(orders.get(k) for k in op.inputs),
    )


def lowered_ops(state: CompileState, only: Lowering | None = None) -> list[tuple[Lowering, OpNode, Any]]:
    """Every (lowering, op, decision) of the program: lowerings in their declared order, then
    ops in program order (``only``: one lowering's)."""
    by_lowering: dict[str, list[tuple[Lowering, OpNode, Any]]] = {}
    for op in state.graph.ops:
        rule = get_rule(op.name)
        lowering = rule.lowering if rule is not None else None
        if lowering is None or (only is not None and lowering != only):
            continue
        site = op_site(state, op)
        decision = lowering.match(site) if site is not None else None
        if decision is not None:
            by_lowering.setdefault(lowering.name, []).append((lowering, op, decision))
    return [found for lowering in lowerings() for found in by_lowering.get(lowering.name, ())]
