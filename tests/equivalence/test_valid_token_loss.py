"""A loss averaged over the valid tokens (``sum(token_loss * valid) / sum(valid)``, PyTorch's
``ignore_index`` mean) under micro-batching (issue: real models, 13): exact, each micro-batch
divides by the whole batch's count of valid tokens, made from the whole labels feed
(``rewrites/whole_feeds.py``). Before: refused ("pd_op.divide reads %167.0 as [R], but one
micro-batch holds [P(sum)]"); Paddle's pipeline averages the micro-batches' means, which is
not the serial loss."""

import numpy as np
import pytest

import autopar
from autopar.testing.serial import assert_simulation_equals_serial, run_serial
from autopar.testing.zoo import gpt2

PP = autopar.ProcessMesh([0, 1], ["pp"])


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_valid_token_mean_is_exact_over_micro_batches(micro_batches):
    config = gpt2.Config()
    seed = gpt2.build(config, batch=4, seq=8, mesh=PP)
    strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=micro_batches))
    dist = autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=strategy)
    reports = [text for name, text in dist.decisions.rewrites() if name == "micro_batching"]
    assert any("made from the whole batch's feeds in every micro-batch" in text for text in reports), reports
    feeds = gpt2.feeds(config, 4, 8, 3)
    assert_simulation_equals_serial(seed, dist, feeds=feeds)


def test_the_mean_of_micro_batch_means_would_differ():
    """The feeds make the check meaningful: the valid counts differ between micro-batches."""
    config = gpt2.Config()
    seed = gpt2.build(config, batch=4, seq=8)
    (feed,) = gpt2.feeds(config, 4, 8, 1)
    whole = run_serial(seed.main, seed.startup, [feed], [seed.loss]).fetches[0][0]
    halves = [{k: v[i * 2 : (i + 1) * 2] for k, v in feed.items()} for i in range(2)]
    counts = [int((h["targets"] != gpt2.IGNORE).sum()) for h in halves]
    assert counts[0] != counts[1]
    small = gpt2.build(config, batch=2, seq=8)
    means = [run_serial(small.main, small.startup, [h], [small.loss]).fetches[0][0] for h in halves]
    sums = [m * c for m, c in zip(means, counts)]
    np.testing.assert_allclose(sum(sums) / sum(counts), whole, rtol=1e-5)  # the exact loss
    assert abs(np.mean(means) - whole) > 1e-4  # what averaging the micro-batches' means gives
