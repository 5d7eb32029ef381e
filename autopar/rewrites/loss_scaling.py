"""Dynamic loss scaling's in-place updates made visible as data flow (stage: rewrite, before
the stages).

``paddle.amp.GradScaler`` (dynamic loss scaling) appends ``check_finite_and_unscale_`` (divides
every gradient by the scale) and ``update_loss_scaling_`` (zeroes them on an overflow), both in
place, and the optimizer ops read the gradient values made *before* them: the program is right
only because the three share one buffer (docs/paddle_amp.md, Q1's end). A compiled program may
not share it: a collective a reader needs is a new value (ZeRO-2's reduce_scatter right after
the backward makes the gradient; an all_reduce the planner puts before the read), and the
in-place update then changes a buffer the reader no longer reads — the optimizer would step on
a gradient the scale never divided (measured before this rewrite: ZeRO-2 reduce-scattered the
scaled gradients and the check all-gathered copies of its own; with SGD the loss went from 1.91
to 34.8 in one step where serial's went to 1.56, and AdamW, nearly blind to a constant factor,
hid it; tests/equivalence/test_found_inf.py's zero2_sgd case).

So before analysis each reader placed after one of these ops reads the op's result instead of
its operand (the values are equal when the buffer is shared, so the serial program computes
the same): update_loss_scaling_ reads the unscaled gradients, the optimizer the checked ones,
and every reshard between them is placed on the value that exists at that point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.spmd import ops_where

if TYPE_CHECKING:
    from paddle.pir import Program

IN_PLACE_SCALING = ops_where("scales_in_place")  # check_finite_and_unscale_, update_loss_scaling_


@dataclass(frozen=True)
class ScalingResults:
    """The rewired program (same ops at the same positions) and how many reads moved."""

    program: Program
    rewired: int
    ops: tuple[str, ...]  # ``pd_op.update_loss_scaling_#64``

    def __str__(self) -> str:
        return f"{self.rewired} gradient read(s) moved onto the results of {', '.join(self.ops)} (in place)"


def _vector_members(op: Any) -> tuple[list[Any], list[Any]] | None:
    """The gradients ``op`` updates in place (its vector operand's members) and the values that
    stand for them after it (its vector result's members); None when either is not unpacked."""
    combine = op.operand_source(0).get_defining_op()
    splits = [user for user in op.result(0).all_used_ops() if user.name() == "builtin.split"]
    if combine is None or combine.name() != "builtin.combine" or len(splits) != 1:
        return None
    before = [combine.operand_source(i) for i in range(combine.num_operands())]
    after = [splits[0].result(i) for i in range(splits[0].num_results())]
    return (before, after) if len(before) == len(after) else None


def loss_scaling_results(program: Any) -> ScalingResults | None:
    """``program`` (a clone) with the reads after each in-place scaling op moved onto its
    results (module docstring); None when it has no such op."""
    if not any(op.name() in IN_PLACE_SCALING for op in program.global_block().ops):
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    position = {op.id(): index for index, op in enumerate(raw)}
    moved, names = 0, []
    for index, op in enumerate(raw):
        if op.name() not in IN_PLACE_SCALING:
            continue
        members = _vector_members(op)
        if members is None:
            continue
        names.append(f"{op.name()}#{index}")
        for old, new in zip(*members):
            if not new.initialized():
                continue
            for user in old.all_used_ops():
                if position[user.id()] <= index:
                    continue
                for slot in range(user.num_operands()):
                    if user.operand_source(slot).is_same(old):
                        user.operand(slot).set_source(new)
                        moved += 1
    return ScalingResults(work, moved, tuple(names))
