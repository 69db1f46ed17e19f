"""``kvdd cann-root``: the simulated CANN root, used from C++ programs and from Python.

The root is written once per session (it compiles five libraries: about 15-30 s); the C++ checks
run ``probe.cpp`` (next to this file) as a plain C++ process, so they exercise the path a CANN
program takes: no interpreter in the process, libpython loaded and started by libllm_datadist.so.
Skipped, with the reason, where no C++ compiler or Python headers are available.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdd import __version__
from kvdd.backend import looks_like_ascend_node
from kvdd.cann import MARKER_NAME, is_simulated_root, read_marker, root_problem, sources_digest
from kvdd.cann.root import CannRootError, write_root
from kvdd.cli import main as kvdd_main

from .conftest import CXX, HERE, LIBS

def _run(probe: Path, root: Path, mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVDD_"))}
    environ.update(LD_LIBRARY_PATH=str(root / "lib64"), ASCEND_HOME_PATH=str(root), **env)
    return subprocess.run([str(probe), mode], capture_output=True, text=True, env=environ,
                          timeout=120, check=False)


def _copy_with_marker(root: Path, dest: Path, **changes: str) -> Path:
    shutil.copytree(root, dest, symlinks=True)
    marker = read_marker(dest)
    marker.update(changes)
    (dest / MARKER_NAME).write_text("".join(f"{k}={v}\n" for k, v in marker.items()))
    return dest


# ---- layout and marker ---------------------------------------------------------------------------

def test_layout(root: Path) -> None:
    for header in ("llm_datadist/llm_datadist.h", "ge/llm_error_codes.h", "ge/llm_engine_types.h",
                   "acl/acl.h", "graph/ascend_string.h", "graph/types.h", "graph/tensor.h",
                   "exe_graph/runtime/shape.h", "exe_graph/runtime/tensor.h",
                   "utils/extern_math_util.h", "external/ge_common/ge_api_types.h",
                   "external/ge_common/api_error_codes.h",
                   "external/ge_common/ge_api_error_codes.h"):
        assert (root / "include" / header).is_file(), header
    # a CANN install has no llm_datadist/llm_error_codes.h (VENDOR.md)
    assert not (root / "include/llm_datadist/llm_error_codes.h").exists()
    for lib in LIBS:
        assert (root / "lib64" / lib).is_file(), lib
    assert (root / "share/cmake/LlmDataDist/LlmDataDistConfig.cmake").is_file()
    text = (root / "set_env.sh").read_text()
    assert "export ASCEND_HOME_PATH=" in text and "export LD_LIBRARY_PATH=" in text
    assert "export PYTHONHOME" not in text
    assert str(root) not in text  # the root is found from the script's own path
    assert (root / "python/site-packages/llm_datadist/__init__.py").is_file()


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")
def test_sonames_and_no_libpython(root: Path) -> None:
    for lib in LIBS:
        dynamic = subprocess.run(["readelf", "-d", str(root / "lib64" / lib)], capture_output=True,
                                 text=True, check=True).stdout
        assert f"Library soname: [{lib}]" in dynamic
        assert "libpython" not in dynamic  # loaded at run time only where no interpreter runs


def test_header_declares_only_canns_status_codes(root: Path) -> None:
    header = (root / "include/llm_datadist/llm_datadist.h").read_text()
    assert header.count("constexpr Status LLM_") == 18
    assert "LLM_ENGINE_FINALIZED" not in header and "LLM_REPEAT_REQUEST" not in header
    codes = (root / "include/ge/llm_error_codes.h").read_text()
    assert "constexpr Status LLM_ENGINE_FINALIZED" in codes
    assert codes.count("constexpr Status LLM_") == 28  # every code of API.md, as ge::LLM_*
    # reserved bytes have no default initializer, except RegisterCfg's (as in CANN)
    assert header.count("reserved[128] = {};") == 1 and "reserved[127] = {}" not in header


def test_marker_identifies_the_installation(root: Path) -> None:
    marker = read_marker(root)
    assert is_simulated_root(root)
    assert marker["kvdd_version"] == __version__
    assert marker["sources_sha256"] == sources_digest()
    assert os.access(marker["python"], os.X_OK)
    assert marker["cxx11_abi"] == "0"
    assert root_problem(root) is None


def test_stale_root_is_explained(root: Path, tmp_path: Path) -> None:
    old = _copy_with_marker(root, tmp_path / "old", kvdd_version="0.0.1")
    assert "written by kvdd 0.0.1" in (root_problem(old) or "")
    changed = _copy_with_marker(root, tmp_path / "changed", sources_sha256="0" * 64)
    assert "sources changed" in (root_problem(changed) or "")
    assert "not a kvdd simulated CANN root" in (root_problem(tmp_path) or "")


def test_refuses_a_real_cann_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libascendcl.so").write_bytes(b"")
    with pytest.raises(CannRootError, match="real CANN install"):
        write_root(tmp_path, force=True)
    assert kvdd_main(["cann-root", "--force", str(tmp_path)]) == 1
    assert "real CANN install" in capsys.readouterr().err
    assert (tmp_path / "lib64" / "libascendcl.so").read_bytes() == b""  # untouched


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CannRootError, match="non-empty"):
        write_root(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_missing_compiler_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(CannRootError, match="not an executable compiler"):
        write_root(tmp_path / "root")
    assert not (tmp_path / "root").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the work directory was removed


def test_simulated_root_is_not_an_ascend_node(root: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", str(root))
    davinci = bool(list(Path("/dev").glob("davinci*")))
    assert looks_like_ascend_node() is davinci
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))  # any other root does count
    assert looks_like_ascend_node() is True


def test_doctor_reports_the_root(root: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", str(root))
    assert kvdd_main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"(ASCEND_HOME_PATH): {root}, kvdd {__version__}" in out and "current" in out
    assert "is kvdd's simulated CANN root" in out


# ---- a plain C++ process --------------------------------------------------------------------------

def _assert_all_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("ok ") for line in lines), proc.stdout


@pytest.fixture(scope="module")
def _needs_shared_libpython(root: Path) -> None:
    if not read_marker(root).get("libpython"):
        pytest.skip("this Python has no shared libpython: C++ programs cannot start the simulator")


@pytest.mark.usefixtures("_needs_shared_libpython")
def test_cpp_program_pulls_blocks(probe: Path, root: Path) -> None:
    _assert_all_ok(_run(probe, root, "pull"))


@pytest.mark.usefixtures("_needs_shared_libpython")
def test_cpp_strict_reserved_mode(probe: Path, root: Path) -> None:
    _assert_all_ok(_run(probe, root, "strict", KVDD_CANN_STRICT_RESERVED="1"))
    # without the mode the same struct reaches the simulator and registers
    lax = _run(probe, root, "strict")
    assert "FAIL non-zero reserved byte" in lax.stdout


def test_cpp_acl_stand_in(probe: Path, root: Path) -> None:
    _assert_all_ok(_run(probe, root, "acl"))


def test_cpp_without_shared_libpython_fails_clearly(probe: Path, root: Path, tmp_path: Path) -> None:
    broken = _copy_with_marker(root, tmp_path / "root", libpython="")
    proc = _run(probe, broken, "broken")
    _assert_all_ok(proc)
    assert "no shared libpython" in proc.stderr and "returns LLM_FAILED" in proc.stderr


@pytest.mark.usefixtures("_needs_shared_libpython")
def test_cpp_on_a_stale_root_fails_clearly(probe: Path, root: Path, tmp_path: Path) -> None:
    stale = _copy_with_marker(root, tmp_path / "root", kvdd_version="0.0.1")
    proc = _run(probe, stale, "broken")
    _assert_all_ok(proc)
    assert "stale simulated CANN root" in proc.stderr and "kvdd cann-root" in proc.stderr


# ---- the ACL stand-in from Python (ctypes, as kvdd.testing uses it) --------------------------------

@pytest.fixture
def acl(root: Path) -> Iterator[ctypes.CDLL]:
    yield ctypes.CDLL(str(root / "lib64" / "libascendcl.so"))


def test_acl_through_ctypes(acl: ctypes.CDLL) -> None:
    acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    acl.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_int]
    acl.aclrtFree.argtypes = [ctypes.c_void_p]
    acl.aclGetRecentErrMsg.restype = ctypes.c_char_p
    assert acl.aclrtSetDevice(0) == 0
    dev = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(dev), 4096, 1) == 0 and dev.value is not None
    src = (ctypes.c_uint8 * 16)(*range(16))
    back = (ctypes.c_uint8 * 16)()
    assert acl.aclrtMemcpy(dev, 4096, ctypes.addressof(src), 16, 1) == 0  # host to device
    assert acl.aclrtMemcpy(ctypes.addressof(back), 16, dev, 16, 2) == 0  # device to host
    assert list(back) == list(range(16))
    assert acl.aclrtMemcpy(ctypes.addressof(back), 8, dev, 16, 2) == 100000  # destMax
    assert b"destMax" in (acl.aclGetRecentErrMsg() or b"")
    assert acl.aclrtFree(dev) == 0


# ---- a C++ program whose peer dies: SIGPIPE at its default action ---------------------------------

_SIGPIPE_PEER = """
import sys, time
import numpy as np
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.DeviceId": "0"})
mem = np.zeros(32 << 20, np.uint8)
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 32 << 20)), [int(mem.ctypes.data)])
print(dd.listen_port, cid, flush=True)
time.sleep(120)
"""


@pytest.mark.usefixtures("_needs_shared_libpython")
def test_cpp_program_survives_a_peer_that_dies_during_its_pushes(probe: Path, root: Path,
                                                                 tmp_path: Path) -> None:
    """The embedded interpreter leaves SIGPIPE at its default action (the C++ program keeps its
    handlers): a push's send to a peer that died raised it on the sending thread, which killed the
    program (exit 141 when it was the calling thread, the pool's otherwise) before its call could
    return a status.  The bridge blocks SIGPIPE on its threads; the sends fail with EPIPE."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVDD_"))}
    environ["KVDD_SIM_XPROC"] = "tcp"  # the sends go over the socket
    peer = subprocess.Popen([sys.executable, "-c", _SIGPIPE_PEER], stdout=subprocess.PIPE,
                            text=True, env=environ, cwd=tmp_path)  # (not the clone: installed kvdd)
    try:
        assert peer.stdout is not None
        port, cache_id = peer.stdout.readline().split()
        environ.update(LD_LIBRARY_PATH=str(root / "lib64"), ASCEND_HOME_PATH=str(root))
        prog = subprocess.Popen([str(probe), "sigpipe", port, cache_id], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=environ)
        assert prog.stdout is not None
        assert prog.stdout.readline().startswith("ok decoder Initialize")
        for line in iter(prog.stdout.readline, ""):
            if line.startswith("pushing"):
                break
        time.sleep(0.05)  # in the middle of a push
        peer.kill()
        out, err = prog.communicate(timeout=120)
        assert prog.returncode == 0, (prog.returncode, out, err[-2000:])
        assert "survived" in out and "FAIL" not in out
    finally:
        peer.kill()
        peer.wait()
