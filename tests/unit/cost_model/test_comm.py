"""Each collective formula against hand-computed numbers (tiny 2 x 2 cluster)."""

import pytest

from autopar.cost_model import Cluster, Device, Link, collective_time
from autopar.cost_model.comm import groups_time, local_copy_time
from autopar.errors import CostModelError

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


def test_emulated_all_to_all_costs_at_least_the_all_gather_of_every_send_buffer():
    import dataclasses

    gloo = dataclasses.replace(RING, emulated=("reduce_scatter", "all_to_all"))
    for group in ((0, 1), (0, 1, 2, 3)):
        p = len(group)
        gathered = collective_time("all_gather", group, p * MB, gloo)  # p x n bytes gathered
        assert collective_time("all_to_all", group, MB, gloo) >= gathered
        assert collective_time("all_to_all", group, MB, gloo) > collective_time("all_to_all", group, MB, RING)


def test_knee_adds_the_fresh_memory_term_from_its_size_on():
    knee = Link(1e-6, 1e9, knee=2 * MB, knee_bandwidth=1e8)
    fitted = Cluster("t", 1, 4, knee, knee, RING.device, collectives=(("all_gather", knee),), tree=False)
    below = collective_time("all_gather", (0, 1), MB, fitted)
    assert below == pytest.approx(1e-6 + 0.5 * MB / 1e9)  # no knee term below 2 MB
    assert collective_time("all_gather", (0, 1), 2 * MB, fitted) == pytest.approx(1e-6 + MB / 1e9 + 2 * MB / 1e8)
    assert Link.from_dict(knee.to_dict(), "x") == knee and "knee" not in Link(1e-6, 1e9).to_dict()


def test_subgroup_on_a_world_exchange_profile_costs_a_world_all_gather_of_every_input():
    import dataclasses

    native = dataclasses.replace(RING, nodes=1, devices_per_node=4, inter=RING.intra)
    exchange = dataclasses.replace(native, subgroups="world_exchange")
    for kind, nbytes, piece in (("all_reduce", MB, MB), ("all_gather", MB, MB / 2), ("reduce_scatter", MB, MB)):
        on_native = collective_time(kind, (0, 1), nbytes, native, world_size=4)
        assert on_native == collective_time(kind, (0, 1), nbytes, native)  # NCCL-like: the group's own ring
        # every rank's input to every rank of the world: all_gather of 4 x piece, then the group's result locally
        expected = 3e-6 + 0.75 * 4 * piece / 1e9 + local_copy_time(2 * piece, exchange)
        assert collective_time(kind, (0, 1), nbytes, exchange, world_size=4) == pytest.approx(expected)
        assert collective_time(kind, (0, 1), nbytes, exchange, world_size=4) > on_native
    # the whole world stays native; without a world size nothing is known to be a sub-group
    assert collective_time("all_reduce", (0, 1, 2, 3), MB, exchange, world_size=4) == collective_time(
        "all_reduce", (0, 1, 2, 3), MB, native
    )
    assert collective_time("all_reduce", (0, 1), MB, exchange) == collective_time("all_reduce", (0, 1), MB, native)
    # concurrent groups of a mesh: their union is the world
    assert groups_time("all_reduce", [(0, 1), (2, 3)], MB, exchange) == pytest.approx(
        collective_time("all_reduce", (0, 1), MB, exchange, world_size=4)
    )
    with pytest.raises(CostModelError, match="not inside the world"):
        collective_time("all_reduce", (0, 5), MB, exchange, world_size=4)


def test_shipped_profiles_price_subgroups_as_their_backend_runs_them():
    from autopar.cost_model import shipped_profile

    h100, gloo = shipped_profile("h100-node"), shipped_profile("cpu-gloo")
    assert h100.subgroups == "native" and gloo.subgroups == "world_exchange"
    for group in ((0, 1), (0, 2)):  # h100: unchanged by knowing the world
        assert collective_time("all_reduce", group, 64 * MB, h100, world_size=8) == collective_time(
            "all_reduce", group, 64 * MB, h100
        )
    sub = collective_time("all_reduce", (0, 1), 16 * MB, gloo, world_size=4)
    assert sub > collective_time("all_reduce", (0, 1), 16 * MB, gloo)
    assert sub > collective_time("all_reduce", (0, 1, 2, 3), 16 * MB, gloo, world_size=4)
