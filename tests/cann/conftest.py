"""Fixtures of the simulated-CANN-root tests: the root and the C++ probe, built once per session
(writing a root compiles five libraries: about 15-30 s)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kvdd.cann.root import write_root

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
LIBS = ("libllm_datadist.so", "libmetadef.so", "libascendcl.so")


def _can_build() -> str | None:
    if shutil.which(CXX) is None or shutil.which(os.environ.get("CC", "gcc")) is None:
        return f"no C/C++ compiler ({CXX})"
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python.h (python3-dev)"
    return None


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = _can_build()
    if why is not None:
        pytest.skip(why)
    return write_root(tmp_path_factory.mktemp("cann") / "root")


@pytest.fixture(scope="session")
def probe(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("probe") / "probe"
    subprocess.run(
        [CXX, "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=0", "-O1", "-Wall", "-Wextra", "-Werror",
         f"-I{root / 'include'}", str(HERE / "probe.cpp"), f"-L{root / 'lib64'}", "-lllm_datadist",
         "-lmetadef", "-lascendcl", "-lpthread", "-o", str(out)], check=True)
    return out


