import json

import pytest

from autopar.cost_model import Cluster, load_cluster, shipped_profile
from autopar.cost_model.cluster import dtype_bytes
from autopar.errors import AutoparError, CostModelError


def test_shipped_profiles_load_and_round_trip(tmp_path):
    h100 = shipped_profile("h100-node")
    assert (h100.nodes, h100.devices_per_node) == (1, 8)
    assert h100.intra.bandwidth == 450e9 and h100.inter.bandwidth == 50e9
    assert {"intra.bandwidth", "inter.bandwidth", "device"} <= dict(h100.sources).keys()
    gloo = load_cluster("cpu-gloo")
    assert set(gloo.emulated) == {"reduce_scatter", "all_to_all"}
    assert {"all_reduce", "all_gather", "broadcast", "send_recv"} <= dict(gloo.collectives).keys()
    path = tmp_path / "c.json"
    h100.save(path)
    assert load_cluster(path) == h100


def test_placement_follows_rank_order():
    two = shipped_profile("h100-node").fitted(range(16))
    assert two.nodes == 2 and two.node_of(7) == 0 and two.node_of(8) == 1
    assert not two.crosses_nodes((0, 1, 2, 3, 4, 5, 6, 7))
    assert two.crosses_nodes((0, 8)) and two.link_for((0, 8)) == two.inter
    with pytest.raises(CostModelError, match="rank 99"):
        two.node_of(99)


def _profile(**changes):
    data = shipped_profile("h100-node").to_dict()
    for key, value in changes.items():
        target = data
        *path, last = key.split(".")
        for part in path:
            target = target[part]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return data


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"inter.bandwidth": None}, "inter.bandwidth"),
        ({"intra.latency": -1e-6}, "intra.latency"),
        ({"device.memory_bandwidth": 0}, "device.memory_bandwidth"),
        ({"device.peak_flops": {"float16": 1e15}}, "device.peak_flops.float32"),
        ({"nodes": None}, "nodes"),
        ({"devices_per_node": -8}, "devices_per_node"),
        ({"intra.bandwidth": "fast"}, "intra.bandwidth"),
    ],
)
def test_bad_profiles_name_the_field(tmp_path, changes, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_profile(**changes)))
    with pytest.raises(AutoparError, match=field.replace(".", r"\.")):
        load_cluster(path)


def test_unknown_profile_and_dtype():
    with pytest.raises(CostModelError, match="not found"):
        load_cluster("/nonexistent/cluster.json")
    with pytest.raises(CostModelError, match="unknown dtype 'float7'"):
        dtype_bytes("float7")
    assert dtype_bytes("paddle.bfloat16") == 2
    assert isinstance(Cluster.from_dict(_profile()), Cluster)


def test_subgroups_and_knee_round_trip_and_are_validated(tmp_path):
    gloo = shipped_profile("cpu-gloo")
    assert gloo.subgroups == "world_exchange"
    path = tmp_path / "gloo.json"
    gloo.save(path)
    assert load_cluster(path) == gloo
    assert shipped_profile("h100-node").subgroups == "native"  # the default when the field is absent
    for changes, field in (({"subgroups": "carrier_pigeon"}, "subgroups"),
                           ({"intra.knee": 1e6}, "intra.knee_bandwidth"),
                           ({"intra.knee": 0, "intra.knee_bandwidth": 1e9}, "intra.knee")):  # fmt: skip
        path.write_text(json.dumps(_profile(**changes)))
        with pytest.raises(AutoparError, match=field.replace(".", r"\.")):
            load_cluster(path)
