"""Every collective kind the planner emits runs and keeps the equivalence law (simulator);
bad feeds are refused by name."""

import numpy as np
import pytest

import autopar
from autopar.testing.models import reshard_chain
from autopar.testing.serial import random_feeds, run_serial


@pytest.mark.usefixtures("gloo_profile")  # (the chain is designed for cpu-gloo's choices)
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_all_to_all_all_reduce_all_gather_equal_serial(world):
    net, dist = reshard_chain(world)
    kinds = {c.kind for c in dist.comm_ops(0)}
    assert {"reduce_scatter", "all_to_all", "all_reduce", "all_gather"} <= kinds, kinds
    feeds = random_feeds(net.feeds, 4)
    serial = run_serial(net.main, net.startup, feeds, [net.loss])
    result = autopar.simulate(dist, feeds, [net.loss])
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg=f"loss at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_feed_of_the_wrong_global_shape_is_refused_by_name():
    net, dist = reshard_chain(2)
    feeds = random_feeds(net.feeds, 1)
    feeds[0]["x"] = feeds[0]["x"][:, :-1]
    with pytest.raises(autopar.AutoparError, match=r"feed 'x' has shape \[8, 15\], the program declares \[8, 16\]"):
        autopar.simulate(dist, feeds, [net.loss])
