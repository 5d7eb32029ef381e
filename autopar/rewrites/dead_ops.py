"""Dead ops removed before analysis (stage: rewrite, first).

A forward op whose results nothing reads computes a value no loss, gradient or update depends
on: a router statistic a layer computes and never uses (``paddle.mean(paddle.max(probs, 0))``),
the unused key of a sequence-parallel branch resharded with ``autopar.reshard``. Left in, it
still costs: micro-batching refuses an op that needs the whole batch even if its result goes
nowhere, and the planner places collectives for values no one reads. So the analysis works on a
clone without them (the user's program is untouched), and ``autopar explain`` / ``dist.passes``
name what was removed.

A value the user fetches may be one nothing reads (a metric: ``paddle.static.accuracy``):
``autopar.keep(value)`` keeps it and the ops making it; fetching a removed value is refused by
name, saying so (:func:`autopar.errors.removed_error`).

Live, whatever reads them: every op of a program without backward (its results are what the
user fetches), every backward and optimizer op, a forward op a grad op differentiates (the
loss: its gradient seed may read nothing of it), sources (parameters, feeds), in-place ops,
ops with persistable results, no results or sub-blocks (side effects: print, shadow_output,
collectives, control flow), and random ops (removing one would shift the random stream every
later random op draws from). An op is live when one of these, or an op inside a sub-block,
reads one of its results; a PIR block lists producers before readers, so one pass from the
end reaches the fixed point (removing a dead op has already made its inputs' producers dead).
An annotation on a removed value goes with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.graph import ProgramGraph, Role
from autopar.op_kinds import CONSTANT_OPS, SOURCE_OPS
from autopar.rewrites.recompute import RANDOM_OPS
from autopar.spmd import ops_where

if TYPE_CHECKING:
    from paddle.pir import Program

SIDE_EFFECT_OPS = ops_where("side_effect", short=True)  # never dead: they act beyond their results
SHOWN = 6  # removed ops named in the one-line report


@dataclass(frozen=True)
class Pruned:
    """The program without its dead ops."""

    program: Program
    positions: tuple[int | None, ...]  # old op index -> new index (None: removed)
    removed: tuple[str, ...]  # the removed ops, as ``pd_op.mean#18``
    values: Mapping[str, str]  # id of each removed result -> its label with its op (for refusing its fetch)

    def __str__(self) -> str:
        named = [op for op in self.removed if op.split("#")[0] not in CONSTANT_OPS]  # (their constants go with them)
        shown = (
            ", ".join(named[:SHOWN]) + (f", +{len(named) - SHOWN} more" if len(named) > SHOWN else "")
            or "none but constants"
        )
        constants = len(self.removed) - len(named)
        return (
            f"dead ops removed before analysis (nothing reads their results): {shown}"
            f"{f' and {constants} constant(s)' if constants else ''}; autopar.keep(value) keeps a value you fetch"
        )


def live_ops(program: Any, graph: ProgramGraph, keep: frozenset[str] = frozenset()) -> list[bool]:
    """Whether each op of ``program`` is live (module docstring); ``keep``: ids of values the
    user keeps."""
    ops = list(program.global_block().ops)
    if all(op.role is Role.FORWARD for op in graph.ops):
        return [True] * len(ops)
    differentiated = {op.forward_op for op in graph.ops if op.forward_op is not None}
    outer = {op.id() for op in ops}  # a reader not among them is inside a sub-block: live
    live = [False] * len(ops)
    live_ids: set[int] = set()  # op ids of live ops
    for index in reversed(range(len(ops))):
        op = ops[index]
        results = [r for r in op.results() if r.initialized()]
        live[index] = (
            graph.ops[index].role is not Role.FORWARD or index in differentiated or _has_effects(op, results)
            or any(r.id in keep for r in results)
            or any(user.id() in live_ids or user.id() not in outer for r in results for user in r.all_used_ops())
        )  # fmt: skip
        if live[index]:
            live_ids.add(op.id())
    return live


def _has_effects(op: Any, results: list[Any]) -> bool:
    name = op.name()
    short = name.split(".", 1)[-1]
    return (
        name in SOURCE_OPS or short.endswith("_") or not results or op.num_regions() > 0
        or short in SIDE_EFFECT_OPS or short.startswith("c_") or short in RANDOM_OPS or short == "dropout"
        or any(r.persistable for r in results)
    )  # fmt: skip


def dead_ops(program: Any, graph: ProgramGraph, keep: frozenset[str] = frozenset()) -> Pruned | None:
    """``program`` without its dead ops (a clone); None when every op is live (``program`` is
    used as it is)."""
    live = live_ops(program, graph, keep)
    if all(live):
        return None
    ops = list(program.global_block().ops)
    values = {
        r.id: f"{graph.values[(i, j)].label} (made by {graph.ops[i]})"
        for i, op in enumerate(ops) if not live[i]
        for j, r in enumerate(op.results()) if r.initialized() and (i, j) in graph.values
    }  # fmt: skip
    work = program.clone()
    raw = list(work.global_block().ops)
    for index in reversed(range(len(raw))):
        if not live[index]:
            raw[index].erase()
    positions, count = [], 0
    for alive in live:
        positions.append(count if alive else None)
        count += alive
    removed = tuple(str(graph.ops[i]) for i, alive in enumerate(live) if not alive)
    return Pruned(work, tuple(positions), removed, values)
