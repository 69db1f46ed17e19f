"""Hypothesis profiles for kvdd's property and stress suites, and the ``slow`` policy.

``KVDD_HYPOTHESIS_PROFILE`` selects the profile:

* ``ci`` (default): few examples, finishes in well under a minute on 2 cores;
* ``long``: thousands of examples and longer call sequences, for local runs
  (``KVDD_HYPOTHESIS_PROFILE=long python -m pytest -m slow tests/property tests/stress``).

Tests marked ``slow`` here are skipped unless selected with ``-m`` (e.g. ``-m slow``) or the long
profile is active, so a plain ``pytest`` stays fast (the policy is in ``tests/conftest.py``).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)  # no "explain"
settings.register_profile(
    "ci", max_examples=100, stateful_step_count=40, deadline=None, phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "long", max_examples=3000, stateful_step_count=80, deadline=None, phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PROFILE = os.environ.get("KVDD_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise pytest.UsageError(f"KVDD_HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' or 'long'")
settings.load_profile(PROFILE)
