"""Collective semantics on numpy arrays: the runtime's name for the one reference every backend
must match, :func:`autopar.collective_kinds.perform` (each kind's meaning is defined there, with
its lowering and price). The simulator runs collectives with it; the process-group backend's
results are tested against it."""

from autopar.collective_kinds import own_piece, perform

__all__ = ["own_piece", "perform"]
