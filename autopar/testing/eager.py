"""Run Paddle ops eagerly on numpy arrays: the ground truth the rule checker compares with."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autopar.paddle_mode import dygraph


def _tensor(x: np.ndarray, grad: bool) -> Any:
    import paddle

    t = paddle.to_tensor(x)
    t.stop_gradient = not (grad and x.dtype.kind == "f")
    return t


def eager(forward: Callable[..., Any]) -> Callable[[Sequence[np.ndarray], Mapping[str, Any]], list[np.ndarray]]:
    """``forward(*tensors, **attrs)`` as a numpy -> list of numpy function."""

    def run(inputs: Sequence[np.ndarray], attrs: Mapping[str, Any]) -> list[np.ndarray]:
        with dygraph():
            out = forward(*[_tensor(x, False) for x in inputs], **attrs)
            outs = out if isinstance(out, (list, tuple)) else [out]
            return [o.numpy() for o in outs]

    return run


def eager_grad(
    forward: Callable[..., Any], wrt: Sequence[int], output: int = 0
) -> Callable[[Sequence[np.ndarray], Mapping[str, Any]], list[np.ndarray]]:
    """The grad op of ``forward``: inputs are forward inputs then ``out_grad``; outputs the
    gradients of the inputs at positions ``wrt`` (as Paddle's ``*_grad`` ops compute them)."""

    def run(inputs: Sequence[np.ndarray], attrs: Mapping[str, Any]) -> list[np.ndarray]:
        import paddle

        with dygraph():
            tensors = [_tensor(x, i in wrt) for i, x in enumerate(inputs[:-1])]
            out = forward(*tensors, **attrs)
            out = out[output] if isinstance(out, (list, tuple)) else out
            grads = paddle.grad([out], [tensors[i] for i in wrt], [paddle.to_tensor(inputs[-1])], allow_unused=True)
            return [np.zeros_like(inputs[i]) if g is None else g.numpy() for i, g in zip(wrt, grads)]

    return run
