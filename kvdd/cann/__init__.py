"""kvdd's simulated CANN root: what identifies one, and whether it is stale.

``kvdd cann-root DEST`` (:mod:`kvdd.cann.root`) writes a directory with CANN's install layout
(``include/``, ``lib64/``, ``set_env.sh``) whose ``libllm_datadist.so`` is kvdd's simulator, so that
C++ programs written for LLM-DataDist build and run without an NPU. Its marker file
(:data:`MARKER_NAME`) says so; this module reads it for ``kvdd doctor``, for backend selection (an
``ASCEND_HOME_PATH`` that points at a simulated root is not an Ascend node) and, through
:func:`root_problem`, for the root's own library, which refuses a root that no longer matches the
kvdd installation it runs with.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from .._version import __version__

__all__ = [
    "MARKER_NAME",
    "is_simulated_root",
    "read_marker",
    "root_problem",
    "sources_digest",
    "package_dir",
    "simulated_root_status",
    "PYTHON_PACKAGE_DIR",
    "llm_datadist_status",
]

#: Where a simulated root keeps CANN's Python package name (``llm_datadist``), relative to it.
PYTHON_PACKAGE_DIR = os.path.join("python", "site-packages")

#: The marker file at the top of a simulated root (``key=value`` lines).
MARKER_NAME = "kvdd_simulated_root"


def package_dir() -> Path:
    """The directory of the root's sources (headers, C/C++ sources, templates)."""
    return Path(__file__).resolve().parent


def sources_digest() -> str:
    """SHA-256 over every file a root is made from (relative path and content), in path order."""
    base = package_dir()
    digest = hashlib.sha256()
    for sub in ("include", "src", "templates"):
        for path in sorted((base / sub).rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(base)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def is_simulated_root(root: str | os.PathLike[str]) -> bool:
    """True when ``root`` is a directory written by ``kvdd cann-root`` (it has the marker)."""
    return os.path.isfile(os.path.join(os.fspath(root), MARKER_NAME))


def read_marker(root: str | os.PathLike[str]) -> dict[str, str]:
    """The ``key=value`` pairs of ``root``'s marker (empty when there is none)."""
    path = os.path.join(os.fspath(root), MARKER_NAME)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return {}
    pairs: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            pairs[key] = value
    return pairs


def _problem(marker: Mapping[str, str], root: str) -> str | None:
    redo = f"; re-write it with `kvdd cann-root {root}`"
    if not marker:
        return f"{root} is not a kvdd simulated CANN root (no {MARKER_NAME})"
    written_by = marker.get("kvdd_version", "?")
    if written_by != __version__:
        return f"stale simulated CANN root {root}: written by kvdd {written_by}, this is kvdd {__version__}{redo}"
    if marker.get("sources_sha256") != sources_digest():
        return (f"stale simulated CANN root {root}: kvdd's root sources changed since it was "
                f"written{redo}")
    recorded = marker.get("kvdd_package", "")
    here = str(Path(__file__).resolve().parent.parent)
    if recorded and recorded != here and not os.path.isdir(recorded):
        return (f"stale simulated CANN root {root}: the kvdd installation that wrote it "
                f"({recorded}) no longer exists{redo}")
    return None


def root_problem(root: str | os.PathLike[str]) -> str | None:
    """Why the simulated root ``root`` cannot be used with this kvdd, or None when it can.

    A root is stale when it was written by another kvdd version, from other root sources, or by
    an installation that no longer exists (the environment was moved or deleted).
    """
    path = os.fspath(root)
    return _problem(read_marker(path), path)


def simulated_root_status() -> list[str]:
    """``kvdd doctor`` lines about simulated roots in use: ``$ASCEND_HOME_PATH`` and the native build's."""
    import importlib

    roots: dict[str, str] = {}
    home = os.environ.get("ASCEND_HOME_PATH", "")
    if home and is_simulated_root(home):
        roots[os.path.abspath(home)] = "ASCEND_HOME_PATH"
    try:
        built = str(importlib.import_module("kvdd._build_config").ASCEND_HOME)
    except (ImportError, AttributeError):
        built = ""
    if built and is_simulated_root(built):
        where = roots.get(os.path.abspath(built))
        roots[os.path.abspath(built)] = f"{where} and native build" if where else "native build"
    lines = []
    for root, where in roots.items():
        problem = root_problem(root)
        marker = read_marker(root)
        state = f"STALE: {problem}" if problem else "current"
        lines.append(f"simulated CANN root ({where}): {root}, kvdd {marker.get('kvdd_version', '?')}"
                     f", python {marker.get('python', '?')}, C++ programs "
                     f"{'can' if marker.get('libpython') else 'cannot (no shared libpython)'} "
                     f"start it; {state}")
    return lines


def llm_datadist_status() -> str:
    """``kvdd doctor``: which ``llm_datadist`` an ``import llm_datadist`` would load here, and
    whether it is kvdd's simulator.  Found with :func:`importlib.util.find_spec`, which does not
    run the package (CANN's real one has import-time side effects)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_datadist")
    except (ImportError, ValueError) as exc:
        return f"cannot tell ({exc})"
    if spec is None or spec.origin is None:
        return ("not importable: neither CANN's set_env.sh nor a simulated root's "
                "(`source DEST/set_env.sh` after `kvdd cann-root DEST`) put it on PYTHONPATH")
    origin = os.path.abspath(spec.origin)
    kvdd_dir = str(Path(__file__).resolve().parent.parent)
    if origin.startswith(kvdd_dir + os.sep):
        return f"kvdd's simulator: kvdd.llm_datadist ({origin}), through its import alias"
    package_dir = os.path.dirname(origin)
    root = os.path.normpath(os.path.join(package_dir, os.pardir, os.pardir, os.pardir))
    if os.path.join(root, PYTHON_PACKAGE_DIR, "llm_datadist") == package_dir \
            and is_simulated_root(root):
        return (f"kvdd's simulator: the package of the simulated CANN root {root}, which loads "
                "kvdd.llm_datadist")
    return f"NOT the simulator: {origin} (CANN's package, or another one)"
