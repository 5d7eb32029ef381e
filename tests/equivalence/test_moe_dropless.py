"""Dropless routing in the zoo MoE (``Config(dropless=True)``: every expert has a slot for every
token of its group), and in the ported Qwen2-MoE with the worst-case capacity
(``capacity_factor = num_experts``: ``(tokens // experts) x experts`` slots, every token), on
the GPU profile, in the simulator: equal to serial with the padded
all_to_alls and with the uneven ones (``Strategy(uneven_all_to_all=True)``); the padding said in
each dispatch / combine all_to_all's reason and in ``autopar explain``; the uneven all_to_all
sends fewer bytes than the padded one, counted on the arrays the simulator sends
(:mod:`autopar.runtime.wire`)."""

import math

import pytest

import autopar
from autopar.cli import explain_text
from autopar.errors import NativeUnsupported
from autopar.runtime.wire import counting
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import moe, qwen2_moe

M = autopar.ProcessMesh
BATCH, SEQ, STEPS = 4, 8, 2
QWEN = qwen2_moe.Config(num_hidden_layers=1, capacity_factor=4.0)  # 4 experts: the worst case
CASES = {  # name: (mesh, model, build's keywords, config)
    "stacked ep2": (M([0, 1], ["ep"]), moe, {"experts": "stacked"}, moe.Config(n_layers=1, dropless=True, router_groups=2)),
    "local ep2": (M([0, 1], ["ep"]), moe, {"experts": "local"}, moe.Config(n_layers=1, dropless=True)),
    "local dp x ep": (M([[0, 1], [2, 3]], ["dp", "ep"]), moe, {"experts": "local"}, moe.Config(n_layers=1, dropless=True)),
    "stacked dp x ep": (M([[0, 1], [2, 3]], ["dp", "ep"]), moe, {"experts": "stacked"},
                        moe.Config(n_layers=1, dropless=True, router_groups=4)),
    "qwen2-moe ep2": (M([0, 1], ["ep"]), qwen2_moe, {}, QWEN),
}  # fmt: skip


def _compiled(name, uneven):
    mesh, model, keywords, config = CASES[name]
    seed = model.build(config, batch=BATCH, seq=SEQ, mesh=mesh, **keywords)
    strategy = autopar.Strategy(cluster="h100-node", uneven_all_to_all=uneven)
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy), config


@pytest.fixture(scope="module")
def runs():
    """Per (case, uneven): the compile and the bytes rank 0 sent in its all_to_alls, every run
    checked equal to serial (losses every step, parameters after the last)."""
    found = {}
    for name in CASES:
        for uneven in (False, True):
            seed, dist, config = _compiled(name, uneven)
            with counting() as log:
                assert_simulation_equals_serial(seed, dist, feeds=CASES[name][1].feeds(config, BATCH, SEQ, STEPS))
            found[name, uneven] = (dist, log)
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_dropless_routing_equals_serial_padded_and_uneven(runs, name):
    padded, uneven = runs[name, False][0], runs[name, True][0]
    a2a = [c for c in padded.comm_ops(0) if "dropless buffer" in c.reason]
    trimmed = [c for c in uneven.comm_ops(0) if c.trim_axis is not None]
    assert a2a and all(c.kind.value == "all_to_all" for c in a2a)
    assert len(trimmed) == len(a2a) and all(c.kind.value == "all_to_all_v" for c in trimmed)
    if name != "stacked dp x ep":  # ep only: dispatch and combine, forward and backward
        assert len(a2a) == 4


def test_the_over_sent_bytes_are_said_in_the_reason_and_in_explain(runs):
    dist, _ = runs["stacked ep2", False]
    config = CASES["stacked ep2"][3]
    E, S, G = config.n_experts, BATCH * SEQ // config.router_groups, config.router_groups
    per_rank = E * (G // 2) * S * config.dim * 4  # [E, G/ep, C = S, dim] float32: the padded piece rank 0 holds
    need = per_rank * config.top_k // E  # tokens x top_k x hidden of the E x C slots
    said = (f"dropless buffer [{E}, {G}, {S}, {config.dim}] (capacity {S}: every token of a group in one expert): "
            f"sends {per_rank} B per rank, the routed tokens need {need} B")  # fmt: skip
    reasons = [c.reason for c in dist.comm_ops(0) if c.kind.value == "all_to_all"]
    assert len(reasons) == 4 and all(said in r for r in reasons), reasons
    assert f"{per_rank - need} B of padding" in reasons[0]
    assert said in explain_text(dist)


def test_a_static_capacity_says_no_padding():
    mesh = CASES["stacked ep2"][0]
    seed = moe.build(moe.Config(n_layers=1, router_groups=2), batch=BATCH, seq=SEQ, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(cluster="h100-node", uneven_all_to_all=True))
    a2a = [c for c in dist.comm_ops(0) if "all_to_all" in c.kind.value]
    assert len(a2a) == 4 and all(c.kind.value == "all_to_all" and "dropless" not in c.reason for c in a2a)


@pytest.mark.parametrize("name", list(CASES))
def test_the_uneven_all_to_all_sends_fewer_bytes_than_the_padded_one(runs, name):
    """Counted on the messages the simulator exchanged (the padded pieces for the other members;
    the uneven form's counts and trimmed pieces), rank 0, the dropless buffer's all_to_alls."""
    padded = runs[name, False][1].sent(rank=0, kind="all_to_all")
    trimmed = runs[name, True][1].sent(rank=0, trimmed=True)
    untouched = runs[name, True][1].sent(rank=0, kind="all_to_all")  # (stacked dp x ep: all_to_alls of other values)
    assert padded > 0 and 0 < trimmed
    assert trimmed + untouched < padded
    dist = runs[name, False][0]
    assert padded == STEPS * sum(math.ceil(c.bytes / 2) for c in dist.comm_ops(0) if c.kind.value == "all_to_all")


def test_the_native_backend_refuses_the_uneven_all_to_all_by_name(runs):
    dist, _ = runs["stacked ep2", True]
    with pytest.raises(NativeUnsupported, match=r"native backend: all_to_all_v of .* in Transformer.*/Block/MoE.*use the host backend"):
        dist.rank_plan(0, "native")


def test_every_trimmed_all_to_all_sends_about_the_routed_share(runs):
    """The dispatch, the combine and both gradients: each sends little more than the routed
    ``top_k / n_experts`` of its padded pieces (the rows of empty slots are zero in all four:
    the zoo's experts have no bias, and an empty slot's combine weight is zero), never all of it."""
    dist, log = runs["stacked ep2", True]
    config = CASES["stacked ep2"][3]
    padded_piece = next(c.bytes for c in runs["stacked ep2", False][0].comm_ops(0) if c.kind.value == "all_to_all") // 2
    trimmed = [s for s in log.records if s.rank == 0 and s.trimmed]
    assert len(trimmed) == 4 * STEPS
    assert len({s.value for s in trimmed}) == 4
    share = config.top_k / config.n_experts
    assert all(s.nbytes < padded_piece * (share + 0.25) for s in trimmed), [(s.value, s.nbytes) for s in trimmed]


def test_the_plan_prices_the_uneven_all_to_all_at_the_routed_share(runs):
    """Planning chooses the uneven form (``reshard_planning(uneven_all_to_all=True)``), so the
    plan's price reads it: each all_to_all_v is priced at the routed ``top_k / n_experts`` of the
    padded pieces rank 0 sends the other member, and the plan sends less and waits less."""
    config = CASES["stacked ep2"][3]
    padded, uneven = runs["stacked ep2", False][0], runs["stacked ep2", True][0]
    before = [c.bytes for c in padded.comm_ops(0) if "dropless buffer" in c.reason]
    after = [c.bytes for c in uneven.comm_ops(0) if c.trim_axis is not None]
    assert after == [b // 2 * config.top_k // config.n_experts for b in before]
    assert "reshard_planning(uneven_all_to_all=True)" in str(uneven.passes)
    cheap, dear = uneven.decisions.price(), padded.decisions.price()
    assert cheap.sent < dear.sent and cheap.communication < dear.communication


def test_the_ported_qwen2_moes_joined_copies_say_their_groups(runs):
    """Its gate and dispatch run per rank in ``local_map``: the two copies' ``[E, C, H]`` buffers
    are joined along the capacity into the all_to_all's ``[E, 2C, H]``; the gate's top-2 is two
    ``argmax`` (PaddleNLP's top2gating)."""
    dist, _ = runs["qwen2-moe ep2", False]
    per_rank = 4 * 16 * QWEN.hidden_size * 4  # [E, C = 16 tokens per rank, hidden] float32: rank 0's group
    said = (f"dropless buffer [4, 32, {QWEN.hidden_size}] (capacity 16 x 2 groups: every token of a group in one expert): "
            f"sends {per_rank} B per rank, the routed tokens need {per_rank // 2} B (tokens x top_k x hidden: 32 x 2 x")  # fmt: skip
    reasons = [c.reason for c in dist.comm_ops(0) if c.kind.value == "all_to_all"]
    assert len(reasons) == 4 and all(said in r for r in reasons), reasons
