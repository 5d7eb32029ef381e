"""Selective recompute in two real processes: the 2-layer GPT block (dropout in attention and
after the MLP) under tensor parallelism (mp=2), attention's softmax + dropout recomputed on the
host backend and whole layers on the native one, equal to serial after 3 steps (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.models import annotate_megatron, gpt_block_program
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    for selection, backend in ((("softmax", "dropout"), "host"), (("TransformerLayer*",), "native")):
        seed = gpt_block_program(batch=4, seq=4, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum",
                                 dropout=0.1, layer_calls=True)
        mesh = autopar.ProcessMesh([0, 1], ["mp"])
        annotate_megatron(seed, mesh)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup,
                               strategy=autopar.Strategy(recompute=selection))
        assert dist.state.recompute.dropped
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=32), backend)
        print("RESULT", selection, backend, "equal", flush=True)
    """
)


def test_recompute_under_tensor_parallel_in_two_processes_equals_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path, timeout=300)
    assert len(results) == 2 * 2, results
