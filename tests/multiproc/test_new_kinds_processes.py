"""``permute`` and ``all_to_all_v`` between real processes through both host-backend
communicators (gloo: a world collective by its ``eager`` exchange, a sub-group by the world
exchange; shared memory: among the members), 2 and 4 ranks: every rank's output equals the
table's numpy meaning (tests/unit/test_permute_and_uneven_all_to_all.py checks that meaning
against numpy written without the table)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    from autopar.collective import Collective, CollectiveKey
    from autopar.collective_kinds import perform
    from autopar.dist_attr import DistAttr
    from autopar.mesh import ProcessMesh

    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])

    def job(kind, group, n, **fields):
        attr = DistAttr.replicated(ProcessMesh(list(group)), 2)
        return Collective(kind=kind, group=tuple(group), key=CollectiveKey("test", n), value="kv", src=attr, dst=attr,
                          shape=(0, 3), output_shape=(0, 3), bytes=0, time=0.0, reason="test", **fields)

    def inputs(kind, group, splits, n):
        if kind == "permute":
            return {r: np.full((2, 3), 10.0 * n + r, np.float32) for r in group}
        return {g: np.arange(sum(splits[i]) * 3, dtype=np.float32).reshape(-1, 3) + 100 * g for i, g in enumerate(group)}

    p = world
    steps = [("permute", tuple(range(p)), 1, ()), ("permute", tuple(range(p)), -1, ()),
             ("all_to_all_v", tuple(range(p)), 0, tuple(tuple((i + j) % 3 for j in range(p)) for i in range(p)))]
    if p == 4:
        mine = (0, 1) if rank < 2 else (2, 3)
        steps += [("permute", mine, 1, ()), ("all_to_all_v", mine, 0, ((2, 0), (1, 3)))]

    for comm_name in sys.argv[1:]:  # both communicators in one launch (a launch costs ~1.5 s a process)
        os.environ["AUTOPAR_HOST_COMM"] = comm_name
        if comm_name == "gloo":
            from autopar.runtime.gloo import GlooCommunicator
            comm = GlooCommunicator(rank, world)
        else:
            from autopar.runtime.shm import SharedMemoryCommunicator
            comm = SharedMemoryCommunicator(rank, world)
        bad = []
        for n, (kind, group, shift, splits) in enumerate(steps):
            collective = job(kind, group, n, shift=shift, splits=splits)
            given = inputs(kind, group, splits, n)
            got = comm.run(collective, given[rank])
            want = perform(collective, given)[rank]
            if got is None or got.shape != want.shape or not np.array_equal(got, want):
                bad.append(f"{kind}{list(group)} step {n}: {None if got is None else got.tolist()} != {want.tolist()}")
        print("RESULT", comm_name, rank, len(steps), "ok" if not bad else "; ".join(bad), flush=True)
    """
)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_reference_output(tmp_path, world):
    communicators = ["gloo", "shm"]
    lines = [line.split("RESULT ", 1)[1] for line in launch(SCRIPT, world, tmp_path, communicators, timeout=300)]
    for communicator in communicators:
        mine = [line for line in lines if line.split()[0] == communicator]
        assert sorted(int(line.split()[1]) for line in mine) == list(range(world)), lines
    steps = 5 if world == 4 else 3
    assert all(line.split(maxsplit=3)[2:] == [str(steps), "ok"] for line in lines), lines
