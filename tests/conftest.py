"""Shared test set-up: hypothesis profiles.

"ci" (default) is fast and derandomized, so a run gives the same verdict on every machine;
"deep" (HYPOTHESIS_PROFILE=deep) draws 600 fresh random cases per test.
"""

import os
import warnings

from hypothesis import HealthCheck, settings

warnings.filterwarnings("ignore")
settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
