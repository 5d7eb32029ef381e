"""Collective semantics on numpy arrays: the one reference every backend must match.

``perform(collective, inputs_by_rank)`` computes every group member's output of one
:class:`~autopar.collective.Collective` in memory. The simulator runs collectives with it; the process-group
backend's results are tested against it. Pieces follow the group order (``group[i]`` holds
piece ``i``); uneven pieces are allowed where the op concatenates.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autopar.collective import Collective, CollectiveKind
from autopar.dist_attr import shard_bounds
from autopar.errors import AutoparError
from autopar.pieces import REDUCERS


def _reduce(arrays: list[np.ndarray], kind: str) -> np.ndarray:
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise AutoparError(f"reduction over pieces of different shapes {sorted(shapes)}")
    return REDUCERS[kind](np.stack(arrays), axis=0).astype(arrays[0].dtype)


def own_piece(x: np.ndarray, axis: int, parts: int, index: int) -> np.ndarray:
    """Piece ``index`` of ``parts`` along ``axis`` (the bounds every pass and backend use)."""
    lo, hi = shard_bounds(x.shape[axis], parts, index)
    return np.take(x, np.arange(lo, hi), axis=axis)


def perform(job: Collective, inputs: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Every member's output of ``job`` given every member's input."""
    group = list(job.group)
    missing = [r for r in group if r not in inputs]
    if missing:
        raise AutoparError(f"{job.kind} over {group}: no input from ranks {missing}")
    pieces = [np.asarray(inputs[r]) for r in group]
    kind = job.kind
    if kind is CollectiveKind.ALL_REDUCE:
        out = _reduce(pieces, job.reduce)
        return {r: out for r in group}
    if kind is CollectiveKind.ALL_GATHER:
        out = np.concatenate(pieces, axis=job.axis)
        return {r: out for r in group}
    if kind is CollectiveKind.REDUCE_SCATTER:
        total = _reduce(pieces, job.reduce)
        return {r: own_piece(total, job.axis, len(group), i) for i, r in enumerate(group)}
    if kind is CollectiveKind.BROADCAST:
        root = pieces[job.root]
        return {r: root for r in group}
    if kind is CollectiveKind.ALL_TO_ALL:
        parts = len(group)
        return {
            r: np.concatenate([own_piece(p, job.split_axis, parts, i) for p in pieces], axis=job.axis)
            for i, r in enumerate(group)
        }
    if kind in (CollectiveKind.SEND, CollectiveKind.RECV):
        sender, receiver = group
        return {receiver: pieces[0]}
    raise AutoparError(f"the runtime cannot perform {kind}")
