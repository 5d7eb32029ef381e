"""Differential tests of concat / split / split_with_num / slice against Paddle's rules.

Both make the concat / split / sliced axis whole and let the other dims follow. Where we
differ our answer must be numerically valid (check_rule). Known differences:
- merging competing splits of one dim across concat operands: Paddle picks by its own
  majority / first-operand order, we by priority, then the split over more ranks, then the
  earlier operand (recorded as a Conflict); both are valid;
- dims their number of parts does not divide (uneven): Paddle marks the output dim replicated (see
  test_paddle_diff_shape), we keep the split.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from paddle_oracle import Spec, differences, paddle_dists, paddle_infer
from test_rules_concat_split import concat_cases, concat_fn, slice_cases, slice_fn

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, meshes, shapes


def _ours(op, specs, attrs, mesh):
    return get_rule(op).infer_forward(
        [TensorSpec(tuple(s.shape), s.dist) for s in specs], attrs, RuleContext(mesh, op_name=op)
    )


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@given(meshes(), concat_cases(), st.data())
def test_concat_vs_paddle(mesh, case, data):
    parts, axis = case
    dists = [data.draw(paddle_dists(mesh, len(s))) for s in parts]
    specs = [Spec(s, d) for s, d in zip(parts, dists)]
    ours = _ours("concat", [*specs, Spec((1,), None)], {"axis": float(axis)}, mesh)
    ins, outs = paddle_infer("concat", specs, axis)
    if differences(ours, ins, outs, list(range(len(parts)))):
        xs = [_rand(s, i) for i, s in enumerate(parts)]
        check_rule("concat", concat_fn, [*xs, np.array([axis], "int32")], [*dists, None], {"axis": float(axis)}, mesh)


@given(meshes(), shapes(1, 3, max_side=8), st.data())
def test_split_vs_paddle(mesh, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    dist = data.draw(paddle_dists(mesh, len(shape)))
    size = shape[axis]
    num = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    ours = _ours("split_with_num", [Spec(shape, dist), Spec((1,), None)], {"num": num, "axis": float(axis)}, mesh)
    ins, outs = paddle_infer("split_with_num", Spec(shape, dist), num, axis)
    if differences(ours, ins, outs, [0]):
        fn = eager(lambda t, a, num, axis: __import__("paddle").split(t, num, axis=int(axis)))
        check_rule(
            "split_with_num",
            fn,
            [_rand(shape), np.array([axis], "int32")],
            [dist, None],
            {"num": num, "axis": float(axis)},
            mesh,
        )
    sections = [size // 2, size - size // 2] if size > 1 else [1]
    ours = _ours(
        "split",
        [Spec(shape, dist), Spec((len(sections),), None), Spec((1,), None)],
        {"sections": sections, "axis": float(axis)},
        mesh,
    )
    ins, outs = paddle_infer("split", Spec(shape, dist), sections, axis)
    assert not differences(ours, ins, outs, [0]) or any(
        dist.mapping[i] and s % mesh.shape[dist.mapping[i][0]] for i, s in enumerate(shape)
    )


@given(meshes(), slice_cases(), st.data())
def test_slice_vs_paddle(mesh, case, data):
    shape, attrs = case
    dist = data.draw(paddle_dists(mesh, len(shape)))
    operands = [Spec(shape, dist), Spec((len(attrs["axes"]),), None), Spec((len(attrs["axes"]),), None)]
    ours = _ours("slice", operands, attrs, mesh)
    ins, outs = paddle_infer(
        "slice",
        Spec(shape, dist),
        attrs["axes"],
        attrs["starts"],
        attrs["ends"],
        attrs["infer_flags"],
        attrs["decrease_axis"],
    )
    if differences(ours, ins, outs, [0]):
        starts, ends = np.array(attrs["starts"], "int64"), np.array(attrs["ends"], "int64")
        check_rule("slice", slice_fn, [_rand(shape), starts, ends], [dist, None, None], attrs, mesh)
