"""Communication costs: alpha-beta formulas per collective (stage: plan reshards / cost report).

Every formula prices one collective over one group of ``p`` ranks on the slowest link the
group crosses (:meth:`Cluster.link_for`), with ``alpha`` = link latency per message step and
``beta`` = seconds per byte. ``nbytes`` is the nccl-tests *size* of the collective on one rank:

=================  =======================  =========================================
kind               ``nbytes`` is            ring (and tree where one exists)
=================  =======================  =========================================
all_reduce         the buffer               ring ``2(p-1)a + 2(p-1)/p n b``;
                                            tree ``2 ceil(log2 p) a + 2 n b``
all_gather         the gathered output      ``(p-1)a + (p-1)/p n b``
reduce_scatter     the full input           ``(p-1)a + (p-1)/p n b``
all_to_all         one rank's send buffer   ``(p-1)a + (p-1)/p n b`` (pairwise exchange)
broadcast          the buffer               chain ``(p-1)a + n b``;
                                            binomial tree ``ceil(log2 p)(a + n b)``
send_recv          the message              ``a + n b``
=================  =======================  =========================================

The cheaper of ring and tree is taken (NCCL's tuner does the same). A group of one rank costs
nothing. On a profile that lists a kind as *emulated* (``cpu-gloo``: gloo has neither
reduce_scatter nor all_to_all), the kind is priced as what runs instead: reduce_scatter =
all_reduce of the input + a local copy of the own chunk; all_to_all = all_gather of every
rank's send buffer (``p n`` bytes out) + a local copy of the kept part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost_model.cluster import EMULATIONS, Cluster, Link
from autopar.errors import CostModelError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def coefficients(kind: str, p: int, nbytes: float, algorithm: str = "ring") -> tuple[float, float]:
    """``(steps, bytes)`` with time = ``steps * alpha + bytes * beta`` for one algorithm."""
    if kind not in COLLECTIVES:
        raise CostModelError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    if p <= 1:
        return 0.0, 0.0
    if algorithm == "tree":
        if kind == "all_reduce":
            return 2.0 * _log2(p), 2.0 * nbytes
        if kind == "broadcast":
            return float(_log2(p)), _log2(p) * float(nbytes)
        raise CostModelError(f"no tree algorithm for {kind}")
    if kind == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(p - 1), (p - 1) / p * nbytes
    if kind == "broadcast":
        return float(p - 1), float(nbytes)
    return 1.0, float(nbytes)  # send_recv


def algorithm_time(kind: str, p: int, nbytes: float, link: Link, algorithm: str = "ring") -> float:
    steps, volume = coefficients(kind, p, nbytes, algorithm)
    return steps * link.latency + volume / link.bandwidth


def local_copy_time(nbytes: float, cluster: Cluster) -> float:
    """Read + write of ``nbytes`` in device memory (a slice, a zero-fill)."""
    return 2.0 * nbytes / cluster.device.memory_bandwidth


def collective_time(kind: str, group: Sequence[int], nbytes: float, cluster: Cluster) -> float:
    """Seconds for ``kind`` over ``group`` (rank ids) moving ``nbytes`` (see the module table)."""
    if nbytes < 0:
        raise CostModelError(f"{kind}: negative byte count {nbytes}")
    p = len(group)
    if p <= 1 or nbytes == 0:
        return 0.0
    if kind in cluster.emulated:
        run = EMULATIONS[kind]
        if kind == "reduce_scatter":
            return collective_time(run, group, nbytes, cluster) + local_copy_time(nbytes / p, cluster)
        return collective_time(run, group, nbytes * p, cluster) + local_copy_time(nbytes, cluster)
    link = cluster.link_for(group, kind)
    best = algorithm_time(kind, p, nbytes, link, "ring")
    if cluster.tree and kind in ("all_reduce", "broadcast"):
        best = min(best, algorithm_time(kind, p, nbytes, link, "tree"))
    return best


def groups_time(kind: str, groups: Sequence[Sequence[int]], nbytes: float, cluster: Cluster) -> float:
    """Concurrent collectives over disjoint groups: the slowest one."""
    return max((collective_time(kind, g, nbytes, cluster) for g in groups), default=0.0)
