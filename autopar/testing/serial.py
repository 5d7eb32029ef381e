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
    """``steps`` feed dicts of random data matching the program's feed values (each with
    ``shape`` and ``dtype``): integers below ``classes``, booleans, floats standard normal."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        step = {}
        for name, value in feeds.items():
            shape = list(value.shape)
            dtype = str(value.dtype).replace("paddle.", "")
            if dtype.startswith(("int", "uint")):
                step[name] = rng.integers(0, classes, size=shape).astype(dtype)
            elif dtype == "bool":
                step[name] = rng.integers(0, 2, size=shape).astype(bool)
            else:
                step[name] = rng.standard_normal(shape).astype(dtype)
        out.append(step)
    return out


def assert_simulation_equals_serial(
    seed: Any, dist: Any, steps: int = 3, classes: int = 10, feeds: list[dict[str, Any]] | None = None,
    rtol: float = 1e-5, atol: float = 1e-6,
) -> None:  # fmt: skip
    """``steps`` random steps of ``dist`` in the simulator and of the seed's serial program from
    one generator state: losses every step (``rtol``) and parameters after the last (``rtol``,
    ``atol``) equal (``simulate`` also refuses replicated copies that differ). ``feeds``: one
    dict per step instead of random ones."""
    import paddle

    from autopar.runtime.simulator import simulate

    feeds = feeds if feeds is not None else random_feeds(seed.feeds, steps, classes=classes)
    start = paddle.get_rng_state()
    result = simulate(dist, feeds, [seed.loss])
    paddle.set_rng_state(start)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, err_msg=f"loss at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=rtol, atol=atol, err_msg=name)


def assert_within_floor(parameters: Mapping[str, Any], serial: Mapping[str, Any], floor: Mapping[str, float], atol: float = 1e-5) -> None:
    """Every parameter of ``serial`` within twice its ``floor`` of it in ``parameters`` (at least
    ``atol``): the floor is how far serial training itself moves it under rounding alone
    (:func:`autopar.testing.processes.reordered_floor`; AdamW normalises a gradient that is zero
    up to rounding into full-size steps, so a relative tolerance cannot hold there)."""
    assert parameters.keys() == serial.keys(), sorted(set(parameters) ^ set(serial))
    for name, want in serial.items():
        error, allowed = float(np.max(np.abs(np.asarray(parameters[name]) - want))), max(2 * floor[name], atol)
        assert error <= allowed, f"{name}: max |dist - serial| = {error:.3g} > twice its floor {floor[name]:.3g}"
