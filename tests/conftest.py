"""Session-wide test set-up: make sure the kvdd under test is an installed (compiled) one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Child Python processes started by the tests (peers, demo sides, programs run with an env var)
# must import the installed kvdd, not the source tree that is the current directory when pytest runs
# from a checkout: PYTHONSAFEPATH (Python >= 3.11) stops `python -c` / `python -m` from putting the
# current directory first on sys.path.
os.environ.setdefault("PYTHONSAFEPATH", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import kvdd._native._copy  # noqa: F401
    except ImportError as exc:  # kvdd's own one line (from a source checkout) or what is missing
        raise pytest.UsageError(
            f"{exc}" if "source directory" in str(exc) else
            f"kvdd cannot load its compiled modules ({exc}). Install it (pip install '.[test]') and "
            "run the `pytest` command, or use an editable install "
            "(docs/development.md: pip install meson-python meson ninja cython numpy ml_dtypes, then "
            "pip install --no-build-isolation -e '.[test]')."
        ) from None


#: Suites whose ``slow`` tests are skipped unless selected (``-m slow``) or the long Hypothesis
#: profile is active (``KVDD_HYPOTHESIS_PROFILE=long``); elsewhere ``slow`` only labels a test.
SLOW_OPT_IN = ("property", "stress")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = str(config.getoption("markexpr", "") or "")
    if "slow" in markexpr or os.environ.get("KVDD_HYPOTHESIS_PROFILE", "ci") == "long":
        return
    here = Path(__file__).resolve().parent
    dirs = tuple(str(here / name) + os.sep for name in SLOW_OPT_IN)
    skip = pytest.mark.skip(reason="slow: run with -m slow or KVDD_HYPOTHESIS_PROFILE=long")
    for item in items:
        if "slow" in item.keywords and str(item.path).startswith(dirs):
            item.add_marker(skip)


@pytest.fixture
def python_path_only() -> Iterator[None]:
    """The simulator's compiled in-process transfer path off for one test: every transfer then runs
    through the Python path (kvdd.sim.pulls / pushes), so a test that patches SimBackend's transfer
    methods sees every call (kvdd.sim._fastpath)."""
    from kvdd.sim import _fastpath

    prev = _fastpath.set_enabled(False)
    try:
        yield
    finally:
        _fastpath.set_enabled(prev)


@pytest.fixture
def compiled_path_on() -> Iterator[None]:
    """The simulator's compiled in-process transfer path on for one test, whatever
    ``KVDD_SIM_FAST_PATH`` says: tests of that path itself use it, so the whole suite passes with
    the variable set to 0 as well as without it (kvdd.sim._fastpath)."""
    from kvdd.sim import _fastpath

    prev = _fastpath.set_enabled(True)
    try:
        yield
    finally:
        _fastpath.set_enabled(prev)
