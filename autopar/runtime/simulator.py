"""The simulator backend: every rank's host plan in one process, collectives in memory.

Ranks advance in lockstep: each runs its segments up to its next collective; a collective is
performed once every member of its group waits on it (same reshard step). If no waiting
collective can complete, the plans deadlock — reported with each rank's pending job.
Deterministic and fast enough for hypothesis tests over meshes of 1..8 ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.errors import AutoparError
from autopar.pieces import assemble
from autopar.runtime.collectives import perform
from autopar.runtime.rank_runner import RankRunner


@dataclass
class SimulationResult:
    fetches: list[list[np.ndarray]]  # per step, one global array per fetch
    parameters: dict[str, np.ndarray]  # name -> full array after the last step


def fetch_keys(dist: Any, fetch_list: Sequence[Any]) -> list:
    return [dist.key(item) for item in fetch_list]


def simulate(dist: Any, feeds: Sequence[Mapping[str, Any]], fetch_list: Sequence[Any] = ()) -> SimulationResult:
    """Run ``len(feeds)`` steps of ``dist`` on all ranks in this process (startup first)."""
    keys = fetch_keys(dist, fetch_list)
    runners = {rank: RankRunner(dist, rank, keys) for rank in dist.mesh.ranks}
    for runner in runners.values():
        runner.run_startup()
    fetches = []
    for feed in feeds:
        for runner in runners.values():
            runner.set_feeds(feed)
        run_step(runners)
        fetches.append([gather(dist, key, {r: runner.fetch_pieces()[i] for r, runner in runners.items()}) for i, key in enumerate(keys)])
    return SimulationResult(fetches, parameters(dist, runners))


def run_step(runners: Mapping[int, RankRunner]) -> None:
    pending = {rank: runner.run_until_collective() for rank, runner in runners.items()}
    while any(job is not None for job in pending.values()):
        waiting = {rank: runners[rank].step_key() for rank, job in pending.items() if job is not None}
        ready = None
        for rank in sorted(waiting):
            job = pending[rank]
            if all(waiting.get(member) == waiting[rank] for member in job.group):
                ready = job
                break
        if ready is None:
            stuck = "; ".join(f"rank {r}: {pending[r].kind} over {list(pending[r].group)}" for r in sorted(waiting))
            raise AutoparError(f"the rank plans deadlock: {stuck}")
        inputs = {r: runners[r].read(ready.input) for r in ready.group}
        outputs = perform(ready, inputs)
        for r in ready.group:
            runners[r].finish_collective(outputs.get(r))
            pending[r] = runners[r].run_until_collective()


def gather(dist: Any, key: Any, pieces: Mapping[int, np.ndarray]) -> np.ndarray:
    """A serial value's global array from every rank's piece (its produced placement)."""
    value = dist.graph.values[key]
    return assemble(pieces, produced_placement(dist, key), value.shape)


def produced_placement(dist: Any, key: Any) -> Any:
    """Placement of the value as its op makes it (before any after-producer reshard)."""
    produced = dist.propagation.produced.get(key)
    return produced if produced is not None else dist.propagation.dist(key)


def parameters(dist: Any, runners: Mapping[int, RankRunner]) -> dict[str, np.ndarray]:
    out = {}
    for name, key in dist.graph.by_name.items():
        if dist.graph.values[key].kind != "parameter":
            continue
        pieces = {rank: runner.parameter_piece(name) for rank, runner in runners.items()}
        out[name] = assemble(pieces, dist.propagation.dist(key), dist.graph.values[key].shape)
    if not out:
        raise AutoparError("the program has no parameters to gather")
    return out
