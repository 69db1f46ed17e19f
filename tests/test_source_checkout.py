"""A newcomer in a clone without an editable install: kvdd imported from its source directory.

``python``, ``python -m kvdd``, ``python -m pytest`` and ``python -m benchmarks.*`` started from the
clone's root import the source tree (the current directory comes first on ``sys.path``), which has
no compiled modules.  Each must end with one line saying so and what to run instead, never a
``ModuleNotFoundError`` traceback.  The clone is rebuilt in a temporary directory from kvdd's Python
sources (no compiled module) and run with ``python -S`` (no site hooks: an editable install's
import hook would otherwise find the real package first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvdd
from kvdd._checkout import SOURCE_TREE_MESSAGE

ROOT = Path(__file__).resolve().parents[1]
HEAD = SOURCE_TREE_MESSAGE.split("{root}")[0]  # "kvdd was imported from its source directory "


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone's root: kvdd's Python sources, meson.build, pyproject.toml, the pytest plugin's entry
    point, tests/conftest.py and benchmarks/__init__.py; no compiled module anywhere."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(Path(kvdd.__file__).parent, root / "kvdd",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "_build_config.py"))
    (root / "meson.build").write_text("project('kvdd')\n")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(ROOT / "kvdd_pytest_plugin.py", root / "kvdd_pytest_plugin.py")  # pytest's entry point
    (root / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", root / "tests" / "conftest.py")
    (root / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "__init__.py", root / "benchmarks" / "__init__.py")
    (root / "benchmarks" / "kernels.py").write_text("print('ran')\n")
    return root


def run(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return subprocess.run([sys.executable, "-S", *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=60)


def test_import_kvdd_names_the_source_directory(clone: Path) -> None:
    out = run(clone, "-c", "import kvdd")
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last == f"ImportError: {SOURCE_TREE_MESSAGE.format(root=clone)}"
    assert "ModuleNotFoundError" not in out.stderr and "_runs" not in out.stderr


@pytest.mark.parametrize("args", [[], ["--help"], ["demo", "--quick"]])
def test_python_m_kvdd_is_one_line(clone: Path, args: list[str]) -> None:
    out = run(clone, "-m", "kvdd", *args)
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert HEAD + str(clone) in out.stderr and "Traceback" not in out.stderr


def test_python_m_pytest_is_one_line(clone: Path) -> None:
    out = run(clone, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider")
    assert out.returncode == pytest.ExitCode.USAGE_ERROR
    text = (out.stdout + out.stderr).strip()
    assert text.splitlines() == [f"ERROR: {SOURCE_TREE_MESSAGE.format(root=clone)}"], text


def test_python_m_benchmarks_is_one_line(clone: Path) -> None:
    out = run(clone, "-m", "benchmarks.kernels")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [f"benchmarks: {SOURCE_TREE_MESSAGE.format(root=clone)}"]


def test_an_installed_or_built_kvdd_imports() -> None:
    # the check never fires for the kvdd under test (installed, or an editable build)
    out = subprocess.run([sys.executable, "-c", "import kvdd; print(kvdd.__version__)"], cwd=Path.home(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
