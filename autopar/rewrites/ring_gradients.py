"""Ring attention's key / value gradients split by sequence (stage: propagate -> ring
annotations -> propagate again; ``ContextParallel(method="ring")``, issue 39).

With q split by sequence and K, V read whole, propagation leaves dK and dV pending sums over the
context-parallel dim and reduces them late, after the backward's layout ops (which then read
whole copies: a gather for a ``reshape_grad`` of a GQA ``repeat_kv``, a reduce_scatter of the full
gradient). The ring (:mod:`autopar.passes.ring_attention`) makes each rank's block of them
complete, so they are annotated split by sequence at strategy priority
(:func:`autopar.attention_cores.ring_gradient_placements`): the planner puts one reduce_scatter
right after each grad op, the ring replaces it by its block, and the layout ops run on blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from autopar.attention_cores import ring_gradient_placements
from autopar.rewrites import Analysed, Rewrite


@dataclass(frozen=True)
class RingGradients(Rewrite):
    """dK and dV of every attention core split by sequence over ``dim`` (module docstring)."""

    dim: str = "sep"
    name: ClassVar[str] = "ring_gradients"

    def apply(self, work: Analysed) -> Analysed:
        if self.dim not in work.mesh.dim_names:
            return work.reported(self, f"the mesh has no dim {self.dim!r}")  # (ring_attention refuses it by name)
        placements = ring_gradient_placements(work.graph, work.propagate(), self.dim)
        made = work.annotated(self, placements)
        return work.reported(self, f"{len(placements)} key / value gradient(s) split by sequence over {self.dim!r}", made=made)
