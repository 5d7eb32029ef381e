"""Differential tests of the mask / table rules against Paddle's own (triu, where, tile,
unbind, logical and bitwise ops), forward inference on clean cases (even splits, one mesh dim
per tensor dim): the required inputs and the outputs must agree. Hazardous cases are checked
numerically by ``test_rules_masking.py``."""

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st
from paddle_oracle import Spec, nontrivial_differences, paddle_dists, paddle_infer

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import meshes, shapes


def _ours(op, specs, attrs, mesh):
    return get_rule(op).infer_forward([None if s is None else TensorSpec(tuple(s.shape), s.dist) for s in specs], attrs, RuleContext(mesh, op_name=op))


def _even(shape, dist):
    return all(
        not dims or (size % int(np.prod([dist.mesh.shape[d] for d in dims])) == 0 and size > 1)
        for size, dims in zip(shape, dist.mapping)
    )


@given(meshes(), shapes(2, 4, max_side=6), st.integers(-1, 1), st.data())
def test_triu_vs_paddle(mesh, shape, diagonal, data):
    dist = data.draw(paddle_dists(mesh, len(shape)))
    assume(_even(shape, dist))
    ours = _ours("triu", [Spec(shape, dist)], {"diagonal": diagonal}, mesh)
    ins, outs = paddle_infer("triu", Spec(shape, dist), diagonal)
    assert not nontrivial_differences(ours, ins, outs, [0])


@given(meshes(), shapes(1, 3, max_side=6), st.data())
def test_where_vs_paddle(mesh, shape, data):
    dists = [data.draw(paddle_dists(mesh, len(shape))) for _ in range(3)]
    assume(all(_even(shape, d) for d in dists) and len({d.mapping for d in dists}) == 1)  # (ties break differently)
    specs = [Spec(shape, d) for d in dists]
    ours = _ours("where", specs, {}, mesh)
    ins, outs = paddle_infer("where", *specs)
    assert not nontrivial_differences(ours, ins, outs, [0, 1, 2])


@given(meshes(), shapes(1, 3, max_side=6), st.data())
def test_tile_vs_paddle(mesh, shape, data):
    repeats = data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape)))
    dist = data.draw(paddle_dists(mesh, len(shape)))
    assume(_even(shape, dist))
    ours = _ours("tile", [Spec(shape, dist), Spec((len(repeats),), None)], {"repeat_times": repeats}, mesh)
    ins, outs = paddle_infer("tile", Spec(shape, dist), repeats)
    assert not nontrivial_differences(ours, ins, outs, [0])


@given(meshes(), shapes(2, 3, max_side=4), st.data())
def test_unbind_vs_paddle(mesh, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    dist = data.draw(paddle_dists(mesh, len(shape)))
    assume(_even(shape, dist))
    ours = _ours("unbind", [Spec(shape, dist)], {"axis": axis}, mesh)
    ins, outs = paddle_infer("unbind", Spec(shape, dist), axis)
    assert not nontrivial_differences(ours, ins, outs, [0])


@given(meshes(), shapes(1, 3, max_side=6), st.sampled_from(["logical_and", "bitwise_and"]), st.data())
def test_logical_and_bitwise_vs_paddle(mesh, shape, op, data):
    dists = [data.draw(paddle_dists(mesh, len(shape))) for _ in range(2)]
    assume(all(_even(shape, d) for d in dists) and dists[0].mapping == dists[1].mapping)
    specs = [Spec(shape, d) for d in dists]
    ours = _ours(op, specs, {}, mesh)
    ins, outs = paddle_infer(op, *specs)
    assert not nontrivial_differences(ours, ins, outs, [0, 1])
