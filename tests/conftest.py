"""Shared test set-up: hypothesis profiles (fast in CI, deep with HYPOTHESIS_PROFILE=deep)."""

import os
import warnings

from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore")
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
