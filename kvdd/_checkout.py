"""One clear error when kvdd is imported from its source directory instead of an installed copy.

A clone of the repository holds kvdd's Python sources but not its compiled modules (meson builds
them at install time).  ``python``, ``python -m ...`` and ``python -m pytest`` started from the
clone's root put that directory first on ``sys.path``, so ``import kvdd`` finds the sources there
before the installed package.  Like numpy in the same situation, kvdd then stops with one line that
says what happened and what to run instead, rather than a ``ModuleNotFoundError`` from deep inside.
This module is pure Python and imports nothing of kvdd.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["SOURCE_TREE_MESSAGE", "compiled_problem", "has_compiled_modules", "source_checkout",
           "source_tree_problem"]

#: The message, formatted with ``root`` (the clone's directory).
SOURCE_TREE_MESSAGE = (
    "kvdd was imported from its source directory {root}, which has no compiled modules: do not "
    "run Python there; run the installed `kvdd` and `pytest` commands, or Python from another "
    "directory, or install kvdd in editable mode (docs/development.md: pip install meson-python "
    "meson ninja cython numpy ml_dtypes, then pip install --no-build-isolation -e '.[test]')"
)

_PROBE = "kvdd._native._runs"  # the first compiled module `import kvdd` needs


def source_checkout(package_dir: str) -> str | None:
    """The clone's root when ``package_dir`` is kvdd's source tree (not an installed copy)."""
    root = os.path.dirname(os.path.abspath(package_dir))
    if os.path.isfile(os.path.join(root, "meson.build")) and os.path.isfile(
            os.path.join(root, "pyproject.toml")):
        return root
    return None


def has_compiled_modules(package_dir: str) -> bool:
    """Whether ``package_dir/_native`` holds kvdd's compiled copy kernels (a built tree)."""
    native = os.path.join(package_dir, "_native")
    try:
        return any(name.startswith("_copy.") and name.endswith((".so", ".pyd"))
                   for name in os.listdir(native))
    except OSError:
        return False


def source_tree_problem(package_dir: str) -> str | None:
    """The one-line message when ``package_dir`` is a source tree without compiled modules."""
    root = source_checkout(package_dir)
    if root is None or has_compiled_modules(package_dir):
        return None
    return SOURCE_TREE_MESSAGE.format(root=root)


def compiled_problem() -> str | None:
    """Import kvdd's first compiled module; the one-line source-tree message when that fails
    because kvdd is being imported from a source checkout (``import kvdd`` raises it as an
    :class:`ImportError`).

    Raises
    ------
    ImportError
        When a compiled module is missing from an installed (not source-tree) kvdd.
    """
    try:
        importlib.import_module(_PROBE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("kvdd."):
            problem = source_tree_problem(os.path.dirname(os.path.abspath(__file__)))
            if problem is not None:
                return problem
        raise
    return None
