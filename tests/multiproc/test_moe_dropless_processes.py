"""Dropless routing in 2 real processes (host backend, GPU profile's plan), losses and
parameters after 3 SGD steps equal serial: the stacked experts on ep2 (2 router groups) with
the padded and the uneven all_to_alls, the local experts on ep2 uneven, and the ported
Qwen2-MoE with the worst-case capacity (``capacity_factor = num_experts``) uneven. Each rank prints the
bytes its all_to_alls put on the wire (:mod:`autopar.runtime.wire`, counted on the arrays the
communicator exchanges): the uneven ones send fewer than the padded ones. One launch."""

import re
import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.runtime.wire import counting
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.zoo import moe, qwen2_moe

    mesh = autopar.ProcessMesh([0, 1], ["ep"])
    CASES = [
        ("stacked padded", moe, {"experts": "stacked"}, moe.Config(n_layers=1, dropless=True, router_groups=2), False),
        ("stacked uneven", moe, {"experts": "stacked"}, moe.Config(n_layers=1, dropless=True, router_groups=2), True),
        ("local uneven", moe, {"experts": "local"}, moe.Config(n_layers=1, dropless=True), True),
        ("qwen2 uneven", qwen2_moe, {}, qwen2_moe.Config(num_hidden_layers=1, capacity_factor=4.0), True),
    ]
    for name, model, keywords, config, uneven in CASES:
        seed = model.build(config, batch=4, seq=8, mesh=mesh, **keywords)
        strategy = autopar.Strategy(cluster="h100-node", uneven_all_to_all=uneven)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        with counting() as log:
            train_equals_serial(dist, seed.main, seed.startup, seed.loss, model.feeds(config, 4, 8, 3))
        sent = log.sent(kind="all_to_all_v" if uneven else "all_to_all")
        print("RESULT", name, "equal", "sent", sent, "messages", log.count(), flush=True)
    """
)


def test_dropless_routing_in_real_processes_equals_serial_and_the_uneven_all_to_all_sends_less(tmp_path):
    results = launch(SCRIPT, 2, tmp_path)
    assert len(results) == 8, results
    sent = {}
    for line in results:
        name, nbytes = re.match(r"(\w+ \w+) equal sent (\d+) messages", line.split("RESULT ")[-1]).groups()
        sent.setdefault(name, []).append(int(nbytes))
    assert set(sent) == {"stacked padded", "stacked uneven", "local uneven", "qwen2 uneven"}
    assert all(len(v) == 2 for v in sent.values())  # one line per rank
    assert 0 < max(sent["stacked uneven"]) < min(sent["stacked padded"])
    assert 0 < max(sent["local uneven"]) < min(sent["stacked padded"])
    assert 0 < max(sent["qwen2 uneven"]) < min(sent["stacked padded"])  # (its padded buffers are the zoo's size)
