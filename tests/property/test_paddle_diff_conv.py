"""Differential tests of conv2d against Paddle's rule (pool2d has no Paddle rule).

Known differences (ours checked numerically where they occur):
- spatial dims: Paddle's rule keeps an H / W split (input, filter kernel dims and output);
  a window crossing a shard border needs its neighbour's rows (a halo exchange neither
  Paddle nor we insert), so we require H and W whole;
- ``groups > 1``: we keep only the batch split (channels are tied to their group); Paddle
  applies the groups == 1 equation;
- NHWC: Paddle's conv2d rule reads the NCHW layout only; we follow ``data_format`` (cases
  here are NCHW);
- dims their number of parts does not divide (uneven) (see test_paddle_diff_shape);
- input and filter channel splits that differ, or one dim split over two mesh dims by the
  two operands: Paddle raises; we merge them (one wins, the
  other operand is resharded; a Conflict records it).
"""

from hypothesis import given
from hypothesis import strategies as st
from paddle_oracle import Spec, differences, paddle_dists, paddle_infer
from test_rules_conv import _rand, conv, conv_cases

from autopar.spmd import RuleContext, TensorSpec, get_rule
from autopar.testing import check_rule, eager, meshes


@given(meshes(), st.data())
def test_conv2d_vs_paddle(mesh, data):
    x_shape, w_shape, attrs = data.draw(conv_cases(mesh))
    if attrs["data_format"] == "NHWC":  # Paddle's rule reads NCHW: use the same case in NCHW
        x_shape = (x_shape[0], x_shape[3], x_shape[1], x_shape[2])
        attrs = {**attrs, "data_format": "NCHW"}
    dx, dw = data.draw(paddle_dists(mesh, 4)), data.draw(paddle_dists(mesh, 4))
    ours = get_rule("conv2d").infer_forward(
        [TensorSpec(x_shape, dx), TensorSpec(w_shape, dw)], attrs, RuleContext(mesh)
    )
    try:
        ins, outs = paddle_infer(
            "conv2d", Spec(x_shape, dx), Spec(w_shape, dw), attrs["strides"], attrs["paddings"], "EXPLICIT",
            attrs["dilations"], attrs["groups"], "NCHW",
        )  # fmt: skip
        diffs = differences(ours, ins, outs, [0, 1])
    except (ValueError, NotImplementedError) as err:  # Paddle refuses competing splits; we merge them
        assert "channel" in str(err) or "two different mesh" in str(err)
        ins = outs = None
        diffs = ["paddle declined"]
    if diffs:
        check_rule("conv2d", eager(conv), [_rand(x_shape), _rand(w_shape, 1)], [dx, dw], attrs, mesh)
    if attrs["groups"] == 1 and all(s >= mesh.size for s in x_shape[:2]) and w_shape[0] >= mesh.size:
        # same equation: only tie-breaks between competing splits may differ
        assert all("input" in d or "output" in d or d == "paddle declined" for d in diffs)
