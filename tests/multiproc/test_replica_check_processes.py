"""The Executor's periodic copy check (issue 35, item 0) in two real processes: a replica that
silently stops being updated on one rank (an injected fault: rank 1 trains at a learning rate
of 0) is refused by name after the first step, with or without fetches (the checksums ride in
the step's exchange, or in an exchange of their own); ``check_every=None`` lets it train on
unnoticed, which is what the check is for. A correct plan passes the check every step."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import re
    import warnings
    warnings.filterwarnings("ignore")
    import autopar
    from autopar.errors import AutoparError
    from autopar.testing.faults import FaultyProgram, not_updated_on
    from autopar.testing.models import simple_net
    from autopar.testing.serial import random_feeds

    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    seed = simple_net(batch=4, sizes=(8, 16, 4))
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    feeds = random_feeds(seed.feeds, 3, classes=4)
    for fetch in ([], [seed.loss]):
        exe = autopar.Executor(dist, backend="host", check_every=1)
        exe.run_startup()
        for feed in feeds:
            exe.run(feed, fetch_list=fetch)
        print("RESULT correct plan passes", len(fetch), flush=True)
        exe = autopar.Executor(FaultyProgram(dist, not_updated_on(1)), backend="host")
        exe.run_startup()
        try:
            exe.run(feeds[0], fetch_list=fetch)
        except AutoparError as error:
            assert re.search(r"step 1: (learning_rate_0|linear_\\d+\\.[wb]_0) .*differs across the ranks", str(error)), error
            print("RESULT caught", len(fetch), flush=True)
        exe = autopar.Executor(FaultyProgram(dist, not_updated_on(1)), backend="host", check_every=None)
        exe.run_startup()
        for feed in feeds:
            exe.run(feed, fetch_list=fetch)
        print("RESULT unchecked trains on", len(fetch), flush=True)
    """
)


def test_a_diverged_replica_is_caught_by_name_after_the_first_step(tmp_path):
    results = launch(SCRIPT, 2, tmp_path)
    assert sorted(set(line.split("RESULT ")[1] for line in results)) == [
        "caught 0", "caught 1", "correct plan passes 0", "correct plan passes 1", "unchecked trains on 0", "unchecked trains on 1",
    ]  # fmt: skip
    assert len(results) == 12, results
