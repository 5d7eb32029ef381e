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
