"""The zoo in real processes (host backend, and native where the plan allows): a subset of
``tests/equivalence/test_zoo.py`` — Llama 1F1B with 2 micro-batches and GPT-2 (loss over the
valid tokens) interleaved on 2 processes; BERT dp x mp and ViT pp x dp on 4 — losses and
parameters after 3 steps equal serial (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds
    from autopar.testing.zoo import bert, gpt2, llama, vit

    M = autopar.ProcessMesh
    def pipeline(m, **config):
        return autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=m, **config))

    world = int(sys.argv[1])
    cases = {
        2: [
            ("llama 1F1B m=2", llama, llama.Config(n_layers=2), M([0, 1], ["pp"]), pipeline(2), 1, None, 64),
            ("gpt2 interleaved", gpt2, gpt2.Config(n_layer=4), M([0, 1], ["pp"]), pipeline(2, schedule="Interleaved1F1B"), 2, gpt2.feeds, 64),
        ],
        4: [
            ("bert dp x mp", bert, bert.Config(), M([[0, 1], [2, 3]], ["dp", "mp"]), None, 1, bert.feeds, 2),
            ("vit pp x dp", vit, vit.Config(), M([[0, 1], [2, 3]], ["pp", "dp"]), pipeline(2), 1, None, 5),
        ],
    }[world]
    for name, module, config, mesh, strategy, virtual, feeds_of, classes in cases:
        seed = module.build(config, batch=4, seq=8, mesh=mesh, virtual=virtual)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        feeds = feeds_of(config, 4, 8, 3) if feeds_of is not None else random_feeds(seed.feeds, 3, classes=classes)
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, feeds)
        print("RESULT", name, "equal", flush=True)
    """
)


@pytest.mark.parametrize("world", [2, 4])
def test_zoo_in_processes_equals_serial(tmp_path, world):
    results = launch(SCRIPT, world, tmp_path, args=[str(world)])
    assert len(results) == 2 * world, results
