"""Shared test set-up: hypothesis profiles; the ``gloo_profile`` fixture.

"ci" (default) is fast and derandomized, so a run gives the same verdict on every machine;
"deep" (HYPOTHESIS_PROFILE=deep) draws 600 fresh random cases per test.
"""

import os
import warnings

import pytest
from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore")
settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def gloo_profile(monkeypatch):
    """The default cost profile is ``cpu-gloo`` (``AUTOPAR_HOST_COMM=gloo``): for tests of which
    plan the planner picks on that profile's costs. (On ``cpu-shm``, the default on x86-64, a
    large all_reduce over 4 processes costs more than a reduce_scatter plus an all_gather:
    every member reads every input; the planner then picks the pair.)"""
    monkeypatch.setenv("AUTOPAR_HOST_COMM", "gloo")
