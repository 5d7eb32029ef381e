"""Context parallelism in real processes. One launch of 2: the zoo's Llama with Ulysses
(``method="all_to_all"``) on the host and the native backend, and GPT-2 with attention dropout
and the "all_gather" plan on the host backend, over ``sep`` = 2. One launch of 4: ring attention
over ``sep`` = 4 (GPT-2 with attention dropout) and on dp2 x sep2 (Llama), Ulysses over
``sep`` = 4 (Llama: 4 heads). Losses and parameters after 3 SGD steps equal serial (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    from autopar.testing.zoo import gpt2, llama

    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    cases = [
        ("llama all_to_all", llama, llama.Config(), "all_to_all", "host", None),
        ("llama all_to_all", llama, llama.Config(), "all_to_all", "native", None),
        ("gpt2 dropout all_gather", gpt2, gpt2.Config(dropout=0.1), "all_gather", "host", gpt2.feeds),
    ]
    for name, module, config, method, backend, feeds_of in cases:
        seed = module.build(config, batch=4, seq=8, mesh=mesh)
        strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method))
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        feeds = feeds_of(config, 4, 8, 3) if feeds_of is not None else random_feeds(seed.feeds, 3, classes=64)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds, backend)
        print("RESULT", name, backend, "equal", flush=True)
    """
)


def test_context_parallelism_in_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path, timeout=300)
    assert len(results) == 2 * 3, results


SCRIPT_4 = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    from autopar.testing.zoo import gpt2, llama

    sep4 = autopar.ProcessMesh([0, 1, 2, 3], ["sep"])
    dp_sep = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "sep"])
    cases = [
        ("gpt2 dropout ring sep4", gpt2, gpt2.Config(dropout=0.1), "ring", sep4, gpt2.feeds),
        ("llama ring dp2 x sep2", llama, llama.Config(), "ring", dp_sep, None),
        ("llama all_to_all sep4", llama, llama.Config(), "all_to_all", sep4, None),
    ]
    for name, module, config, method, mesh, feeds_of in cases:
        seed = module.build(config, batch=4, seq=8, mesh=mesh)
        strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method))
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        feeds = feeds_of(config, 4, 8, 3) if feeds_of is not None else random_feeds(seed.feeds, 3, classes=64)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds, "host")
        print("RESULT", name, "equal", flush=True)
    """
)


def test_context_parallelism_in_four_processes_equals_serial(tmp_path):
    results = launch(SCRIPT_4, 4, tmp_path, timeout=300)
    assert len(results) == 4 * 3, results
