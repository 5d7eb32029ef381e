"""Context parallelism priced side by side (cost_model/context_parallel.py): each method's bytes
per rank and attention activation memory against formulas written here, the ring's overlap
bound (a step costs max(block compute, shift)), Ulysses' head constraint, zig-zag's balance."""

import dataclasses

import pytest

from autopar.cost_model import collective_time, shipped_profile
from autopar.cost_model.context_parallel import (
    AttentionShape,
    block_work,
    compare,
    price_attention,
    ring_steps,
    serial_attention,
)
from autopar.errors import CostModelError

H100 = shipped_profile("h100-node")
B, S, H, KV, D = 2, 4096, 16, 4, 128  # grouped-query attention: 4 key / value heads
GQA = AttentionShape(B, S, H, D, KV, "bfloat16", causal=False)
BYTES = 2  # bfloat16


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_rings_bytes_are_cp_minus_1_kv_shifts_forward_and_as_many_plus_cp_dkdv_backward(cp):
    block = 2 * B * (S // cp) * KV * D * BYTES  # one rank's k and v
    price = price_attention(GQA, cp, "ring", H100)
    assert price.forward_sent == (cp - 1) * block
    assert price.backward_sent == (cp - 1) * block + cp * block
    assert price.collectives == (cp - 1) + cp


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ulysses_moves_q_k_v_and_the_output_each_way_about_4_activations_over_cp(cp):
    moved_kv = KV if KV % cp == 0 else H  # k, v repeated to every head where their heads do not split
    local_q, local_kv = B * (S // cp) * H * D * BYTES, B * (S // cp) * moved_kv * D * BYTES
    one_way = 2 * (local_q * (cp - 1) // cp) + 2 * (local_kv * (cp - 1) // cp)  # q, out; k, v
    price = price_attention(GQA, cp, "all_to_all", H100)
    assert price.forward_sent == price.backward_sent == one_way
    mha = AttentionShape(B, S, H, D, None, "bfloat16")
    activations = B * S * H * D * BYTES
    assert price_attention(mha, cp, "all_to_all", H100).forward_sent == pytest.approx(4 * activations / cp * (cp - 1) / cp, rel=1e-6)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_all_gather_plan_gathers_k_and_v_and_reduce_scatters_their_gradients(cp):
    whole = B * S * KV * D * BYTES
    price = price_attention(GQA, cp, "all_gather", H100)
    assert price.forward_sent == price.backward_sent == 2 * (whole * (cp - 1) // cp)
    group = tuple(range(cp))
    assert price.forward_comm == pytest.approx(2 * collective_time("all_gather", group, whole, H100))
    assert price.backward_comm == pytest.approx(2 * collective_time("reduce_scatter", group, whole, H100))
    assert price.forward == pytest.approx(price.forward_compute + price.forward_comm)  # on the critical path


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_attention_memory_per_rank(cp):
    """The ring keeps q, k, v, out of its tokens and the fp32 log-sum-exp: exactly 1/cp of its
    own cp = 1 figure, and (with one block of scores at a time) under 1/cp of the serial chain's
    memory; all_gather keeps [S/cp, S] probabilities and k, v whole; Ulysses [S, S] for H/cp heads."""
    t = S // cp
    ring = price_attention(GQA, cp, "ring", H100)
    assert ring.saved == (2 * B * t * H * D + 2 * B * t * KV * D) * BYTES + B * H * t * 4
    assert ring.saved * cp == price_attention(GQA, 1, "ring", H100).saved
    serial = serial_attention(GQA, H100)
    assert serial.saved == (B * S * H * D + 2 * B * S * KV * D) * BYTES + B * H * S * S * BYTES
    assert ring.memory <= serial.memory / cp
    gathered = price_attention(GQA, cp, "all_gather", H100)
    assert gathered.saved == (B * t * H * D + 2 * B * S * KV * D) * BYTES + B * H * t * S * BYTES
    ulysses = price_attention(GQA, cp, "all_to_all", H100)
    kv_per_rank = KV // cp if KV % cp == 0 else H // cp
    assert ulysses.saved == (B * S * (H // cp) * D + 2 * B * S * kv_per_rank * D) * BYTES + B * (H // cp) * S * S * BYTES
    assert ulysses.working == B * (H // cp) * S * S * BYTES and gathered.working == B * H * t * S * BYTES


def _link_scaled(factor: float):
    return dataclasses.replace(H100, intra=dataclasses.replace(H100.intra, bandwidth=H100.intra.bandwidth * factor))


@pytest.mark.parametrize("factor", [1.0, 1e-3])  # NVLink (the shift hides) and a link 1000x slower (it shows)
def test_each_ring_shift_hides_behind_one_blocks_compute(factor):
    """Without a mask every step computes one full block: forward = (cp-1) max(block, shift) +
    block; backward = (cp-1) max(block', shift of k, v, dk, dv) + block' + the last dk, dv home."""
    cluster, cp = _link_scaled(factor), 4
    price = price_attention(GQA, cp, "ring", cluster)
    group, block = tuple(range(cp)), 2 * B * (S // cp) * KV * D * BYTES
    shift, shift_back = collective_time("permute", group, block, cluster), collective_time("permute", group, 2 * block, cluster)
    fwd, bwd = price.forward_compute / cp, price.backward_compute / cp
    assert price.forward == pytest.approx((cp - 1) * max(fwd, shift) + fwd)
    assert price.backward == pytest.approx((cp - 1) * max(bwd, shift_back) + bwd + shift)
    if factor == 1.0:
        assert shift < fwd and price.exposed == pytest.approx(shift)  # only the dk, dv shift home shows
    else:
        assert shift > fwd and price.exposed > 0.5 * price.comm


def test_ulysses_collectives_are_not_hidden():
    price = price_attention(GQA, 4, "all_to_all", H100)
    assert price.forward == pytest.approx(price.forward_compute + price.forward_comm)
    assert price.collectives == 8


def test_zigzag_gives_every_rank_half_a_block_each_step_under_a_causal_mask():
    assert ring_steps(4, causal=True, balance="zigzag") == [0.5] * 4
    assert ring_steps(4, causal=True, balance=None) == [0.5, 1.0, 1.0, 1.0]  # the last rank: cp - 1/2 blocks
    assert ring_steps(4, causal=False, balance=None) == [1.0] * 4
    for balance in (None, "zigzag"):  # the causal half of the cp x cp blocks, however split
        assert sum(block_work(r, k, 4, True, balance) for r in range(4) for k in range(4)) == 8.0
    causal = dataclasses.replace(GQA, causal=True)
    plain, zigzag = (price_attention(causal, 4, "ring", H100, balance, skip_masked=True) for balance in (None, "zigzag"))
    assert zigzag.forward_compute < 0.6 * plain.forward_compute


def test_autopars_ring_computes_every_block_so_balance_changes_nothing_there():
    """passes/ring_attention.py computes each block, a fully masked one adding 0 (the default):
    causal or not, every step is a whole block; skipping the masked ones halves the work."""
    causal = dataclasses.replace(GQA, causal=True)
    plain, zigzag = (price_attention(causal, 4, "ring", H100, balance) for balance in (None, "zigzag"))
    assert plain.forward_compute == zigzag.forward_compute
    skipped = price_attention(causal, 4, "ring", H100, "zigzag", skip_masked=True)
    assert skipped.forward_compute == pytest.approx(plain.forward_compute / 2)
    assert set(compare(causal, 4, H100, "zigzag")) == {"serial", "ring", "all_to_all", "all_gather", "ring, masked blocks skipped"}


def test_compute_is_priced_in_the_programs_precision_at_the_batched_matmul_rate():
    """The core's two products at the device's batched rate (h100-node: 300 TFLOP/s bf16, 43 fp32;
    the scale, mask and softmax over the scores add their memory traffic)."""
    big = AttentionShape(1, 16384, 32, 128, None, "bfloat16", causal=False)
    products = 2 * 2 * 32 * 16384 * 16384 * 128
    bf16 = serial_attention(big, H100)
    scores = 32 * 16384 * 16384
    elementwise = 3 * 2 * scores * 2 / 2.95e12  # scale, softmax: read + write bf16 scores at the streamed rate (+ the product's)
    assert products / 3.0e14 < bf16.forward_compute < products / 3.0e14 + 2 * elementwise
    fp32 = serial_attention(dataclasses.replace(big, dtype="float32"), H100)
    assert fp32.forward_compute > products / 4.3e13 > 2 * bf16.forward_compute


def test_ulysses_needs_heads_divisible_by_cp_and_the_sequence_must_split():
    with pytest.raises(CostModelError, match="12 heads do not split over cp=8"):
        price_attention(AttentionShape(1, 4096, 12, 64), 8, "all_to_all", H100)
    with pytest.raises(CostModelError, match="does not split into 16 equal chunks"):
        price_attention(AttentionShape(1, 4104, 12, 64), 8, "ring", H100, "zigzag")
    assert set(compare(AttentionShape(1, 4096, 12, 64, causal=False), 8, H100)) == {"serial", "ring", "all_gather"}


# ---- a compiled ring: dist.decisions.price() (autopar/ring_pricing.py) ---------------------------
@pytest.fixture(scope="module")
def compiled():
    """The Llama zoo model (2 layers, 2 heads, 64 tokens) on sep=4, h100-node: the all-gather-KV
    plan and ring attention."""
    import warnings

    import autopar
    from autopar.testing.zoo import llama

    config = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1)
    mesh = autopar.ProcessMesh([0, 1, 2, 3], ["sep"])
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, method, balance, recompute in CONFIGURATIONS:
            seed = llama.build(config, batch=1, seq=64, optimizer="sgd")
            context = autopar.ContextParallel("sep", method, balance)
            strategy = autopar.Strategy(context_parallel=context, recompute=recompute, cluster="h100-node")
            out[name] = autopar.compile(seed.main, mesh, seed.startup, strategy)
    return out


CONFIGURATIONS = [  # name, method, balance, recompute
    ("all_gather", "all_gather", None, False), ("ring", "ring", None, False),
    ("ring zigzag", "ring", "zigzag", False), ("ring recompute", "ring", None, True),
]


@pytest.mark.parametrize("name", [c[0] for c in CONFIGURATIONS])
def test_a_compiled_steps_price_counts_the_collectives_its_rank_programs_run(compiled, name):
    """Priced without a rank program, the step moves the bytes and spends the collective seconds
    rank 0's program carries: the ring's permutes instead of the K / V gathers and dK / dV
    reduce_scatters they replace (2 (cp-1) + 1 a layer; under recompute cp-1 more, the forward
    ring run again)."""
    dist = compiled[name]
    price, comms = dist.decisions.price(), dist.comm_ops(0)
    assert price.sent == sum(c.bytes for c in comms)
    assert price.communication + price.hidden == pytest.approx(sum(c.time for c in comms))
    permutes = [c for c in comms if str(c.kind) == "permute"]
    per_layer = {"all_gather": 0, "ring": 7, "ring zigzag": 7, "ring recompute": 10}[name]
    assert len(permutes) == 2 * per_layer


def test_a_compiled_rings_shifts_hide_behind_its_blocks(compiled):
    """Each of a core's 3 forward and 3 backward shifts hides at most its own seconds; the one
    dk / dv shift home never hides: the ring's exposed communication is less than the gathers'."""
    ring, gathered = compiled["ring"].decisions.price(), compiled["all_gather"].decisions.price()
    shifts = [c for c in compiled["ring"].comm_ops(0) if str(c.kind) == "permute"]
    home = min(c.time for c in shifts)  # ([dk|dv], one a layer: as small as a forward [k|v] shift)
    assert 0 < ring.hidden <= sum(c.time for c in shifts) - 2 * home + 1e-12
    assert ring.communication < gathered.communication
    assert ring.compute > gathered.compute  # the backward recomputes each block's probabilities
    report = compiled["ring"].cost.ranks[0]  # dist.cost: the same pricing, every rank
    assert report.hidden == pytest.approx(ring.hidden) and report.step_time == pytest.approx(ring.compute + ring.communication)


def test_a_compiled_ring_keeps_no_scores_only_the_log_sum_exp(compiled):
    """Per rank the all-gather plan keeps each core's [B, H, S/cp, S] scores and probabilities; the
    ring keeps the fp32 log-sum-exp [B, H, S/cp] instead: memory falls by at least the probabilities."""
    ring, gathered = compiled["ring"].decisions.price(), compiled["all_gather"].decisions.price()
    probabilities = 2 * (1 * 2 * (64 // 4) * 64 * 4)  # two layers' [1, 2, 16, 64] float32
    lse = 2 * (1 * 2 * (64 // 4) * 4)
    assert gathered.memory - ring.memory >= probabilities - lse


def test_a_compiled_rings_shifts_move_the_precision_priced(compiled):
    """A float32 program priced as bfloat16 (``Precision("bfloat16")``): every shift moves half its bytes."""
    from autopar.cost_model.precision import Precision

    dist = compiled["ring"]
    as_built, bf16 = dist.decisions.price(), dist.decisions.price(Precision("bfloat16"))
    permuted = sum(c.bytes for c in dist.comm_ops(0) if str(c.kind) == "permute")
    assert permuted > 0 and bf16.sent == pytest.approx(as_built.sent / 2, rel=1e-6)  # (every collective carries float32)
