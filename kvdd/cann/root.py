"""``kvdd cann-root DEST``: write kvdd's simulated CANN root.

The root has CANN's install layout, so C++ programs written for LLM-DataDist build and run on it
unchanged (``source DEST/set_env.sh``; ``-I$ASCEND_HOME_PATH/include -L$ASCEND_HOME_PATH/lib64
-lllm_datadist -lmetadef -lascendcl``)::

    DEST/include/          llm_datadist/llm_datadist.h, ge/llm_error_codes.h, ge/llm_engine_types.h,
                           graph/, exe_graph/runtime/, utils/, external/ge_common/, acl/acl.h
    DEST/lib64/            libllm_datadist.so, libmetadef.so, libascendcl.so (SONAMEs as in CANN),
                           libkvdd_simbridge.so, libkvdd_pyembed.so (kvdd's own, loaded by libllm_datadist.so)
    DEST/python/site-packages/llm_datadist/   CANN's Python package name: kvdd.llm_datadist
    DEST/share/cmake/LlmDataDist/LlmDataDistConfig.cmake   find_package(LlmDataDist)
    DEST/set_env.sh        ASCEND_HOME_PATH, LD_LIBRARY_PATH, CMAKE_PREFIX_PATH, PYTHONPATH (the
                           root is the script's own directory: a copied or moved root works)
    DEST/kvdd_simulated_root   the marker (kvdd version, sources digest, the Python and libpython)

The libraries are compiled here, by the system's C/C++ compiler, from the sources shipped in the
package (``kvdd/cann/src``): the root is bound to the Python installation that runs this command
(its libpython and kvdd are what a C++ program starts), which is only known now, not when the
wheel is built; and a user who never writes a root needs no C++ compiler.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._version import __version__
from . import MARKER_NAME, is_simulated_root, package_dir, sources_digest

__all__ = ["CannRootError", "write_root", "add_cann_root_arguments", "run_from_args"]

logger = logging.getLogger(__name__)

# Files whose presence marks a real CANN install (never written over).
_REAL_CANN_SIGNS = ("version.cfg", "ascend_toolkit_install.info", "compiler", "runtime",
                    "lib64/libascendcl.so", "include/llm_datadist", "set_env.sh", "bin/setenv.bash")


class CannRootError(Exception):
    """The root cannot be written (with the reason and what to do)."""


def _real_cann_sign(dest: Path) -> str | None:
    if is_simulated_root(dest):
        return None
    for sign in _REAL_CANN_SIGNS:
        if (dest / sign).exists():
            return sign
    return None


def _libpython() -> str:
    """The shared libpython of this interpreter, or '' when it has none."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return ""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    for name in (sysconfig.get_config_var("INSTSONAME"), sysconfig.get_config_var("LDLIBRARY")):
        if name and os.path.isfile(os.path.join(libdir, name)):
            return os.path.join(libdir, name)
    return ""


def _compiler(env: str, candidates: Sequence[str]) -> list[str]:
    value = os.environ.get(env)
    if value:
        words = shlex.split(value)
        if shutil.which(words[0]) is None:
            raise CannRootError(f"${env}={value!r} is not an executable compiler")
        return words
    for name in candidates:
        if shutil.which(name):
            return [name]
    raise CannRootError(
        f"no {'C++' if env == 'CXX' else 'C'} compiler found (tried {', '.join(candidates)}; set "
        f"${env}): kvdd cann-root compiles the root's libraries with the system compiler "
        "(Debian/Ubuntu: apt-get install g++)")


def _run(cmd: list[str]) -> None:
    logger.debug("running %s", shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CannRootError(f"compiling failed: {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")


def _build(out: Path, cxx11_abi: int) -> None:
    """Compile the five libraries of the root into ``out/lib64``."""
    src = package_dir() / "src"
    lib = out / "lib64"
    cxx = _compiler("CXX", ("g++", "c++", "clang++"))
    cc = _compiler("CC", ("gcc", "cc", "clang"))
    py_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_include, "Python.h")):
        raise CannRootError(f"Python.h not found in {py_include}: install this Python's development "
                            "headers (Debian/Ubuntu: apt-get install python3-dev)")
    common = ["-O2", "-g", "-fPIC", "-Wall", "-Wextra", "-shared", "-I", str(out / "include")]
    cxxflags = [*cxx, "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}", *common]
    rpath = "-Wl,-rpath,$ORIGIN"

    def soname(name: str) -> list[str]:
        return [f"-Wl,-soname,{name}", "-o", str(lib / name)]

    # libmetadef and libascendcl first: the others link them.
    first = [
        [*cxxflags, str(src / "ascend_string.cc"), *soname("libmetadef.so")],
        [*cxxflags, "-fvisibility=hidden", str(src / "ascendcl.cc"), *soname("libascendcl.so")],
    ]
    # Python symbols stay undefined (no -lpython): they come from the process (see llm_datadist.cc).
    second = [
        [*cxxflags, "-I", str(src), str(src / "llm_datadist.cc"), "-L", str(lib), "-lascendcl",
         "-lmetadef", "-ldl", rpath, *soname("libllm_datadist.so")],
        [*cxxflags, "-fvisibility=hidden", "-I", str(src), "-I", py_include, str(src / "bridge.cc"),
         "-L", str(lib), "-lmetadef", rpath, *soname("libkvdd_simbridge.so")],
        [*cc, "-std=c11", *common, "-fvisibility=hidden", "-I", py_include, str(src / "pyembed.c"),
         *soname("libkvdd_pyembed.so")],
    ]
    with ThreadPoolExecutor(max_workers=max(1, min(3, os.cpu_count() or 1))) as pool:
        for wave in (first, second):
            for future in [pool.submit(_run, cmd) for cmd in wave]:
                future.result()


#: the type stub of the root's ``llm_datadist`` package (PEP 561: it ships ``py.typed`` too)
PACKAGE_STUB = """\
# Type checkers see `import llm_datadist` in this simulated CANN root as kvdd's simulator of CANN's
# package (kvdd.llm_datadist), which the __init__.py next to this file loads at run time.
from kvdd.llm_datadist import *
from kvdd.llm_datadist import v2_list as v2_list
"""


def _render(template: str, values: dict[str, str]) -> str:
    text = (package_dir() / "templates" / template).read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def write_root(dest: str | os.PathLike[str], *, cxx11_abi: int = 0, force: bool = False) -> Path:
    """Write kvdd's simulated CANN root into ``dest`` and return its absolute path.

    Parameters
    ----------
    dest
        The root directory. Created if missing; an existing simulated root is replaced (programs
        that have the old libraries loaded keep them); another non-empty directory only with
        ``force``; a real CANN install never.
    cxx11_abi
        ``_GLIBCXX_USE_CXX11_ABI`` of the C++ libraries (0, CANN's setting, or 1); programs and
        kvdd's native build must use the same.
    force
        Write into a non-empty directory that is neither a simulated root nor a CANN install.

    Raises
    ------
    CannRootError
        ``dest`` is a real CANN install or a non-empty directory, no compiler or Python headers
        were found, or compiling failed.
    """
    if cxx11_abi not in (0, 1):
        raise CannRootError(f"cxx11_abi must be 0 or 1, not {cxx11_abi!r}")
    root = Path(os.path.abspath(os.fspath(dest)))
    if root.exists():
        if not root.is_dir():
            raise CannRootError(f"{root} exists and is not a directory")
        sign = _real_cann_sign(root)
        if sign is not None:
            raise CannRootError(f"{root} looks like a real CANN install (it has {sign}); kvdd "
                                "cann-root never writes over one: choose another directory")
        if not is_simulated_root(root) and any(root.iterdir()) and not force:
            raise CannRootError(f"{root} is a non-empty directory that is not a kvdd simulated "
                                "root; choose an empty or new directory, or pass --force")
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{root.name}.kvdd-", dir=root.parent))
    try:
        shutil.copytree(package_dir() / "include", work / "include")
        (work / "lib64").mkdir()
        (work / "share" / "cmake" / "LlmDataDist").mkdir(parents=True)
        _build(work, cxx11_abi)
        python = sys.executable
        values = {"VERSION": __version__, "PYTHON": shlex.quote(python),
                  "CXX11_ABI": str(cxx11_abi)}
        (work / "set_env.sh").write_text(_render("set_env.sh.in", values), encoding="utf-8")
        package = work / "python" / "site-packages" / "llm_datadist"
        package.mkdir(parents=True)
        written_by = repr(f"kvdd {__version__} for {python}")
        (package / "__init__.py").write_text(
            _render("llm_datadist_init.py.in", {"WRITTEN_BY": written_by}), encoding="utf-8")
        # type checkers cannot follow the module swap above: a stub and the PEP 561 marker make
        # `mypy --strict` of client code see kvdd.llm_datadist's types under `llm_datadist`
        (package / "__init__.pyi").write_text(PACKAGE_STUB, encoding="utf-8")
        (package / "py.typed").write_text("", encoding="utf-8")
        (work / "share" / "cmake" / "LlmDataDist" / "LlmDataDistConfig.cmake").write_text(
            _render("LlmDataDistConfig.cmake.in", values), encoding="utf-8")
        marker = {
            "kvdd_simulated_root": "1",
            "kvdd_version": __version__,
            "sources_sha256": sources_digest(),
            "python": python,
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "libpython": _libpython(),
            "kvdd_package": str(Path(__file__).resolve().parent.parent),
            "cxx11_abi": str(cxx11_abi),
        }
        (work / MARKER_NAME).write_text(
            "# kvdd's simulated CANN root (not a CANN install), written by `kvdd cann-root`\n"
            + "".join(f"{k}={v}\n" for k, v in marker.items()), encoding="utf-8")
        work.chmod(0o755)
        old = None
        if root.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
            os.rename(root, old / "root")
        os.rename(work, root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return root


def add_cann_root_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvdd cann-root``."""
    parser.add_argument("dest", help="directory of the root (created; an old simulated root there is replaced)")
    parser.add_argument("--cxx11-abi", type=int, choices=(0, 1), default=0,
                        help="_GLIBCXX_USE_CXX11_ABI of the C++ libraries (default 0, CANN's)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty directory that is not a simulated root "
                             "(never into a real CANN install)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``kvdd cann-root``; exit status 0 on success, 1 with a message on stderr otherwise."""
    try:
        root = write_root(args.dest, cxx11_abi=args.cxx11_abi, force=args.force)
    except CannRootError as exc:
        print(f"kvdd cann-root: {exc}", file=sys.stderr)
        return 1
    libpython = _libpython()
    print(f"kvdd simulated CANN root written to {root} (kvdd {__version__}, {sys.executable})")
    if not libpython:
        print("warning: this Python has no shared libpython, so C++ programs cannot start the "
              "simulator on this root (kvdd's own native build can); use a Python built with "
              "--enable-shared", file=sys.stderr)
    print("next:")
    print(f"  source {shlex.quote(str(root / 'set_env.sh'))}")
    print("  kvdd doctor                 # which llm_datadist `import llm_datadist` loads")
    print("  python my_connector.py      # Python: `import llm_datadist` is the simulator")
    print("  g++ -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=%d -I$ASCEND_HOME_PATH/include prog.cpp "
          "-L$ASCEND_HOME_PATH/lib64 -lllm_datadist -lmetadef -lascendcl -lpthread"
          "   # C++" % args.cxx11_abi)
    return 0
