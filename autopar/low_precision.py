"""Low-precision values on the host: how the runtime holds them and sums them (stage: runtime;
a leaf the collective-kind table reads).

Paddle's scope hands a ``bfloat16`` tensor to numpy as its bit patterns (``np.array(tensor)``
is ``uint16``) and takes ``uint16`` arrays back as ``bfloat16`` tensors (``tensor.set``), so
the host runtime moves bfloat16 values as ``uint16`` bits: a gather, a broadcast or a send
moves them unchanged. A reduction must not add the bits: it widens each member to float32,
combines the members one by one in group order, each combination done in float32 and rounded
to the low precision (round to nearest even, as Paddle's cast; a NaN becomes ``0x7FFF`` as
there) — what a ring's per-hop low-precision reduction computes. Every backend (simulator,
shared memory, gloo) runs this same function, so their results are bit-identical.
``float16`` is numpy's own and follows the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.errors import AutoparError

# dtype name -> the numpy dtype the host holds it in
STORAGE: dict[str, np.dtype] = {"bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16)}

_COMBINE = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def is_low(dtype: str) -> bool:
    """Whether ``dtype`` (a name, ``"bfloat16"``) is one the runtime reduces by :func:`reduce`."""
    return str(dtype).removeprefix("paddle.") in STORAGE


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (held as ``dtype`` is held: bfloat16 bits as uint16) as float32, exactly."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def narrow(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` rounded to ``dtype`` (to nearest, ties to even), held as the runtime holds it."""
    x = np.asarray(x, dtype=np.float32)
    if dtype != "bfloat16":
        return x.astype(STORAGE[dtype])
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), rounded)


def reduce(arrays: Sequence[np.ndarray], reduce_op: str, dtype: str) -> np.ndarray:
    """The members ``arrays`` (in group order, held as ``dtype``) combined by ``reduce_op`` one by
    one, each combination in float32 rounded to ``dtype``; an average is that sum divided by
    the member count, rounded once more."""
    storage = STORAGE[dtype]
    wrong = sorted({str(a.dtype) for a in arrays if a.dtype != storage})
    if wrong:
        raise AutoparError(f"a {dtype} reduction holds its values as {storage} arrays; got {wrong}")
    combine = _COMBINE.get(reduce_op)
    if combine is None:
        raise AutoparError(f"no {dtype} reduction {reduce_op!r}; expected one of {sorted(_COMBINE)}")
    total = arrays[0]
    for member in arrays[1:]:
        total = narrow(combine(widen(total, dtype), widen(member, dtype)), dtype)
    if reduce_op == "avg":
        total = narrow(widen(total, dtype) / np.float32(len(arrays)), dtype)
    return np.array(total, dtype=storage)
