"""Differential tests of the shape-op rules against Paddle's (reshape, flatten, transpose,
squeeze, unsqueeze), forward and (reshape) backward.

Where we differ, our answer must be numerically valid (check_rule). Known, intended
differences:
- uneven splits: Paddle carries a group's leading split through a reshape even when the
  leading dims are not divisible by the number of parts; with uneven shards
  (``numpy.array_split`` bounds) the blocks then do not line up (``[3, 4] -> [12]`` on 2
  ranks: rows 0-1 | 2 are elements 0-7 | 8-11, but ``[12]``'s halves are 0-5 | 6-11), so we
  drop it;
- splits of size-1 dims: we never keep them (they hold no data to split);
- several split dims in one reshape group (``[2, 2] -> [4]`` split on both): Paddle merges
  them onto the group's leading dim and then falls back to its first mesh dim ("There are 2
  shared on tensor dim 0. Now fallback to sharding by mesh dim 0"); we carry the leading
  dim's own split only (the other split's blocks are not contiguous after the reshape);
- unsqueeze with unsorted axes (``[4, 0]``): Paddle's rule places the new dims differently
  from its kernel (which inserts them one at a time, as our rule does).
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from paddle_oracle import Spec, differences, paddle_dists, paddle_infer, paddle_infer_backward
from test_rules_shape import _rand, reshape_cases, reshape_fn

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.spmd.shape_ops import flatten_shape, local_target_shape, reshape_groups, squeeze_shape, unsqueeze_shape
from autopar.testing import check_rule, meshes


def _explained(in_shape, out_shape, dist, mesh):
    """Some group's leading split is uneven, or a size-1 dim is split: our documented drops."""
    for src, dst in reshape_groups(in_shape, out_shape):
        if not src:
            continue
        dims = dist.mapping[src[0]]
        parts = int(np.prod([mesh.shape[d] for d in dims])) if dims else 1
        if dims and (in_shape[src[0]] == 1 or in_shape[src[0]] % parts or (dst and out_shape[dst[0]] % parts)):
            return True
        if sum(1 for i in src if dist.mapping[i]) > 1:
            return True
    return any(dist.mapping[i] and s == 1 for i, s in enumerate(in_shape))


def _ours(op, specs, attrs, mesh):
    return get_rule(op).infer_forward(
        [TensorSpec(tuple(s.shape), s.dist) for s in specs], attrs, RuleContext(mesh, op_name=op)
    )


@given(meshes(), reshape_cases(), st.data())
def test_reshape_vs_paddle(mesh, case, data):
    in_shape, target, out_shape = case
    dist = data.draw(paddle_dists(mesh, len(in_shape)))
    ours = _ours("reshape", [Spec(in_shape, dist), Spec((len(target),), None)], {"shape": target}, mesh)
    ins, outs = paddle_infer("reshape", Spec(in_shape, dist), list(target))
    if differences(ours, ins, outs, [0]):
        assert _explained(in_shape, out_shape, dist, mesh), (
            differences(ours, ins, outs, [0]),
            in_shape,
            out_shape,
            dist,
        )
        x = _rand(in_shape)
        check_rule(
            "reshape",
            reshape_fn(in_shape, target),
            [x, np.array(target, "int64")],
            [dist, None],
            {"shape": target},
            mesh,
        )


@given(meshes(), reshape_cases(), st.data())
def test_reshape_backward_vs_paddle(mesh, case, data):
    in_shape, target, out_shape = case
    out = data.draw(paddle_dists(mesh, len(out_shape)))
    from autopar import DistAttr

    x = Spec(in_shape, DistAttr.replicated(mesh, len(in_shape)))
    specs = [TensorSpec(in_shape), TensorSpec((len(target),))]
    ours = get_rule("reshape").infer_backward(specs, [TensorSpec(out_shape, out)], {"shape": target}, RuleContext(mesh))
    ins, outs = paddle_infer_backward("reshape", [x], [Spec(out_shape, out)], list(target))
    if differences(ours, ins, outs, [0]):
        assert _explained(out_shape, in_shape, out, mesh), (differences(ours, ins, outs, [0]), in_shape, out_shape, out)
        xa = _rand(in_shape)
        check_rule(
            "reshape",
            reshape_fn(in_shape, target),
            [xa, np.array(target, "int64")],
            [None, None],
            {"shape": target},
            mesh,
            backward=[out],
        )


@given(meshes(), st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4), st.data())
def test_flatten_squeeze_unsqueeze_vs_paddle(mesh, shape, data):
    shape = tuple(shape)
    dist = data.draw(paddle_dists(mesh, len(shape)))
    x = _rand(shape)
    start = data.draw(st.integers(0, len(shape) - 1))
    stop = data.draw(st.integers(start, len(shape) - 1))
    ones = [i for i, s in enumerate(shape) if s == 1]
    squeeze_axes = data.draw(st.lists(st.sampled_from(ones), unique=True)) if ones else []
    new_axes = data.draw(st.lists(st.integers(0, len(shape)), max_size=2, unique=True))
    cases = [
        ("flatten", {"start_axis": start, "stop_axis": stop}, flatten_shape(shape, start, stop), [start, stop], False),
        ("squeeze", {"axis": squeeze_axes}, squeeze_shape(shape, squeeze_axes), [squeeze_axes], True),
        ("unsqueeze", {"axis": new_axes}, unsqueeze_shape(shape, new_axes), [new_axes], True),
    ]
    for op, attrs, out_shape, paddle_args, has_axis in cases:
        specs = [Spec(shape, dist)] + ([Spec((len(attrs["axis"]),), None)] if has_axis else [])
        ours = _ours(op, specs, attrs, mesh)
        ins, outs = paddle_infer(op, Spec(shape, dist), *paddle_args)
        if differences(ours, ins, outs, [0]):
            unsorted = op == "unsqueeze" and list(attrs["axis"]) != sorted(attrs["axis"])
            assert unsorted or _explained(shape, out_shape, dist, mesh), (
                op,
                differences(ours, ins, outs, [0]),
                shape,
                dist,
            )
            operands = [x] + ([np.array(attrs["axis"], "int64")] if has_axis else [])

            def fn(inputs, a, out_shape=out_shape):
                return [inputs[0].reshape(local_target_shape(shape, out_shape, inputs[0].shape))]

            check_rule(op, fn, operands, [dist] + [None] * (len(operands) - 1), attrs, mesh)


@given(meshes(), st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_transpose_vs_paddle(mesh, shape, data):
    """Transpose: splits follow their dims. Paddle marks an output dim its number of parts does
    not divide replicated while still requiring the input split (its output then claims data
    the ranks with empty pieces lack); we keep the split on both sides (checked numerically)."""
    dist = data.draw(paddle_dists(mesh, len(shape)))
    perm = list(data.draw(st.permutations(range(len(shape)))))
    ours = _ours("transpose", [Spec(tuple(shape), dist)], {"perm": perm}, mesh)
    ins, outs = paddle_infer("transpose", Spec(tuple(shape), dist), perm)
    if differences(ours, ins, outs, [0]):
        assert any(dist.mapping[i] and s % mesh.shape[dist.mapping[i][0]] for i, s in enumerate(shape))
        fn = lambda inputs, a: [np.transpose(inputs[0], a["perm"])]  # noqa: E731
        check_rule("transpose", fn, [_rand(tuple(shape))], [dist], {"perm": perm}, mesh)
