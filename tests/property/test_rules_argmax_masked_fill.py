"""The rules of a top-2 router's argmax and masked_fill (PaddleNLP's ``top2gating``: the first
expert by ``argmax``, the second by ``argmax`` of the logits with the first ``masked_fill``-ed
to -inf), checked numerically (hypothesis): argmax / argmin keep every split but the reduced
axis's, masked_fill and its grad are broadcasting elementwise (the fill value's gradient a sum)."""

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from autopar.testing import check_rule, eager, maybe_dist_attrs, meshes, shapes


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_argmax_and_argmin_keep_the_splits_of_the_other_dims(mesh, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    keepdims, flatten = data.draw(st.booleans()), data.draw(st.booleans())
    x = _rand(shape)
    dist = data.draw(maybe_dist_attrs(mesh, len(shape)))
    attrs = {"axis": axis, "keepdims": keepdims, "flatten": flatten}
    for name, op in (("argmax", paddle.argmax), ("argmin", paddle.argmin)):
        check = check_rule(name, eager(_arg(op)), [x, np.array(axis, "int64")], [dist, None], attrs, mesh)
        if dist is not None and not flatten:  # every split of a dim other than the axis is kept
            out = check.result.outputs[0].mapping
            kept = [(j, i) for j, i in enumerate(i for i in range(len(shape)) if i != axis) if _divides(mesh, shape[i], dist.mapping[i])]
            assert [out[i if keepdims else j] for j, i in kept] == [dist.mapping[i] for _, i in kept]


def _arg(op):
    """Paddle's argmax / argmin as the op's operands and attributes call it."""
    return lambda t, a, axis, keepdims, flatten: op(t, axis=None if flatten else axis, keepdim=keepdims)


def _divides(mesh, size, split):
    """A dim of ``size`` split evenly over the mesh dims ``split`` (an uneven one a rule may drop)."""
    return size > 1 and size % int(np.prod([mesh.shape[d] for d in split])) == 0


@given(meshes(), shapes(1, 3, max_side=5), st.data())
def test_masked_fill_and_grad(mesh, shape, data):
    rng = np.random.default_rng(2)
    mask = rng.random(shape) > 0.5
    x, g = _rand(shape), _rand(shape, 3)
    value = np.array(-1.5, "float32")
    dists = [data.draw(maybe_dist_attrs(mesh, len(shape))) for _ in range(2)] + [None]
    check_rule("masked_fill", eager(lambda t, m, v: paddle.masked_fill(t, m, v)), [x, mask, value], dists, {}, mesh)
    dists.append(data.draw(maybe_dist_attrs(mesh, len(shape), partial=True)))
    grads = lambda ins, a: [np.where(ins[1], 0, ins[3]), np.where(ins[1], ins[3], 0).sum()]  # noqa: E731
    check_rule("masked_fill_grad", grads, [x, mask, value, g], dists, {}, mesh)
