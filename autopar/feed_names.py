"""Names of the feeds compile adds to a program and the runtime fills (stage: shared by the
serial rewrites that make these feeds and the runtime that feeds them; a leaf module, so the
runtime names them without importing the rewrites above it).

- :data:`MICRO_BATCH_FEED`: the number of the micro-batch a pipelined program runs (int64,
  shape [1]); the pipeline runner feeds it per micro-batch, a training dropout picks that
  micro-batch's rows of its mask (:mod:`autopar.rewrites.micro_batching`).
- :data:`WHOLE_BATCH`: the suffix of a whole-batch copy of a feed, ``<feed>@whole_batch``, that
  a micro-batch reads whole (:mod:`autopar.rewrites.whole_feeds`); the runner gives it the
  step's whole array, the index-feed check reads it under its feed's name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MICRO_BATCH_FEED = "autopar.micro_batch"
WHOLE_BATCH = "@whole_batch"


def with_whole_batch_copies(feed: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``feed`` (the user's: feed name -> the step's whole array) with each whole-batch copy among
    ``names`` (a program's feeds, ``<feed>@whole_batch``) given its feed's array, as the pipeline
    runner gives it in every micro-batch. A copy is never the user's to give: one in ``feed`` is
    replaced by its feed's array."""
    out = dict(feed)
    for name in names:
        base = name.removesuffix(WHOLE_BATCH)
        if base != name and base in feed:
            out[name] = feed[base]
    return out
