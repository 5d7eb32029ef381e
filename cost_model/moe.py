"""Mixture-of-experts priced from formulas: one MoE layer's dispatch and combine all_to_alls
with the gate's expected balance, and the experts' memory per rank (stage: strategy search and
the guide's figures, docs/moe.md "Cost and suggest"; issue 40).

A layer routes the ``T`` tokens of one rank's group (its share of the batch: the tokens split
over the token dims, ``dp`` x ``ep``) to their top-``k`` of ``E`` experts; each token is a row
of ``h`` values of ``b`` bytes. Expert parallelism puts ``E / ep`` experts on each of the
``ep`` ranks of a group; the dispatch sends each row to its expert's rank (an all_to_all over
the ``ep`` ranks), the combine sends the experts' rows back (another), and the backward moves
their gradients the same two ways: **2 all_to_alls forward, 2 backward, each of**

    n = T x k x h x b                   bytes one rank sends (the rows it routes, top-k each)

**The gate's balance.** A uniform router spreads the ``k T`` rows evenly over the experts, so
each of the ``ep`` ranks receives ``n / ep`` from each rank: the all_to_all of the cost table
(:mod:`autopar.cost_model.comm`, ``(p-1) a + (p-1)/p n b``). A router is rarely uniform; the
caller may give an ``imbalance`` ``f >= 1``: the busiest rank's experts receive ``f`` times
their even share. The ranks wait for the busiest, so it decides the time:

    dropless (``capacity_factor=None``): each all_to_all priced as one of  f x n  bytes
    static capacity ``c`` (GShard's):    each rank sends its padded buffer [E, C, h],
                                         C = ceil(k T / E x c), whatever the balance:
                                         n_c = E x C x h x b  (= n at c = 1 when E divides k T);
                                         an expert past its capacity drops the rest
                                         (a share  max(0, 1 - c / f)  of the busiest expert's rows)

**Memory** is the experts' parameters, gradients and optimizer states (``states`` values the
size of a parameter each: AdamW's two moments) on the ranks that hold them: ``E / ep`` experts
of ``P`` elements each, ``(E / ep) x P x (2 + states) x b_p`` bytes per rank — ``1 / ep`` of
the replicated experts' (``ep = 1``). The compiled plan counts the same
(:func:`autopar.pricing.price`: a value placed on a sub-mesh, or split by expert, is held by
its holders only; ``tests/unit/cost_model/test_moe_pricing.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost_model.cluster import Cluster, dtype_bytes
from autopar.cost_model.comm import collective_time
from autopar.errors import CostModelError

ALL_TO_ALLS = (2, 2)  # forward (dispatch, combine), backward (their gradients)


@dataclass(frozen=True, slots=True)
class MoELayer:
    """One MoE layer on one rank's group: ``tokens`` routed rows of ``hidden`` values in
    ``dtype``, ``experts`` routed experts of ``expert_parameters`` elements each, ``top_k``
    experts per token, ``capacity_factor`` (None: dropless)."""

    tokens: int
    hidden: int
    experts: int
    top_k: int = 2
    capacity_factor: float | None = 1.0
    expert_parameters: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"MoELayer.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise CostModelError(f"MoELayer: top_k={self.top_k} is more than the {self.experts} experts")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise CostModelError(f"MoELayer.capacity_factor must be positive or None (dropless), got {self.capacity_factor!r}")
        dtype_bytes(self.dtype)

    @property
    def capacity(self) -> int | None:
        """Slots per expert (GShard's ``ceil(k T / E x c)``; None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.top_k * self.tokens / self.experts * self.capacity_factor)

    @property
    def routed_bytes(self) -> int:
        """``T x k x h x b``: the rows one rank routes, top-k each (the formula's ``n``)."""
        return self.tokens * self.top_k * self.hidden * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class MoEPrice:
    """One MoE layer's dispatch and combine on the busiest rank of an ``ep`` group (module
    docstring): bytes one rank sends per all_to_all, the busiest rank's seconds of one, the
    counts forward and backward, the share of the busiest expert's rows dropped."""

    ep: int
    imbalance: float
    sent: int  # bytes one rank's send buffer holds, per all_to_all
    busiest: float  # bytes the busiest rank's all_to_all is priced as (f x n dropless; the padded buffer with a capacity)
    seconds: float  # of one all_to_all, the busiest rank's
    forward_collectives: int
    backward_collectives: int
    dropped: float  # share of the busiest expert's rows past its capacity

    @property
    def collectives(self) -> int:
        return self.forward_collectives + self.backward_collectives

    @property
    def forward(self) -> float:
        return self.forward_collectives * self.seconds

    @property
    def backward(self) -> float:
        return self.backward_collectives * self.seconds

    @property
    def comm(self) -> float:
        return self.forward + self.backward


def price_moe_layer(
    layer: MoELayer, ep: int, cluster: Cluster, imbalance: float = 1.0, group: Sequence[int] | None = None
) -> MoEPrice:  # fmt: skip
    """``layer``'s 4 all_to_alls over ``ep`` ranks (``group``: their ranks, default
    ``0 .. ep-1``) on ``cluster`` with the gate's ``imbalance`` (1: a uniform router; see the
    module docstring). ``ep = 1`` moves nothing."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise CostModelError(f"expert parallelism: ep must be a positive integer, got {ep!r}")
    if layer.experts % ep:
        raise CostModelError(f"expert parallelism: {layer.experts} experts do not split over ep={ep} ranks")
    if imbalance < 1:
        raise CostModelError(f"expert parallelism: imbalance is the busiest rank's share over its even one (>= 1), got {imbalance!r}")
    group = tuple(range(ep)) if group is None else tuple(group)
    if len(group) != ep:
        raise CostModelError(f"expert parallelism: group {list(group)} has {len(group)} ranks, ep is {ep}")
    if ep == 1:
        return MoEPrice(1, imbalance, 0, 0.0, 0.0, 0, 0, _dropped(layer, imbalance))
    capacity = layer.capacity
    if capacity is None:
        sent, busiest = layer.routed_bytes, imbalance * layer.routed_bytes
    else:
        sent = layer.experts * capacity * layer.hidden * dtype_bytes(layer.dtype)
        busiest = float(sent)
    seconds = collective_time("all_to_all", group, busiest, cluster)
    return MoEPrice(ep, imbalance, sent, busiest, seconds, *ALL_TO_ALLS, _dropped(layer, imbalance))


def _dropped(layer: MoELayer, imbalance: float) -> float:
    if layer.capacity_factor is None:
        return 0.0
    return max(0.0, 1.0 - layer.capacity_factor / imbalance)


def expert_memory(layer: MoELayer, ep: int, states: int = 2, parameter_dtype: str = "float32") -> int:
    """Bytes of the experts' parameters, gradients and ``states`` optimizer states (values the
    size of a parameter: AdamW 2, Momentum 1, SGD 0) on one rank holding ``E / ep`` experts."""
    if layer.experts % ep:
        raise CostModelError(f"expert parallelism: {layer.experts} experts do not split over ep={ep} ranks")
    return layer.experts // ep * layer.expert_parameters * (2 + states) * dtype_bytes(parameter_dtype)


def uneven_bytes(padded: int, routed_share: float | None, imbalance: float = 1.0) -> int:
    """Bytes the uneven all_to_all of a dropless buffer is priced at: the ``padded`` buffer's
    ``routed_share`` (``k x tokens x hidden`` of its values, :mod:`autopar.dropless`) times the
    gate's ``imbalance`` (1: a uniform gate), at most the padded buffer (``padded``: the padded
    pieces a rank sends the others, all_to_all_v's bytes). The runtime sends each expert's rows
    up to its last filled slot (the counts beside them), so what it measures sits near a uniform
    gate's share, above it by the gate's real imbalance (benchmarks/bench_moe_dropless.py shows
    both). None: the share is not known, priced padded."""
    if imbalance < 1:
        raise CostModelError(f"uneven all_to_all: imbalance is the busiest rank's share over its even one (>= 1), got {imbalance!r}")
    if routed_share is None:
        return int(padded)
    return int(min(padded, math.ceil(padded * routed_share * imbalance)))
