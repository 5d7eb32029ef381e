"""``ContextParallel(balance="zigzag")`` in real processes (one launch, 2 processes): the
Executor returns fetched logits in serial order — GPT-2 with attention dropout under the ring
on the host backend, Llama under Ulysses on the native backend — and the losses, logits and
parameters after 3 SGD steps equal serial (rtol 1e-5)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import autopar
    from autopar.testing.serial import random_feeds, run_serial
    from autopar.testing.zoo import gpt2, llama

    def logits_of(main):
        for op in main.global_block().ops:
            if op.name() == "pd_op.cross_entropy_with_softmax":
                return op.operand_source(0).get_defining_op().operand_source(0)

    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    cases = [
        ("gpt2 dropout ring", gpt2, gpt2.Config(dropout=0.1), "ring", "host", gpt2.feeds),
        ("llama all_to_all", llama, llama.Config(), "all_to_all", "native", None),
    ]
    for name, module, config, method, backend, feeds_of in cases:
        seed = module.build(config, batch=4, seq=8, mesh=mesh)
        logits = logits_of(seed.main)
        strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method, "zigzag"))
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
        assert dist.values.info(dist.key(logits)).order is not None  # held in zig-zag order
        feeds = feeds_of(config, 4, 8, 3) if feeds_of is not None else random_feeds(seed.feeds, 3, classes=64)
        serial = run_serial(seed.main, seed.startup, feeds, [seed.loss, logits])
        exe = autopar.Executor(dist, backend=backend)
        exe.run_startup()
        got = [exe.run(feed, fetch_list=[seed.loss, logits]) for feed in feeds]
        for step, (want, have) in enumerate(zip(serial.fetches, got)):
            np.testing.assert_allclose(have[0], want[0], rtol=1e-5, err_msg=f"{name}: loss at step {step}")
            np.testing.assert_allclose(have[1], want[1], rtol=1e-5, atol=1e-5, err_msg=f"{name}: logits at step {step}")
        params = exe.parameters()
        for pname, want in serial.parameters.items():
            np.testing.assert_allclose(params[pname], want, rtol=1e-5, atol=1e-6, err_msg=pname)
        print("RESULT", name, backend, "equal", flush=True)
    """
)


def test_zigzag_fetches_in_processes_equal_serial(tmp_path):
    results = launch(SCRIPT, 2, tmp_path, timeout=300)
    assert len(results) == 2 * 2, results
