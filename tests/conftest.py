"""Shared test set-up: hypothesis profiles; the ``gloo_profile`` fixture.

"ci" (default) is fast and derandomized, so a run gives the same verdict on every machine;
"deep" (HYPOTHESIS_PROFILE=deep) draws 600 fresh random cases per test.

Paddle's PIR records the Python call stack of every op it creates (the ``op_callstack``
attribute, through ``traceback.extract_stack()``). Under pytest that stack is ~50 frames deep
(pytest's own), each frame's source line read and its file stat'ed: a quarter of the time of
building and compiling a program in the equivalence tests (profiled on tests/equivalence/
test_zoo.py), and the recorded stacks stay alive as Python objects held by the programs,
which every full garbage collection then walks. The suite keeps the innermost
``OP_CALLSTACK_FRAMES`` frames (Paddle's wrapper and the model line that made the op, as an
error names them); no test reads ``op_callstack`` (autopar ignores the attribute).
"""

import os
import sys
import traceback
import warnings

import pytest
from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore")
settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

OP_CALLSTACK_FRAMES = 8
_extract_stack = traceback.extract_stack


def _innermost_stack(f=None, limit=None):
    """``traceback.extract_stack`` keeping the innermost frames when no limit is asked (Paddle
    asks for none); from the caller's frame, as the original starts."""
    return _extract_stack(sys._getframe(1) if f is None else f, OP_CALLSTACK_FRAMES if limit is None else limit)


traceback.extract_stack = _innermost_stack


@pytest.fixture
def gloo_profile(monkeypatch):
    """The default cost profile is ``cpu-gloo`` (``AUTOPAR_HOST_COMM=gloo``): for tests of which
    plan the planner picks on that profile's costs. (On ``cpu-shm``, the default on x86-64, a
    large all_reduce over 4 processes costs more than a reduce_scatter plus an all_gather:
    every member reads every input; the planner then picks the pair.)"""
    monkeypatch.setenv("AUTOPAR_HOST_COMM", "gloo")
