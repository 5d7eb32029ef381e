"""The serial reference run: the truth every distributed run is compared with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SerialResult:
    fetches: list[list[np.ndarray]]
    parameters: dict[str, np.ndarray]


def run_serial(main: Any, startup: Any, feeds: Sequence[Mapping[str, Any]], fetch_list: Sequence[Any]) -> SerialResult:
    """Run ``startup`` then ``len(feeds)`` steps of ``main`` in a fresh scope."""
    import paddle

    scope = paddle.static.Scope()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        fetches = [[np.asarray(v) for v in exe.run(main, feed=dict(feed), fetch_list=list(fetch_list))] for feed in feeds]
    names = [op.attrs()["parameter_name"] for op in main.global_block().ops if op.name() == "builtin.parameter"]
    return SerialResult(fetches, {n: np.array(scope.find_var(n).get_tensor()) for n in names})


def random_feeds(feeds: Mapping[str, Any], steps: int, seed: int = 0, classes: int = 10) -> list[dict[str, np.ndarray]]:
    """``steps`` feed dicts of random data matching the program's feed values (ints < classes)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        step = {}
        for name, value in feeds.items():
            shape = list(value.shape)
            dtype = str(value.dtype).replace("paddle.", "")
            if dtype.startswith("int"):
                step[name] = rng.integers(0, classes, size=shape).astype(dtype)
            else:
                step[name] = rng.standard_normal(shape).astype(dtype)
        out.append(step)
    return out
