"""One text form for byte counts and durations (reports, plans, diffs, benchmarks)."""

from __future__ import annotations


def format_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g}ms"
    if seconds >= 1e-6 or seconds == 0:
        return f"{seconds * 1e6:.3g}us"
    return f"{seconds * 1e9:.3g}ns"


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str, what: str = "--memory") -> int:
    """``80GB``, ``80 GiB``, ``512MiB``, ``1e9`` -> bytes (GB: 10^9, GiB: 2^30); the inverse of
    :func:`format_bytes` (``"1.5 GiB"``). ``what`` names the argument in the error."""
    import re

    from autopar.errors import AutoparError

    match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if match is None:
        raise AutoparError(f"{what} {text!r}: expected a size such as 80GB, 80GiB or 512MiB")
    number, prefix, binary = match.groups()
    power = " KMGT".index(prefix.upper() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)
