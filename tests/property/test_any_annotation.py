"""Any valid annotation on any value is right or refused (issue: annotations on
intermediates, Partial feeds, unseeded start-up were silently wrong).

Hypothesis builds small programs the way a user writes them (forward only or trained with
SGD; linear layers, activations, softmax, residual adds, reductions; seeded or not), draws
random placements — Shard (uneven included), Replicate, Partial(sum/avg/max/min) — for
random feeds, parameters and intermediates on meshes of 1..8 ranks, and requires: compile
refuses the annotation by name (an AnnotationError / PlacementError: empty pieces, a Partial
parameter, reductions that do not commute), or simulate runs and equals serial (fetches every
step, parameters after the last). Anything else — a wrong number, another exception, a
runtime error — fails.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import AnnotationError, PlacementError
from autopar.testing import meshes
from autopar.testing.serial import run_serial
from autopar.testing.strategies import dist_attrs

EXAMPLES = {"ci": 60, "deep": 2000}.get(os.environ.get("HYPOTHESIS_PROFILE", "ci"), 60)
OPS = ("linear", "relu", "tanh", "softmax", "residual", "scale")


def build(batch: int, features: int, recipe: list[tuple[str, int]], loss: str, train: bool, seeded: bool):
    """A program from a recipe; returns main, startup, feeds, loss, annotatable values by label."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 11 if seeded else 0
    values = {}
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, features], "float32")
        values["x"] = x
        h = x
        for i, (op, width) in enumerate(recipe):
            if op == "linear":
                layer = paddle.nn.Linear(h.shape[-1], width)
                values[f"w{i}"], values[f"b{i}"] = layer.weight, layer.bias
                h = layer(h)
            elif op == "relu":
                h = paddle.nn.functional.relu(h)
            elif op == "tanh":
                h = paddle.tanh(h)
            elif op == "softmax":
                h = paddle.nn.functional.softmax(h, axis=-1)
            elif op == "residual":
                h = h + paddle.tanh(h)
            else:
                h = h * 0.5
            values[f"h{i}"] = h
        out = paddle.sum(h) if loss == "sum" else paddle.mean(h)
        if train and any(op == "linear" for op, _ in recipe):
            paddle.optimizer.SGD(0.05).minimize(out)
    return main, startup, x, out, values


@st.composite
def cases(draw):
    mesh = draw(meshes(max_ranks=8, max_ndim=2, names=("a", "b")))
    batch, features = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    recipe = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(1, 6)), min_size=1, max_size=4))
    shape = dict(loss=draw(st.sampled_from(["sum", "mean"])), train=draw(st.booleans()), seeded=draw(st.booleans()))
    main, startup, x, out, values = build(batch, features, recipe, **shape)
    labels = draw(st.lists(st.sampled_from(sorted(values)), unique=True, max_size=3))
    annotations = []
    for label in labels:
        ndim = len(values[label].shape)
        partial = draw(st.booleans())
        attr = draw(dist_attrs(mesh, ndim, partial=partial, kinds=("sum", "avg", "max", "min")))
        annotations.append((label, attr))
    return mesh, (batch, features), recipe, shape, (main, startup, x, out, values), annotations


def _feeds(shape: tuple[int, int], steps: int = 2) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"x": rng.standard_normal(shape).astype("float32")} for _ in range(steps)]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_any_valid_annotation_is_right_or_refused(case):
    mesh, shape, recipe, options, (main, startup, x, out, values), annotations = case
    try:
        for label, attr in annotations:
            autopar.shard_tensor(values[label], mesh, attr)
        dist = autopar.compile(main, mesh, startup_program=startup)
    except (AnnotationError, PlacementError) as err:  # an annotation the program cannot honour, named
        event(f"refused: {type(err).__name__}: {str(err)[:60]}")
        return
    event("ran")
    feeds = _feeds(shape)
    start = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [out])  # compiled: it must run
    paddle.set_rng_state(start)
    serial = run_serial(main, startup, feeds, [out])
    where = f"{recipe} {options} on {mesh}: {[(lbl, str(a)) for lbl, a in annotations]}"
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-5, err_msg=f"step {step}: {where}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=2e-4, atol=2e-5, err_msg=f"{name}: {where}")
