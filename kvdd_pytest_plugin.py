"""The entry point of kvdd's pytest plugin (``pytest11``: ``kvdd``); the plugin is
:mod:`kvdd.testing.pytest_plugin`.

pytest loads entry-point plugins before anything else; this module loads kvdd's, and when kvdd
itself cannot be imported (for example ``python -m pytest`` run from a clone's root, where the
source tree without its compiled modules comes first on ``sys.path``) it turns kvdd's one-line
explanation into pytest's usage error instead of a plugin traceback.
"""

from __future__ import annotations

from typing import Any

import pytest

try:
    from kvdd.testing import pytest_plugin as _plugin
except ImportError as _exc:
    _PROBLEM = str(_exc)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(config: pytest.Config) -> None:
        raise pytest.UsageError(_PROBLEM)
else:
    # the hooks and fixtures of the plugin, as this module's own names (pytest reads them here)
    _names: dict[str, Any] = {name: value for name, value in vars(_plugin).items()
                              if name.startswith(("pytest_", "kvdd_", "_kvdd_"))}
    globals().update(_names)
