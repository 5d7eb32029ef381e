"""Each collective formula against hand-computed numbers (tiny 2 x 2 cluster)."""

import pytest

from autopar.cost_model import Cluster, Device, Link, collective_time
from autopar.cost_model.comm import groups_time, local_copy_time

# intra: 1 us, 1 GB/s; inter: 10 us, 100 MB/s; copy at 100 GB/s. Ranks 0,1 on node 0; 2,3 on node 1.
RING = Cluster("t", 2, 2, Link(1e-6, 1e9), Link(1e-5, 1e8), Device((("float32", 1e12),), 1e11, 1e10), tree=False)
TREE = Cluster("t", 2, 2, Link(1e-6, 1e9), Link(1e-5, 1e8), Device((("float32", 1e12),), 1e11, 1e10), tree=True)
MB = 1e6


@pytest.mark.parametrize(
    "kind, group, nbytes, expected",
    [
        ("all_reduce", (0, 1), MB, 2 * 1e-6 + 2 * 0.5 * MB / 1e9),  # 1.002 ms
        ("all_reduce", (0, 1, 2, 3), MB, 6 * 1e-5 + 2 * 0.75 * MB / 1e8),  # crosses nodes: 15.06 ms
        ("all_gather", (0, 1), MB, 1e-6 + 0.5 * MB / 1e9),
        ("reduce_scatter", (0, 1), MB, 1e-6 + 0.5 * MB / 1e9),
        ("all_to_all", (0, 1, 2, 3), 4 * MB, 3e-5 + 0.75 * 4 * MB / 1e8),  # 30.03 ms
        ("broadcast", (0, 1), MB, 1e-6 + MB / 1e9),
        ("send_recv", (0, 2), MB, 1e-5 + MB / 1e8),
        ("send_recv", (1, 0), MB, 1e-6 + MB / 1e9),
        ("all_reduce", (3,), MB, 0.0),  # a group of one rank
    ],
)
def test_ring_formulas(kind, group, nbytes, expected):
    assert collective_time(kind, group, nbytes, RING) == pytest.approx(expected, rel=1e-12)


def test_tree_where_cheaper():
    # 100 B all_reduce over 4 ranks across nodes: ring 6a + 1.5 n b = 61.5 us; tree 4a + 2 n b = 42 us
    assert collective_time("all_reduce", (0, 1, 2, 3), 100, TREE) == pytest.approx(4e-5 + 2e-6)
    assert collective_time("all_reduce", (0, 1, 2, 3), 100, RING) == pytest.approx(6e-5 + 1.5e-6)
    # big buffers: the ring wins
    assert collective_time("all_reduce", (0, 1, 2, 3), MB, TREE) == pytest.approx(6e-5 + 1.5e-2)
    # broadcast: binomial tree 2(a + n b) = 22 us beats the chain 3a + n b = 31 us at 100 B
    assert collective_time("broadcast", (0, 1, 2, 3), 100, TREE) == pytest.approx(2 * (1e-5 + 1e-6))
    assert collective_time("broadcast", (0, 1, 2, 3), MB, TREE) == pytest.approx(3e-5 + 1e-2)


def test_emulated_kinds_cost_what_runs():
    import dataclasses

    gloo = dataclasses.replace(RING, emulated=("reduce_scatter", "all_to_all"))
    # reduce_scatter = all_reduce(n) + copy of n/p: 1.002 ms + 2 * 0.5 MB / 100 GB/s
    assert collective_time("reduce_scatter", (0, 1), MB, gloo) == pytest.approx(1.002e-3 + 1e-5)
    # all_to_all = all_gather(p n) + copy of n: (1 us + 0.5 * 2 MB / 1 GB/s) + 2 MB / 100 GB/s
    assert collective_time("all_to_all", (0, 1), MB, gloo) == pytest.approx(1.001e-3 + 2e-5)


def test_calibrated_fit_per_group_size():
    import dataclasses

    fitted = dataclasses.replace(RING, collectives=(("all_reduce", Link(1e-4, 1e9)), ("all_reduce@2", Link(2e-4, 1e9))))
    assert collective_time("all_reduce", (0, 1), MB, fitted) == pytest.approx(2 * 2e-4 + 1e-3)
    assert collective_time("all_gather", (0, 1), MB, fitted) == pytest.approx(1e-6 + 0.5e-3)  # no fit: intra


def test_concurrent_groups_take_the_slowest_and_copy_time():
    assert groups_time("all_gather", [(0, 1), (2, 3)], MB, RING) == pytest.approx(1e-6 + 0.5e-3)
    assert groups_time("all_gather", [(0, 2), (1, 3)], MB, RING) == pytest.approx(1e-5 + 0.5e-2)
    assert local_copy_time(MB, RING) == pytest.approx(2e-5)
