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

MICRO_BATCH_FEED = "autopar.micro_batch"
WHOLE_BATCH = "@whole_batch"
