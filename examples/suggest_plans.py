"""Strategy search: the best plans for an unannotated GPT on N devices, ranked and explained.

    python examples/suggest_plans.py
    autopar suggest examples/suggest_plans.py:program --world 8 --profile h100-node

Nothing is annotated: ``autopar.suggest`` finds the batch dim of the feeds, the Megatron pairs
of linears and the vocabulary-parallel embedding itself, prices every mesh shape x strategy
from one analysis per shape (no rank program built), and ranks the plans that fit in memory by
predicted step time. The best plan for 4 ranks of this machine is then compiled and simulated
against the serial program.
"""

import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.models import gpt_block_program  # noqa: E402
from autopar.testing.serial import assert_simulation_equals_serial  # noqa: E402


def seed_program():
    return gpt_block_program(batch=8, seq=16, hidden=64, heads=4, vocab=128, layers=4, optimizer="sgd", seed=1, layer_calls=True)


def program():
    """The handover for ``autopar suggest``: (main, startup)."""
    seed = seed_program()
    return seed.main, seed.startup


if __name__ == "__main__":
    seed = seed_program()
    print("8 H100s (profile h100-node):")
    print(autopar.suggest(seed.main, 8, seed.startup, cluster="h100-node"))
    print("\n4 ranks of this machine (the hardware's profile), 2 MiB per rank:")
    plans = autopar.suggest(seed.main, 4, seed.startup, memory_per_rank=2 << 20)
    print(plans)
    assert_simulation_equals_serial(seed, plans[0].compile())
    print(f"\nthe best plan ({plans[0].shape} [{plans[0].features}]) simulated: equal to serial")
