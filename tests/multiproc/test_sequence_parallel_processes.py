"""Sequence parallelism in real processes: a two-block Megatron GPT with
``Strategy(sequence_parallel=True)`` equals serial after 3 steps (rtol 1e-5) on mp=2 (two
processes, both backends, also with dropout and recompute of softmax + dropout) and on dp=2 x mp=2 (four processes, host backend: gloo has no
sub-group rings in the program), and its activations really move as reduce_scatters and
all_gathers."""

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
    from autopar.testing.models import annotate_megatron, gpt_block_program
    from autopar.testing.processes import train_equals_serial
    from autopar.testing.serial import random_feeds

    four = sys.argv[1:] == ["dp2xmp2"]
    runs = [("host", False)] if four else [("host", False), ("native", False), ("host", True), ("native", True)]
    for backend, recompute in runs:
        dropout = 0.1 if recompute else 0.0
        seed = gpt_block_program(batch=4, seq=6, hidden=16, heads=2, vocab=32, layers=2, optimizer="momentum", dropout=dropout)
        mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]) if four else autopar.ProcessMesh([0, 1], ["mp"])
        annotate_megatron(seed, mesh)
        if four:
            autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(sequence_parallel=True, recompute=("softmax", "dropout") if recompute else False))
        kinds = {c.kind for c in dist.comm_ops(0)}
        assert {"reduce_scatter", "all_gather"} <= kinds, kinds
        train_equals_serial(dist, seed.main, seed.startup, seed.loss, random_feeds(seed.feeds, 3, classes=32), backend)
        print("RESULT", backend, "recompute" if recompute else "", "equal", flush=True)
    """
)


@pytest.mark.parametrize("mesh, nproc, runs", [("mp2", 2, 4), ("dp2xmp2", 4, 1)])
def test_sequence_parallel_in_processes_equals_serial(tmp_path, mesh, nproc, runs):
    results = launch(SCRIPT, nproc, tmp_path, [mesh], timeout=300)
    assert len(results) == nproc * runs, results
