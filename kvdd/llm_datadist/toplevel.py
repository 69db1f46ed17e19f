"""Make ``import llm_datadist`` load :mod:`kvdd.llm_datadist` (PYPKG.md §9.1).

CANN installs its package as the top-level module ``llm_datadist``; kvdd never installs that name
with pip (it would shadow CANN's real package on an Atlas node).  Instead:

* :func:`install` puts a finder first on :data:`sys.meta_path` that answers every import of
  ``llm_datadist`` and ``llm_datadist.<sub>`` with the **same module objects** as
  ``kvdd.llm_datadist`` and ``kvdd.llm_datadist.<sub>`` — one set of classes, so
  ``llm_datadist.status.LLMException is kvdd.llm_datadist.status.LLMException`` and an
  exception raised by either spelling is caught by the other.
* The thin package that ``kvdd cann-root DEST`` writes to ``DEST/python/site-packages/llm_datadist/``
  calls :func:`install` and then replaces itself in :data:`sys.modules` with
  :mod:`kvdd.llm_datadist`, so ``source DEST/set_env.sh`` makes unmodified client code use the
  simulator.
* Tests use :func:`installed` (a context manager) or :func:`install` / :func:`uninstall` in a
  fixture.

Example
-------
>>> from kvdd.llm_datadist import toplevel
>>> toplevel.install()
>>> import llm_datadist, kvdd.llm_datadist
>>> llm_datadist is kvdd.llm_datadist
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

__all__ = ["install", "uninstall", "is_installed", "installed", "TOP_NAME", "REAL_NAME"]

#: the name client code imports
TOP_NAME = "llm_datadist"
#: the package that implements it
REAL_NAME = "kvdd.llm_datadist"


def _real_name(fullname: str) -> str | None:
    if fullname == TOP_NAME:
        return REAL_NAME
    if fullname.startswith(TOP_NAME + "."):
        return REAL_NAME + fullname[len(TOP_NAME):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system an already imported module and leaves it untouched."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set __spec__ to the alias spec; the module keeps its own
        module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``llm_datadist[.x]`` -> the module object of ``kvdd.llm_datadist[.x]``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        real = _real_name(fullname)
        if real is None:
            return None
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as exc:
            if exc.name == real:
                return None  # no such submodule: let the import fail as usual
            raise
        is_package = hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)


_finder = _AliasFinder()


def install() -> None:
    """Make ``import llm_datadist`` / ``import llm_datadist.<sub>`` resolve to kvdd's modules
    (idempotent).  Must run before anything else imports ``llm_datadist``: a module already in
    :data:`sys.modules` under that name (CANN's real package) is left as it is."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Undo :func:`install`: remove the finder and the ``llm_datadist*`` entries of
    :data:`sys.modules` that are kvdd's modules (other entries are left alone)."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if _real_name(n) is not None]:
        module = sys.modules.get(name)
        real = _real_name(name)
        if module is not None and real is not None and sys.modules.get(real) is module:
            del sys.modules[name]


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _finder in sys.meta_path


@contextmanager
def installed() -> Iterator[ModuleType]:
    """``with installed() as llm_datadist:`` — :func:`install` for the block (yielding the
    top-level module), then :func:`uninstall` unless it was installed before."""
    was = is_installed()
    install()
    try:
        yield importlib.import_module(TOP_NAME)
    finally:
        if not was:
            uninstall()
