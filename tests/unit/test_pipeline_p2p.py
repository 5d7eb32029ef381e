"""The host backend's pipeline messages (autopar/runtime/p2p.py) are taken in link order: a
recv takes the next message on its link and checks it is its own transfer (a check, not a
search). A residual block cut inside (as ``PipelineConfig(stages=2)`` cut two blocks + a head)
under 1F1B with 2 micro-batches crosses the stage boundary several times per phase: lowered
alone, rank 1 would wait for micro-batch 0's backward reply while rank 0 sent micro-batch 1's
activation first (a FIFO link handed it the wrong tensor, silently, before the check). The
compiler builds each rank plan with its recvs in link order. Real socket links between two
ranks in one process replay each rank's collectives of that program. A stage's group exchange
over the same links is matched by key (every member sends before it receives)."""

import dataclasses
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import autopar
from autopar.collective import CollectiveKey, CollectiveKind
from autopar.errors import AutoparError
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


def _key(micro_batch: int) -> CollectiveKey:
    return CollectiveKey("reshard", 3, 0, micro_batch)


def _compiled(schedule: str = "1F1B", micro_batches: int = 2):
    """The residual program cut inside a block (autopar.testing.pipeline_models), compiled, and
    two steps of feeds."""
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = residual_cut_inside(mesh)
    config = autopar.PipelineConfig(micro_batches=micro_batches, schedule=schedule)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))
    return seed, dist, random_feeds(seed.feeds, 2, seed=5, classes=5)


def _recv(key, sender=0, receiver=1):
    """What a recv reads of its collective: its link, key and value label."""
    return SimpleNamespace(kind=CollectiveKind.RECV, group=(sender, receiver), key=key, value="%x")


def test_a_pipeline_recv_takes_the_next_message_on_its_link(links):
    links[0].send(1, np.array([1.0]), _key(0), ordered=True)
    links[0].send(1, np.array([2.0]), _key(1), ordered=True)
    links[0].send(1, np.array([3.0]), _key(0), ordered=True)  # the same key again (the next step's)
    assert links[1].recv_next(_recv(_key(0)), timeout=10)[0] == 1.0
    assert links[1].recv_next(_recv(_key(1)), timeout=10)[0] == 2.0
    assert links[1].recv_next(_recv(_key(0)), timeout=10)[0] == 3.0
    with pytest.raises(TimeoutError, match=r"no message on the link from rank 0"):
        links[1].recv_next(_recv(_key(0)), timeout=0.2)


def test_a_message_of_another_key_is_refused_by_name(links):
    """Not searched for: the next message on the link is checked, and both keys, the link and
    the RECV are named."""
    links[0].send(1, np.array([2.0]), _key(1), ordered=True)
    links[0].send(1, np.array([1.0]), _key(0), ordered=True)
    with pytest.raises(
        AutoparError,
        match=r"rank 1: RECV\[%x mb0 0->1\] waits for the message of key reshard3.0.mb0, but the next message on "
        r"link rank 0 -> rank 1 has key reshard3.0.mb1",
    ):
        links[1].recv_next(_recv(_key(0)), timeout=10)


def test_a_group_exchange_takes_the_message_of_its_key(links):
    links[0].send(1, np.array([1.0]), ("a", 0))
    links[0].send(1, np.array([2.0]), ("b", 0))
    links[0].send(1, np.array([3.0]), ("a", 0))  # the same key again (the next step's)
    assert links[1].recv(0, ("b", 0), timeout=10)[0] == 2.0
    assert links[1].recv(0, ("a", 0), timeout=10)[0] == 1.0
    assert links[1].recv(0, ("a", 0), timeout=10)[0] == 3.0
    with pytest.raises(TimeoutError, match=r"no message \('a', 0\) from rank 0"):
        links[1].recv(0, ("a", 0), timeout=0.2)


def test_an_inbox_keeps_one_link_per_sender_and_one_queue_per_key_for_exchanges():
    inbox = Inbox()
    inbox.put(0, "k", "first")
    inbox.put(2, "k", "other sender")
    inbox.put(0, "k", "second")
    inbox.put(0, "b", "on the link", ordered=True)
    inbox.put(0, "a", "next on the link", ordered=True)
    assert not inbox.ready(1, "k") and inbox.ready(2, "k") and not inbox.ready(0, "b")
    assert [inbox.take(0, "k", 0), inbox.take(0, "k", 0), inbox.take(2, "k", 0)] == ["first", "second", "other sender"]
    assert not inbox.messages  # emptied keys are dropped
    assert inbox.arrived(0) and not inbox.arrived(2)
    assert [inbox.next(0, 0), inbox.next(0, 0)] == [("b", "on the link"), ("a", "next on the link")]
    assert not inbox.arrived(0)


def _replay(rank: int, collectives, links, errors: list) -> None:
    """Walk the rank's point-to-point collectives of one step in order: each send carries its
    key as its payload; each recv takes the next message on its link (checked) and checks it
    got the payload of its own key."""
    try:
        for job in collectives:
            if job.kind is CollectiveKind.SEND:
                links[rank].send(job.group[1], np.array(str(job.key)), job.key, ordered=True)
            elif job.kind is CollectiveKind.RECV:
                got = str(links[rank].recv_next(job, timeout=30))
                if got != str(job.key):
                    errors.append(f"rank {rank}: recv {job.key} got the message of {got}")
    except Exception as error:  # noqa: BLE001  reported by the test
        errors.append(f"rank {rank}: {error!r}")


def test_a_residual_block_cut_inside_gets_each_message_under_1f1b(links):
    _, dist, _ = _compiled()
    order = {rank: PipelineRunner(dist.rank_plan(rank), []).collectives() for rank in (0, 1)}
    sent = [str(job.key) for job in order[0] if job.kind is CollectiveKind.SEND]
    received = [str(job.key) for job in order[1] if job.kind is CollectiveKind.RECV]
    assert sent == received  # the compiler's link order
    lowered = dataclasses.replace(dist.rank_plan(1), pipeline=dataclasses.replace(dist.rank_plan(1).pipeline, steps=()))
    alone = [str(job.key) for job in PipelineRunner(lowered, []).collectives() if job.kind is CollectiveKind.RECV]
    assert sorted(alone) == sorted(sent) and alone != sent  # the case a FIFO link would get wrong
    for step in range(2):  # the same keys again in the next step
        errors: list[str] = []
        threads = [threading.Thread(target=_replay, args=(rank, order[rank], links, errors)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, (step, errors)
    assert not any(links[rank].inbox.links.get(0) or links[rank].inbox.links.get(1) for rank in (0, 1))


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
