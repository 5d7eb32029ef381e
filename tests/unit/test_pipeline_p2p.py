"""The host backend's pipeline messages (autopar/runtime/p2p.py) are matched to their recv by
key, not by their place on the link: a residual block cut inside (as ``PipelineConfig(stages=2)``
cut two blocks + a head) under 1F1B with 2 micro-batches sends in an order its peer does not receive in (a FIFO link
handed rank 1 micro-batch 1's activation where it waited for micro-batch 0's backward reply:
host losses differed from serial while the simulator, which matched by key, agreed). Real
socket links between two ranks in one process replay each rank's collectives of that program."""

import threading

import numpy as np
import pytest

import autopar
from autopar.collective import CollectiveKind
from autopar.runtime.p2p import Inbox, Links
from autopar.runtime.pipeline_runner import PipelineRunner
from autopar.testing.pipeline_models import residual_cut_inside
from autopar.testing.serial import random_feeds, run_serial

pytestmark = pytest.mark.filterwarnings("ignore")


class _Store:
    """The TCP store's set / get, in memory (the links only exchange addresses through it)."""

    def __init__(self) -> None:
        self.items: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.items[key] = value

    def get(self, key: str) -> bytes:
        return self.items[key]


@pytest.fixture
def links():
    store = _Store()
    return {rank: Links(rank, store) for rank in (0, 1)}


def _compiled(schedule: str = "1F1B", micro_batches: int = 2):
    """The residual program cut inside a block (autopar.testing.pipeline_models), compiled, and
    two steps of feeds."""
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = residual_cut_inside(mesh)
    config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
    return seed, dist, random_feeds(seed.feeds, 2, seed=5, classes=5)


def test_a_recv_takes_the_message_of_its_key_not_the_next_on_the_link(links):
    links[0].send(1, np.array([1.0]), ("a", 0))
    links[0].send(1, np.array([2.0]), ("b", 0))
    links[0].send(1, np.array([3.0]), ("a", 0))  # the same key again (the next step's)
    assert links[1].recv(0, ("b", 0), timeout=10)[0] == 2.0
    assert links[1].recv(0, ("a", 0), timeout=10)[0] == 1.0
    assert links[1].recv(0, ("a", 0), timeout=10)[0] == 3.0
    with pytest.raises(TimeoutError, match=r"no message \('a', 0\) from rank 0"):
        links[1].recv(0, ("a", 0), timeout=0.2)


def test_an_inbox_keeps_one_queue_per_sender_and_key():
    inbox = Inbox()
    inbox.put(0, "k", "first")
    inbox.put(2, "k", "other sender")
    inbox.put(0, "k", "second")
    assert not inbox.ready(1, "k") and inbox.ready(2, "k")
    assert [inbox.take(0, "k", 0), inbox.take(0, "k", 0), inbox.take(2, "k", 0)] == ["first", "second", "other sender"]
    assert not inbox.messages  # emptied keys are dropped


def _replay(rank: int, collectives, links, errors: list) -> None:
    """Walk the rank's point-to-point collectives of one step: each send carries its key as
    its payload; each recv checks it got the payload of its own key."""
    try:
        for job in collectives:
            sender, receiver = job.group
            if job.kind is CollectiveKind.SEND:
                links[rank].send(receiver, np.array(str(job.key)), job.key)
            elif job.kind is CollectiveKind.RECV:
                got = str(links[rank].recv(sender, job.key, timeout=30))
                if got != str(job.key):
                    errors.append(f"rank {rank}: recv {job.key} got the message of {got}")
    except Exception as error:  # noqa: BLE001  reported by the test
        errors.append(f"rank {rank}: {error!r}")


def test_a_residual_block_cut_inside_gets_each_message_under_1f1b(links):
    _, dist, _ = _compiled()
    order = {rank: PipelineRunner(dist.rank_plan(rank), []).collectives() for rank in (0, 1)}
    sent = [str(job.key) for job in order[0] if job.kind is CollectiveKind.SEND]
    received = [str(job.key) for job in order[1] if job.kind is CollectiveKind.RECV]
    assert sorted(sent) == sorted(received) and sent != received  # the case a FIFO link gets wrong
    for step in range(2):  # the same keys again in the next step
        errors: list[str] = []
        threads = [threading.Thread(target=_replay, args=(rank, order[rank], links, errors)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, (step, errors)
    assert not any(links[rank].inbox.messages for rank in (0, 1))


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
def test_a_residual_block_cut_inside_simulates_as_serial(schedule):
    import paddle

    seed, dist, feeds = _compiled(schedule)
    paddle.seed(11)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    paddle.seed(11)
    result = autopar.simulate(dist, feeds, [seed.loss])
    for step, ((want,), (got,)) in enumerate(zip(serial.fetches, result.fetches)):
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"loss at step {step}")
    for name, want in serial.parameters.items():
        np.testing.assert_allclose(result.parameters[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
