"""Which values a recompute clone makes again, as the recompute rewrite pairs them.

A clone op carries ``recomputes`` (the forward op it stands for). Most clones are the same op
again, paired output slot by output slot. A training dropout is cloned as ``x * cast(mask) /
(1 - p)`` (its mask kept, never redrawn): only that chain's last op re-makes the dropout's
output; its cast and product are values of their own. Passes placing a recomputed value like
its forward value, ``autopar.check`` comparing a clone with what it re-makes, and the zig-zag
order of a clone's results all read this one pairing (paired by slot, the dropout's cast mask
was taken for its output). It reads the graph only, so any layer may import it."""

from __future__ import annotations

from autopar.graph import OpNode, ProgramGraph, ValueKey


def is_training_dropout(op: OpNode) -> bool:
    return op.name == "pd_op.dropout" and not op.attrs.get("is_test", False)


def clone_outputs(graph: ProgramGraph) -> dict[ValueKey, list[ValueKey]]:
    """Each recomputed forward value -> the values its clones make again."""
    groups: dict[int, list[OpNode]] = {}
    for op in graph.ops:
        if op.recomputes is not None:
            groups.setdefault(op.recomputes, []).append(op)
    out: dict[ValueKey, list[ValueKey]] = {}
    for origin, clones in groups.items():
        original = graph.ops[origin]
        same = [c for c in clones if c.name == original.name]
        pairs = [(o, c) for clone in same for o, c in zip(original.outputs, clone.outputs)]
        if not same and is_training_dropout(original):  # x * cast(mask) / (1 - p): its last op
            pairs = [(original.outputs[0], clones[-1].outputs[0])]
        for o, c in pairs:
            if o is not None and c is not None:
                out.setdefault(o, []).append(c)
    return out


def remade(graph: ProgramGraph) -> dict[ValueKey, ValueKey]:
    """A clone's result -> the forward value it makes again (the inverse of :func:`clone_outputs`)."""
    return {clone: forward for forward, clones in clone_outputs(graph).items() for clone in clones}
