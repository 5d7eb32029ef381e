"""check_finite_and_unscale_, update_loss_scaling_ and memcpy checked numerically with hypothesis
(Paddle's own kernels, autopar.testing.check_rule): every rank runs the op on its pieces and the
outputs rebuilt from the placements the rules infer — found_inf's pending max included — equal
the op on the whole tensors. An inf or nan lies in one rank's piece of a split or replicated
gradient (a pending sum's random pieces would spread it); the flag must still come out True.
On such an overflow Paddle's kernel multiplies the gradients by 0 instead of unscaling them
(measured: ``[1, inf, 3] -> [0, nan, 0]``), so the pieces of the ranks that saw no overflow
differ from the whole op's: those values are discarded (update_loss_scaling_ zeroes every piece
on the agreed flag, adamw_ skips), and only the flag is compared there.

Paddle has no SPMD rule for these ops to compare with (``get_phi_spmd_rule`` knows none).
"""

import numpy as np
import paddle
from hypothesis import given, settings
from hypothesis import strategies as st
from paddle import _C_ops

from autopar.testing import check_rule, dist_attrs, meshes, shapes


def _check_finite(values, attrs):
    """(g..., scale) -> (g / scale ..., found_inf), run as Paddle's kernel on the host."""
    with paddle.base.dygraph.guard():
        grads = [paddle.to_tensor(v) for v in values[:-1]]
        outs, found = _C_ops.check_finite_and_unscale_(grads, paddle.to_tensor(values[-1]))
        return [o.numpy() for o in outs] + [found.numpy()]


def _update(values, attrs):
    """(g..., found_inf, scale, good, bad, stop_update) -> (g zeroed on found_inf ..., scale, good, bad)."""
    with paddle.base.dygraph.guard():
        count = len(values) - 5
        grads = [paddle.to_tensor(v) for v in values[:count]]
        found, scale, good, bad, stop = (paddle.to_tensor(v) for v in values[count:])
        outs, scale, good, bad = _C_ops.update_loss_scaling_(grads, found, scale, good, bad, 2, 1, 2.0, 0.5, stop)
        return [o.numpy() for o in outs] + [scale.numpy(), good.numpy(), bad.numpy()]


def _flag_only(values, attrs):
    """The op with its gradient outputs left out of the comparison (zeros): on an overflow."""
    outs = _check_finite(values, attrs)
    return [np.zeros_like(o) for o in outs[:-1]] + outs[-1:]


def _grads(shape, count, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    return [rng.standard_normal(shape).astype("float32") for _ in range(count)]


@settings(deadline=None, max_examples=40)
@given(meshes(max_ranks=4), shapes(1, 2), st.data())
def test_check_finite_and_unscale(mesh, shape, data):
    grads = _grads(shape, 2, data)
    dists = [data.draw(dist_attrs(mesh, len(shape), partial=True)) for _ in grads]
    poisoned = data.draw(st.sampled_from([None, np.inf, np.nan]))
    if poisoned is not None and not dists[0].partial:  # one element: in one rank's piece (or every replica)
        grads[0][tuple(data.draw(st.integers(0, s - 1)) for s in shape)] = poisoned
    scale = np.array([4.0], "float32")
    fn = _check_finite if poisoned is None or dists[0].partial else _flag_only
    check = check_rule("check_finite_and_unscale_", fn, [*grads, scale], [*dists, None], mesh=mesh)
    flag = check.result.outputs[-1]
    pending = {d for dist in dists for d in dist.sharded_mesh_dims() | set(dist.partial_dims)}
    assert flag.partial_dims == dict.fromkeys(pending, "max") and not flag.sharded_mesh_dims()


@settings(deadline=None, max_examples=40)
@given(meshes(max_ranks=4), shapes(1, 2), st.booleans(), st.data())
def test_update_loss_scaling(mesh, shape, found_inf, data):
    grads = _grads(shape, 2, data)
    dists = [data.draw(dist_attrs(mesh, len(shape), partial=True)) for _ in grads]
    states = [
        np.array([found_inf]), np.array([1024.0], "float32"), np.array([1], "int32"), np.array([0], "int32"),
        np.array([False]),
    ]  # fmt: skip
    check_rule("update_loss_scaling_", _update, [*grads, *states], [*dists, *([None] * 5)], mesh=mesh)


@settings(deadline=None, max_examples=20)
@given(meshes(max_ranks=4), st.data())
def test_memcpy_keeps_a_pending_max(mesh, data):
    flag = data.draw(dist_attrs(mesh, 1, partial=True, kinds=("max",)))
    value = np.array([data.draw(st.booleans())])
    check = check_rule("memcpy", lambda values, attrs: [values[0].copy()], [value], [flag], mesh=mesh)
    assert check.result.outputs[0] == check.result.inputs[0] == flag
