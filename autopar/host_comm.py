"""Which communicator a host-backend job uses: shared memory or gloo (stage: runtime, read by the
cost model too).

The choice is read from the environment (``AUTOPAR_HOST_COMM``) and the machine alone: the
runtime picks its communicator by it (:func:`autopar.runtime.shm.available`) and the cost model
its CPU profile, ``cpu-shm`` or ``cpu-gloo`` (:func:`autopar.cost_model.cluster.hardware_profile`).
It is a leaf module outside ``autopar.runtime``, so the cost model asks it without importing the
runtime (whose communicators read rank plans, which the compiler above the cost model makes;
``tests/unit/test_import_cycles.py`` checks the cost model imports no runtime module).
"""

from __future__ import annotations

import os
import platform

from autopar.errors import AutoparError

ENV = "AUTOPAR_HOST_COMM"  # "gloo" forces the gloo communicator; "shm" requires this one


def choice() -> str:
    """``AUTOPAR_HOST_COMM``: ``"gloo"``, ``"shm"`` or ``""`` (not set: shared memory where it can run)."""
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen not in ("", "gloo", "shm"):
        raise AutoparError(f"{ENV} must be 'gloo' or 'shm', got {chosen!r}")
    return chosen


def x86_64() -> bool:
    """Shared memory relies on x86-64's store / load order (see :mod:`autopar.runtime.shm`)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def one_host_default() -> bool:
    """Whether a job whose ranks all run on this host talks through shared memory: an x86-64
    CPU and not turned off (``AUTOPAR_HOST_COMM=gloo``). (The cost profile for CPU jobs follows
    it: ``cpu-shm`` or ``cpu-gloo``.)"""
    return x86_64() and choice() != "gloo"
