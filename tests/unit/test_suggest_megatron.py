"""``benchmarks/bench_suggest.py --megatron``: each Table 1 row prints Megatron-LM's published,
measured step (their TFLOP/s per A100 over the paper's Eq. 3 FLOPs; scaled to an H100 by the
dense bf16 peaks) beside our bfloat16 price of the same plan, and the error. The search itself
is slow at GPT scale: these tests run the function computing a row on a small model."""

import importlib.util
import sys
from pathlib import Path

import pytest

from autopar.testing.models import gpt_block_program
from autopar.units import format_time

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_suggest", ROOT / "benchmarks" / "bench_suggest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_row_1s_published_step_is_their_rate_over_eq_3s_flops(bench):
    """1.7B on 32 A100s, batch 512: 96 * 512 * 2048 * 24 * 2304^2 * (1 + 2048 / 13824 + 51200 /
    884736) = 1.547e16 FLOPs a step over 32 x 137 TFLOP/s = 3.53 s (their measured rate)."""
    row = bench.TABLE_1[0]
    assert (row.gpus, row.tensor, row.pipeline, row.data, row.batch, row.teraflops) == (32, 1, 1, 32, 512, 137)
    assert row.flops() == pytest.approx(1.547e16, rel=1e-3)
    assert format_time(row.step) == "3.53s"


def test_a_row_prints_the_published_step_beside_our_bf16_price_of_their_plan_and_the_error(bench):
    row = bench.Published(0.1, 2, 128, 2, 1, 1, 2, 4, 137)  # a small GPT on 2 GPUs (d = 2), sequence 2048 as theirs
    seed = gpt_block_program(batch=row.batch, seq=bench.SEQ, hidden=row.hidden, heads=row.heads, vocab=bench.VOCAB,
                             layers=row.layers, optimizer="adamw", seed=1, layer_calls=True)  # fmt: skip
    compared = bench.compare(row, seed.main, seed.startup)
    fp32 = bench.compare(row, seed.main, seed.startup, precision=None)
    scaled = row.step * 312e12 / 989.4e12  # A100's dense bf16 peak to H100's (h100-node's peak_flops)
    assert compared.published == row.step and compared.scaled == pytest.approx(scaled)
    assert compared.error == pytest.approx(compared.theirs.price.step / scaled - 1)
    assert str(compared.theirs.shape) == "dp=2" and compared.theirs.strategy.recompute
    assert compared.theirs.precision.startswith("bfloat16") and fp32.theirs.precision == "float32"
    assert compared.theirs.price.step < fp32.theirs.price.step
    published, ours, a100 = compared.lines()
    assert "measured by them on A100 80GB" in published and f"= {format_time(row.step)} a step" in published
    assert f"scaled to H100 by peak (312 -> 989.4 TFLOP/s): {format_time(scaled)}" in published
    assert f"{format_time(compared.theirs.price.step)} = compute" in ours
    assert f"error against the scaled published step: {compared.error:+.0%}" in ours
    assert compared.a100_error == pytest.approx(compared.on_a100.price.step / row.step - 1)
    assert "derived from h100-node by the datasheets' ratios (not measured)" in a100
    assert f"error against their measured step: {compared.a100_error:+.0%}" in a100


def test_the_a100_node_is_h100_node_scaled_by_the_datasheets(bench):
    """The same fraction of each dtype's peak as the H100 measured; A100 80GB's 2.039 TB/s, NVLink
    300 GB/s and HDR InfiniBand 25 GB/s per direction."""
    from autopar.cost_model import shipped_profile

    h100 = shipped_profile("h100-node")
    a100 = bench.a100_node(h100)
    assert a100.device.matmul_rate("bfloat16") == pytest.approx(7.1e14 * 312 / 989.4)
    assert a100.device.matmul_rate("bfloat16", batched=True) == pytest.approx(3.0e14 * 312 / 989.4)
    assert a100.device.matmul_rate("float32") == pytest.approx(5.057e13 * 19.5 / 67)
    assert a100.device.stream_bandwidth(1e9) == pytest.approx(2.95e12 * 2.039 / 3.35)
    assert (a100.intra.bandwidth, a100.inter.bandwidth, a100.devices_per_node) == (300e9, 25e9, 8)
