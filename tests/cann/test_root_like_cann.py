"""The simulated CANN root as a real install has it (VENDOR.md): headers under their CANN paths, a
C++ client of ge/llm_error_codes.h and ge::AscendString, a root that works where it is copied or
moved, CANN's Python package name on PYTHONPATH, and no test hook armed in what it ships.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdd.cann import llm_datadist_status

from .conftest import CXX, HERE
from .test_cann_root import _assert_all_ok, _run

ENV_KEYS = ("ASCEND_HOME_PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CMAKE_PREFIX_PATH")


def _sourced(set_env: Path, shell: str = "bash") -> dict[str, str]:
    """The variables ``set_env`` exports, sourced by path from another directory."""
    script = f". {set_env}; " + "; ".join(f'echo "{k}=${k}"' for k in ENV_KEYS)
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    out = subprocess.run([shell, "-c", script], capture_output=True, text=True, env=env,
                         cwd="/", check=True, timeout=30)
    assert out.stderr == "", out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_cpp_client_of_ge_headers_and_ascend_string(root: Path, tmp_path: Path) -> None:
    exe = tmp_path / "cann_client"
    subprocess.run([CXX, "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=0", "-Wall", "-Wextra", "-Werror",
                    f"-I{root / 'include'}", str(HERE / "cann_client.cpp"),
                    f"-L{root / 'lib64'}", "-lmetadef", "-o", str(exe)], check=True, timeout=120)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ, "LD_LIBRARY_PATH": str(root / "lib64")})
    _assert_all_ok(proc)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_copied_or_moved_root_uses_its_own_files(root: Path, tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell}")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    copy.rename(moved)
    env = _sourced(moved / "set_env.sh", shell)
    assert env["ASCEND_HOME_PATH"] == str(moved)
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(moved / "lib64")
    assert env["PYTHONPATH"].split(":")[0] == str(moved / "python/site-packages")
    assert env["CMAKE_PREFIX_PATH"].split(":")[0] == str(moved)


def test_moved_root_loads_its_own_library(probe: Path, root: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(root, moved, symlinks=True)
    environ = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    environ.update(_sourced(moved / "set_env.sh"))  # nothing else names the moved root
    proc = subprocess.run([str(probe), "where"], capture_output=True, text=True, env=environ,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == (moved / "lib64/libllm_datadist.so").resolve()


def test_shipped_library_has_no_armed_test_hook(probe: Path, root: Path) -> None:
    if not (root / "kvdd_simulated_root").read_text().count("libpython=/"):
        pytest.skip("this Python has no shared libpython: C++ programs cannot start the simulator")
    _assert_all_ok(_run(probe, root, "hook"))  # the hook's cluster id is an ordinary id
    _assert_all_ok(_run(probe, root, "hook-armed", KVDD_TESTDOUBLE_THROW_HOOK="1"))


# ---- CANN's Python package name ----------------------------------------------------------------

_CHECK = '''
import kvdd.cann
print("doctor:", kvdd.cann.llm_datadist_status())
import llm_datadist, kvdd.llm_datadist
assert llm_datadist is kvdd.llm_datadist, llm_datadist
from llm_datadist import LLMException
assert LLMException is kvdd.llm_datadist.LLMException
import importlib
for name in ("status", "v2.llm_types", "v2.cache_manager"):
    a = importlib.import_module("llm_datadist." + name)
    b = importlib.import_module("kvdd.llm_datadist." + name)
    assert a is b, (a, b)
print("same modules")
'''


def test_root_installs_the_python_package_name(root: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env.update(_sourced(root / "set_env.sh"))
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same modules" in proc.stdout
    assert f"the package of the simulated CANN root {root}" in proc.stdout
    # without the root's PYTHONPATH there is no top-level llm_datadist (pip installs none)
    env.pop("PYTHONPATH")
    proc = subprocess.run([sys.executable, "-c", "import llm_datadist"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode != 0 and "No module named 'llm_datadist'" in proc.stderr


def test_doctor_names_another_llm_datadist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "site" / "llm_datadist"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise SystemExit('CANN package must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    status = llm_datadist_status()
    assert status == f"NOT the simulator: {other / '__init__.py'} (CANN's package, or another one)"
    assert "llm_datadist" not in sys.modules
