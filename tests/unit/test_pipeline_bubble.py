"""The pipeline price's bubble is the verified schedule's replay (autopar.pricing.pipeline_bubble),
not a closed form: with equal stages it gives the schedules' known bubbles, with unequal ones
what the replay finds (the slow stage sets the pace; the fast ones wait)."""

import pytest

from autopar.pricing import pipeline_bubble


@pytest.mark.parametrize(
    ("schedule", "ranks", "micro_batches", "virtual", "want"),
    [
        ("FThenB", 4, 8, 1, 3 * (1.0 + 2.0)),
        ("1F1B", 4, 8, 1, 3 * (1.0 + 2.0)),
        ("1F1B", 2, 1, 1, 1 * (1.0 + 2.0)),
        ("ZBH1", 4, 8, 1, 3 * 1.0),  # (F = I = W: (p - 1) F, a third of 1F1B's; the old closed form said 3 (F + B / 2))
        ("Interleaved1F1B", 4, 8, 2, 3 * (1.0 + 2.0) / 2),
    ],
)
def test_equal_stages_give_the_closed_forms(schedule, ranks, micro_batches, virtual, want):
    assert pipeline_bubble(schedule, micro_batches, virtual, ((1.0, 2.0),) * ranks) == pytest.approx(want)


def test_a_slow_stage_is_replayed_not_estimated():
    """Stage 1 three times as slow: 1F1B with 4 micro-batches runs 0F0 (1), then stage 1's
    4 x (3 + 6) back to back, then 0's last backward (2): 39 s, of which stage 1 works 36.
    The slow stage first: it never waits and ends last, no bubble at all. (The closed form
    charged (p - 1) times the slowest stage's forward + backward, 9 s, both ways.)"""
    assert pipeline_bubble("1F1B", 4, 1, ((1.0, 2.0), (3.0, 6.0))) == pytest.approx(1.0 + 4 * 9.0 + 2.0 - 36.0)
    assert pipeline_bubble("1F1B", 4, 1, ((3.0, 6.0), (1.0, 2.0))) == 0.0
