"""The zoo MoE over random expert counts, top-k, capacity factors and expert-parallel degrees,
written both ways (stacked experts split over ``ep``; Paddle's way, the router per group of
tokens in ``autopar.local_map`` and each expert on a sub-mesh of ``ep``): equal to serial (losses
every step, every parameter after 2 SGD steps), or refused by name."""

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import AutoparError
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import moe

M = autopar.ProcessMesh
MESHES = {
    "ep2": M([0, 1], ["ep"]),
    "ep4": M([0, 1, 2, 3], ["ep"]),
    "dp x ep": M([[0, 1], [2, 3]], ["dp", "ep"]),
}
# the refusals allowed, each naming what it refuses
REFUSALS = (
    r"experts='local' places n_experts / ep experts on each ep rank: \d+ experts do not divide over ep=\d",
    r"tensor '[\w.]+' of shape \[\d+, \d+, \d+\]: dim 0 \(\d+ elements\) split into \d+ pieces would leave ranks an empty piece",
)


@st.composite
def moe_cases(draw):
    experts = draw(st.sampled_from(["stacked", "local"]))
    name = draw(st.sampled_from(sorted(MESHES)))
    n_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, min(3, n_experts)))
    factor = draw(st.sampled_from([0.5, 1.0, 2.0]))
    return experts, name, moe.Config(n_layers=1, n_experts=n_experts, top_k=top_k, capacity_factor=factor)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(moe_cases())
def test_random_moes_equal_serial_or_are_refused_by_name(case):
    experts, name, config = case
    mesh = MESHES[name]
    try:
        seed = moe.build(config, batch=4, seq=8, mesh=mesh, experts=experts)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    except (AutoparError, ValueError) as refusal:
        assert any(re.search(p, str(refusal)) for p in REFUSALS), (case, str(refusal))
        return
    assert_simulation_equals_serial(seed, dist, feeds=moe.feeds(config, 4, 8, 2))
