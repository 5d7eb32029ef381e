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
all_to_all_v       the busiest rank's       ``(p-1)a + n b`` (pairwise exchange; uneven pieces:
                   bytes in or out          ``AllToAllV.traffic(splits, row bytes)``)
permute            one rank's input         ``a + n b`` (every rank sends and receives at once)
broadcast          the buffer               chain ``(p-1)a + n b``;
                                            binomial tree ``ceil(log2 p)(a + n b)``
send_recv          the message              ``a + n b``
=================  =======================  =========================================

The cheaper of ring and tree is taken (NCCL's tuner does the same). A group of one rank costs
nothing. On a profile whose device has a ``segment_seconds`` (the CPU runtime's host backend
ends a program segment at each collective) every collective also pays it. A fitted link may carry a knee (:class:`Link`): a buffer of at least ``knee`` bytes
also pays ``nbytes / knee_bandwidth`` (fresh memory faulting in, on ``cpu-gloo``).

What runs on the profile is what is priced:

- *emulated* kinds (``cpu-gloo``: gloo has neither reduce_scatter nor all_to_all; the native
  backend's lowering runs them as below) cost their lowered form: reduce_scatter = all_reduce
  of the input + a local copy of the own chunk; all_to_all = all_gather of every rank's whole
  send buffer (``p n`` bytes gathered, ``(p-1) n`` received per rank) + a local copy of the
  kept part (``n``).
- on a ``subgroups: "world_exchange"`` profile (``cpu-gloo``: the host backend) a group that
  is not the whole world, when the world is known (``world_size``, or the union of the groups
  given to :func:`groups_time`), costs a world exchange (:func:`exchange_time`): every rank's
  input gathered by every rank (``world x`` the input bytes, pickled), then the group's result
  computed locally. The whole world's all_reduce / all_gather / broadcast stay native; a kind
  gloo lacks that the host backend exchanges even over the world (``exchanged``: permute,
  all_to_all_v) costs the exchange there too.
  (The host backend also exchanges a *world* reduce_scatter / all_to_all; the native backend,
  which the executor picks when every collective spans the world, runs the lowered form
  priced here.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.collective_kinds import kind_of, priced_kinds
from autopar.cost_model.cluster import Cluster, Link
from autopar.errors import CostModelError

COLLECTIVES = priced_kinds()  # all_reduce, all_gather, reduce_scatter, all_to_all, permute, all_to_all_v, broadcast, send_recv


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def coefficients(kind: str, p: int, nbytes: float, algorithm: str = "ring") -> tuple[float, float]:
    """``(steps, bytes)`` with time = ``steps * alpha + bytes * beta`` for one algorithm (each
    kind's formula: :mod:`autopar.collective_kinds`)."""
    if kind not in COLLECTIVES:
        raise CostModelError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    if p <= 1:
        return 0.0, 0.0
    entry = kind_of(kind)
    if algorithm == "tree" and not entry.tree:
        raise CostModelError(f"no tree algorithm for {kind}")
    return entry.coefficients(p, nbytes, algorithm)


def algorithm_time(kind: str, p: int, nbytes: float, link: Link, algorithm: str = "ring") -> float:
    steps, volume = coefficients(kind, p, nbytes, algorithm)
    return link.seconds(steps, volume, nbytes)


def local_copy_time(nbytes: float, cluster: Cluster) -> float:
    """Read + write of ``nbytes`` in device memory (a slice, a zero-fill)."""
    return 2.0 * nbytes / cluster.device.memory_bandwidth


def collective_time(
    kind: str, group: Sequence[int], nbytes: float, cluster: Cluster, world_size: int | None = None
) -> float:
    """Seconds for ``kind`` over ``group`` (rank ids) moving ``nbytes`` (see the module table).

    ``world_size``: the number of processes of the run (ranks ``0 .. world_size - 1``). Given,
    a group that is not the whole world is priced as the profile's ``subgroups`` says (on
    ``world_exchange``: :func:`exchange_time`); not given, every group is priced as native.
    """
    world = None if world_size is None else frozenset(range(world_size))
    return _with_segment(_time(str(kind), tuple(group), nbytes, cluster, world), cluster)


def _with_segment(seconds: float, cluster: Cluster) -> float:
    """A collective that moves anything also ends a program segment on a host backend
    (``device.segment_seconds``: 0 where collectives run inside the program)."""
    return seconds + cluster.device.segment_seconds if seconds > 0 else 0.0


def _time(kind: str, group: tuple[int, ...], nbytes: float, cluster: Cluster, world: frozenset[int] | None) -> float:
    if kind not in COLLECTIVES:
        raise CostModelError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    if nbytes < 0:
        raise CostModelError(f"{kind}: negative byte count {nbytes}")
    p = len(group)
    if p <= 1 or nbytes == 0:
        return 0.0
    if world is not None and not set(group) <= world:
        raise CostModelError(f"{kind}: group {list(group)} is not inside the world of ranks 0..{len(world) - 1}")
    entry = kind_of(kind)
    if world is not None and cluster.subgroups == "world_exchange" and (set(group) != world or entry.exchanged):
        return exchange_time(kind, p, nbytes, tuple(sorted(world)), cluster)
    if kind in cluster.emulated:
        moved, copied = entry.emulation_bytes(p, nbytes)
        return _time(entry.emulated_by.value, group, moved, cluster, None) + local_copy_time(copied, cluster)
    link = cluster.link_for(group, kind)
    best = algorithm_time(kind, p, nbytes, link, "ring")
    if cluster.tree and entry.tree:
        best = min(best, algorithm_time(kind, p, nbytes, link, "tree"))
    return best


def exchange_time(kind: str, p: int, nbytes: float, world: Sequence[int], cluster: Cluster) -> float:
    """A collective over a group of ``p`` ranks run by a world exchange: every rank of ``world``
    sends its input to every other (``all_gather_object``: ``len(world)`` x input bytes
    gathered, priced with the profile's ``exchange`` fit, else its ``all_gather`` fit), then
    computes its group's output locally (a copy of what it combines)."""
    piece, combined = kind_of(kind).exchange(p, nbytes)  # what each rank sends, what it combines
    fits = dict(cluster.collectives)
    kind_fit = "exchange" if any(k.split("@")[0] == "exchange" for k in fits) else "all_gather"
    link = cluster.link_for(world, kind_fit)
    gathered = len(world) * piece
    local = local_copy_time(combined, cluster) if combined else 0.0
    return algorithm_time("all_gather", len(world), gathered, link) + local


def shared_cores_time(kind: str, group: Sequence[int], cluster: Cluster, processes: int) -> float:
    """What a collective over ``group`` costs beyond :func:`collective_time` when ``processes``
    of a job share the node's cores (a CPU device with ``cores``; the fits were timed with the
    processes doing nothing else): each of its fixed costs — the program segment it ends (host
    work, slowed like compute) and each message step's latency (a member waiting for another's
    post sleeps; the one it waits for, and its own wake-up, queue for a core the others hold) —
    stretched by the processes per core, ``(shared - 1) * (segment + steps * latency)``. Its
    bytes keep their fitted rate (the ``kind@p`` fits were timed with ``p`` processes on these
    cores). 0 for a group of one or a node with a core per process."""
    shared = cluster.device.shared_by(processes)
    kind = str(kind)
    if shared <= 1.0 or len(group) <= 1 or kind not in COLLECTIVES:
        return 0.0
    steps = coefficients(kind, len(group), 0.0)[0]
    link = cluster.link_for(tuple(group), kind)
    return (shared - 1.0) * (cluster.device.segment_seconds + steps * link.latency)


def groups_time(
    kind: str, groups: Sequence[Sequence[int]], nbytes: float, cluster: Cluster, world_size: int | None = None
) -> float:
    """Concurrent collectives over disjoint groups: the slowest one.

    Without ``world_size``, the world is the union of ``groups`` when there are several (the
    planner passes every group of a mesh dim: together they are the mesh, every process of
    which takes part). A pipeline stage's mesh is smaller than the run's world: there a
    world exchange gathers from more ranks than priced.
    """
    groups = [tuple(g) for g in groups]
    if world_size is not None:
        world: frozenset[int] | None = frozenset(range(world_size))
    else:
        world = frozenset(r for g in groups for r in g) if len(groups) > 1 else None
    return _with_segment(max((_time(str(kind), g, nbytes, cluster, world) for g in groups), default=0.0), cluster)
