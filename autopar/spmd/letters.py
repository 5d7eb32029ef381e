"""Helpers that build einsum-style equations from operand shapes (broadcasting included)."""

from __future__ import annotations

from collections.abc import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def fresh_letters(count: int, taken: str = "") -> str:
    out = [c for c in ALPHABET if c not in taken]
    if count > len(out):
        raise ValueError(f"too many dims ({count}) for one equation")
    return "".join(out[:count])


def broadcast_letters(shapes: Sequence[Sequence[int]], taken: str = "") -> tuple[list[str], str]:
    """Right-aligned broadcasting: per operand letters and the output's letters.

    A dim of size 1 that broadcasts against a longer one is written ``1`` (never split).
    """
    rank = max((len(s) for s in shapes), default=0)
    letters = fresh_letters(rank, taken)
    sizes = [max((s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0), default=1) for i in range(rank)]
    operands = []
    for shape in shapes:
        offset = rank - len(shape)
        operands.append(
            "".join("1" if size == 1 and sizes[offset + i] != 1 else letters[offset + i] for i, size in enumerate(shape))
        )
    return operands, letters


def equation(inputs: Sequence[str], outputs: Sequence[str]) -> str:
    return ",".join(inputs) + "->" + ",".join(outputs)
