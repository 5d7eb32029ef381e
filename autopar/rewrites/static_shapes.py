"""A shape read is a constant (stage: rewrite, first).

Models read shapes at run time (``B = paddle.shape(x)[0]; cls_token.expand((B, -1, -1))``, the
ViT reference's class token). autopar compiles static shapes only, so each such read is known:
the ``shape`` / ``shape64`` op becomes a ``full_int_array`` of the global shape. Without this,
the op had no rule: its input was gathered whole on every rank just to read its size (a
data-parallel ViT all_gathered its images every step), and the ops after it ran on the whole
batch. Each rank program then reads the global size, as the serial program does; the values
computed from it are placed by the ordinary rules.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paddle.pir import Program

from autopar.spmd import ops_where

SHAPE_OPS = ops_where("shape_read")  # (pd_op.shape, pd_op.shape64)


@dataclass(frozen=True)
class StaticShapes:
    """The rewritten program (op indices unchanged: each shape op's place holds its constant)."""

    program: Program
    replaced: tuple[str, ...]  # the shape ops, as ``pd_op.shape64#12``

    def __str__(self) -> str:
        return f"{len(self.replaced)} shape read(s) made constants ({', '.join(self.replaced[:4])}{', ...' if len(self.replaced) > 4 else ''})"


def static_shapes(program: Any) -> StaticShapes | None:
    """``program`` with every shape read of a static shape made a constant; None when there is
    none (the program is used as it is)."""
    import paddle

    ops = list(program.global_block().ops)
    found = [i for i, op in enumerate(ops) if op.name() in SHAPE_OPS and all(s >= 0 for s in op.operand_source(0).shape)]
    if not found:
        return None
    work = program.clone()
    raw = list(work.global_block().ops)
    with paddle.static.program_guard(work):
        for index in found:
            op = raw[index]
            result = op.result(0)
            paddle.pir.set_insertion_point(op)
            constant = paddle._pir_ops.full_int_array([int(s) for s in op.operand_source(0).shape], result.dtype, paddle.CPUPlace())
            result.replace_all_uses_with(constant)
            op.erase()
        paddle.pir.reset_insertion_point_to_end()
    sizes = {int(s) for i in found for s in ops[i].operand_source(0).shape}
    _resolve_unknown_dims(work, sorted(sizes))
    return StaticShapes(work, tuple(f"{ops[i].name()}#{i}" for i in found))


def _resolve_unknown_dims(program: Any, sizes: list[int]) -> None:
    """Give the values whose dims the shape reads left unknown (-1: an expand to ``(B, -1, -1)``
    with ``B`` read at run time) their static sizes. Paddle's symbolic shape inference knows
    them now that the reads are constants; its Python binding can only compare a shape, so
    each unknown dim is tried against the sizes the reads read (the only values it can have),
    and set when exactly one assignment matches."""
    import itertools

    import paddle
    from paddle.base import libpaddle

    values = [
        r for op in program.global_block().ops for r in op.results()
        if r.initialized() and r.is_dense_tensor_type() and any(d < 0 for d in r.shape)
    ]  # fmt: skip
    if not values:
        return
    manager = libpaddle.pir.PassManager()
    libpaddle.pir.infer_symbolic_shape_pass(manager, program)
    with _native_stderr_silenced():  # (it warns about every op without a symbolic rule: optimizers, ...)
        manager.run(program)
    analysis = libpaddle.pir.get_shape_constraint_ir_analysis(program)
    for value in values:
        shape = list(value.shape)
        unknown = [i for i, d in enumerate(shape) if d < 0]
        if len(unknown) > 3:
            continue
        symbolic = analysis.get_shape_or_data_for_var(value)
        matches = []
        with _native_stderr_silenced():  # (is_equal logs each mismatch as an error)
            for guess in itertools.product(sizes, repeat=len(unknown)):
                for i, size in zip(unknown, guess):
                    shape[i] = size
                try:
                    equal = symbolic.is_equal(list(shape))
                except ValueError:  # a data-dependent size (masked_select's count): no static size fits
                    break
                if equal:
                    matches.append(list(shape))
        if len(matches) == 1:
            value.set_type(paddle.pir.create_shaped_type(value.type(), matches[0]))


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Paddle's C++ log lines on file descriptor 2 dropped for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
