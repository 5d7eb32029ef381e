"""Paddle's global static / dynamic mode, switched for a block (shared by runtime and testing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def dygraph() -> Iterator[None]:
    """Eager mode for the duration, whatever mode the caller was in.

    gloo's process-group collectives and the rule checker's eager kernels need dynamic mode;
    autopar's callers usually build static programs, so the mode is restored afterwards.
    """
    import paddle

    was_static = not paddle.in_dynamic_mode()
    if was_static:
        paddle.disable_static()
    try:
        yield
    finally:
        if was_static:
            paddle.enable_static()
