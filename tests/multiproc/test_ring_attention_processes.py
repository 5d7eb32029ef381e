"""Ring attention between 2 real processes (host backend: the permutes of K / V blocks and their
gradients go through the host communicator): the zoo's Llama and GPT-2 (dropout 0.1), tokens split
by sequence over ``sep``, in one launch; losses and parameters after 3 steps equal serial."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import os
    import warnings
    warnings.filterwarnings("ignore")
    import paddle
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    from autopar.testing.zoo import gpt2, llama
    from autopar.testing.zoo.placements import annotate

    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    ring = autopar.Strategy(context_parallel=autopar.ContextParallel(dim="sep", method="ring"))
    gpt2_config = gpt2.Config(n_layer=2, dropout=0.1)
    for name, seed, feeds in (
        ("llama", llama.build(llama.Config(n_layers=2), batch=4, seq=8, mesh=None), None),
        ("gpt2", gpt2.build(gpt2_config, batch=4, seq=8, mesh=None), gpt2.feeds(gpt2_config, 4, 8, 3)),
    ):
        with paddle.static.program_guard(seed.main, seed.startup):
            for value in seed.feeds.values():
                annotate(value, mesh, sep=1)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=ring)
        assert [c.kind for c in dist.comm_ops(0)].count("permute") == 3 * 2
        feeds = feeds if feeds is not None else random_feeds(seed.feeds, 3, classes=64)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds)
        print("RESULT", name, os.environ["PADDLE_TRAINER_ID"], flush=True)
    """
)


def test_llama_and_gpt2_ring_attention_between_two_processes_equal_serial(tmp_path):
    lines = launch(SCRIPT, 2, tmp_path)
    assert sorted(line.split("RESULT ")[1] for line in lines) == ["gpt2 0", "gpt2 1", "llama 0", "llama 1"]
