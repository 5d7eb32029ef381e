"""Annotations as a Paddle semi-auto user writes them: one placement per mesh dim
(``[Replicate(), Shard(1)]`` on a ``[dp, mp]`` mesh), chosen by the mesh's dim names."""

from __future__ import annotations

from typing import Any

import autopar


def placements(mesh: autopar.ProcessMesh, **splits: int) -> list[Any]:
    """``Shard(d)`` on each named mesh dim in ``splits`` (``mp=1``: split tensor dim 1 over mp),
    ``Replicate()`` on the others; a dim the mesh lacks is ignored."""
    return [autopar.Shard(splits[name]) if name in splits else autopar.Replicate() for name in mesh.dim_names]


def annotate(value: Any, mesh: autopar.ProcessMesh, **splits: int) -> Any:
    """``shard_tensor(value, mesh, placements(mesh, **splits))``."""
    return autopar.shard_tensor(value, mesh, placements(mesh, **splits))


def column(linear: Any, mesh: autopar.ProcessMesh) -> None:
    """Megatron's column-parallel Linear ([in, out] weight split by columns over mp)."""
    annotate(linear.weight, mesh, mp=1)
    if linear.bias is not None:
        annotate(linear.bias, mesh, mp=0)


def row(linear: Any, mesh: autopar.ProcessMesh) -> None:
    """Megatron's row-parallel Linear (split by rows over mp; the bias whole)."""
    annotate(linear.weight, mesh, mp=0)
    if linear.bias is not None:
        annotate(linear.bias, mesh)


def whole(layer: Any, mesh: autopar.ProcessMesh) -> None:
    """Every parameter of ``layer`` replicated on ``mesh`` (places it on that stage)."""
    for parameter in layer.parameters():
        annotate(parameter, mesh)


class Stages:
    """Which stage mesh each of ``layers`` decoder layers lives on: consecutive runs, or cycling
    (``virtual`` stages per pipeline rank, Megatron's looping placement); the whole mesh
    without a ``pp`` dim."""

    def __init__(self, mesh: autopar.ProcessMesh | None, layers: int, virtual: int = 1) -> None:
        self.mesh, self.layers = mesh, layers
        self.count = mesh.dim_size("pp") if mesh is not None and "pp" in mesh.dim_names else 0
        self.virtual = virtual

    def of_layer(self, i: int) -> autopar.ProcessMesh | None:
        if self.mesh is None or not self.count:
            return self.mesh
        chunks = self.count * self.virtual
        return self.mesh[(i * chunks // self.layers) % self.count]

    @property
    def first(self) -> autopar.ProcessMesh | None:
        return self.of_layer(0)

    @property
    def last(self) -> autopar.ProcessMesh | None:
        return self.of_layer(self.layers - 1)

    def moved(self, h: Any, before: autopar.ProcessMesh | None, after: autopar.ProcessMesh | None) -> Any:
        """``h`` resharded onto the next stage's mesh where the stage changes (batch split over
        dp there, as before)."""
        if not self.count or before is None or after is None or before == after:
            return h
        return autopar.reshard(h, after, placements(after, dp=0))
