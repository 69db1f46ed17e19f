"""Stress suite: watchdog, time budget, and the ``slow`` policy.

* ``KVDD_STRESS_SECONDS`` — how long each concurrency stress runs (default 3 s; the ``slow``
  variants use 60 s unless this is set);
* ``KVDD_HYPOTHESIS_PROFILE=long`` or ``-m slow`` — run the ``slow`` variants (skipped otherwise;
  the policy is in ``tests/conftest.py``).

Every stress test runs under :func:`watchdog`: ``faulthandler.dump_traceback_later(..., exit=True)``
is the hard limit (it prints every thread's stack and ends the process, so a deadlock can never
hang CI), and the test itself joins its threads with a softer deadline and fails with all stacks
when they do not finish.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator

import pytest

#: The Hypothesis profile (``ci`` or ``long``, see ``tests/property/conftest.py``).
PROFILE = os.environ.get("KVDD_HYPOTHESIS_PROFILE", "ci")

def stress_seconds(slow: bool = False) -> float:
    raw = os.environ.get("KVDD_STRESS_SECONDS")
    if raw:
        return float(raw)
    return 60.0 if slow else 3.0


@pytest.fixture
def watchdog(request: pytest.FixtureRequest) -> Iterator[float]:
    """The hard limit in seconds (test budget x 4 + 60); the process dies past it."""
    slow = request.node.get_closest_marker("slow") is not None
    hard = stress_seconds(slow) * 4 + 60
    faulthandler.dump_traceback_later(hard, exit=True, file=sys.stderr)
    try:
        yield hard
    finally:
        faulthandler.cancel_dump_traceback_later()
