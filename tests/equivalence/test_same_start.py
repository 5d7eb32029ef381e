"""Same start on every rank, whatever the seeding: replicated parameters are bit-identical
across ranks and equal to a serial start-up run from the same generator state — with no
``program.random_seed`` (most users only call ``paddle.seed``, or nothing)."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.runtime.replicas import digest, first_mismatch
from autopar.testing.models import gpt_block_program, simple_net
from autopar.testing.serial import random_feeds, run_serial


@pytest.mark.parametrize("user_seed", [None, 1234], ids=["no-seed", "paddle.seed"])
def test_unseeded_program_trains_equal_to_serial(user_seed):
    if user_seed is not None:
        paddle.seed(user_seed)
    # seed=0: no program.random_seed (initializers draw from the generator); SGD, because Adam
    # turns the round-off noise of gradients that are zero in exact arithmetic (the key bias)
    # into full-size updates, which would compare noise with noise
    seed = gpt_block_program(batch=4, seq=8, hidden=32, heads=4, vocab=64, optimizer="sgd", seed=0)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    feeds = random_feeds(seed.feeds, 3, classes=64)
    state = paddle.get_rng_state()
    result = autopar.simulate(dist, feeds, [seed.loss])
    paddle.set_rng_state(state)  # the serial run starts from the generator state the ranks started from
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    for want, got in zip(serial.fetches, result.fetches):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_replicated_copies_are_bit_identical_and_a_mismatch_is_named():
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10), seed=0)
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    from autopar.runtime.rank_runner import RankRunner
    from autopar.runtime.replicas import generator_state, use_generator_state

    start = generator_state()
    runners = {}
    for rank in mesh.ranks:
        runners[rank] = RankRunner(dist.rank_plan(rank), [])
        use_generator_state(start)
        runners[rank].run_startup()
    values = dist.values
    names = [*values.named("parameter"), *values.named("state")]
    digests = {r: {n: digest(run.read(n)) for n in names} for r, run in runners.items()}
    assert first_mismatch(values, digests) is None
    w1 = seed.layers["linear1"].weight.name
    assert digests[0][w1] != digests[1][w1] and digests[0][w1] == digests[2][w1]  # mp pieces differ, dp copies agree
    runners[2].write(w1, runners[2].read(w1) + 1)  # a replica drifts
    digests[2] = {n: digest(runners[2].read(n)) for n in names}
    message = first_mismatch(values, digests)
    assert message is not None and message.startswith(w1) and "rank 0 vs ranks [2]" in message


def test_simulate_refuses_diverged_replicas(monkeypatch):
    """Without the agreed start (each rank draws on), simulate says so instead of keeping rank 0's copy."""
    seed = simple_net(batch=8, sizes=(16, 32, 16, 10), seed=0)
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    monkeypatch.setattr("autopar.runtime.simulator.use_generator_state", lambda state: None)
    with pytest.raises(AutoparError, match="simulate: .* differs across the ranks that replicate it"):
        autopar.simulate(dist, random_feeds(seed.feeds, 1), [seed.loss])
