"""kvdd's pytest plugin (kvdd.testing.pytest_plugin) as a user's suite sees it: options, fixtures
in both peer modes, the simulator-only marker, fault injection and the leak checks.

Each case writes a small test file and runs pytest on it in a child process, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvdd

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "testing"


def _pytest(where: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("KVDD_BACKEND", "KVDD_PEER", "KVDD_SIM_FAULTS")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=where, env=full, capture_output=True, text=True, timeout=300)


def _write(where: Path, text: str) -> Path:
    path = where / "test_case.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_the_example_suite_passes_in_both_peer_modes(mode: str) -> None:
    r = _pytest(EXAMPLES, "--kvdd-peer", mode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 passed" in r.stdout


def test_the_peer_really_is_another_process(tmp_path: Path) -> None:
    _write(tmp_path, """
import os
def test_where(kvdd_peer):
    peer = kvdd_peer(1)
    assert (getattr(peer, "pid", os.getpid()) != os.getpid()) == (PROCESS == "1")
""".replace("PROCESS", "__import__('os').environ['EXPECT_PROCESS']"))
    assert _pytest(tmp_path, "--kvdd-peer", "process", env={"EXPECT_PROCESS": "1"}).returncode == 0
    assert _pytest(tmp_path, env={"EXPECT_PROCESS": "0"}).returncode == 0
    assert _pytest(tmp_path, env={"EXPECT_PROCESS": "1", "KVDD_PEER": "process"}).returncode == 0


def test_backend_selection(tmp_path: Path) -> None:
    _write(tmp_path, "def test_b(kvdd_backend):\n    print('BACKEND', kvdd_backend)\n")
    r = _pytest(tmp_path, "-s", "--kvdd-backend", "sim")
    assert r.returncode == 0 and r.stdout.count("BACKEND sim") == 1
    r = _pytest(tmp_path, "-s")  # all available
    assert r.returncode == 0
    assert sum(r.stdout.count(f"BACKEND {b}") for b in kvdd.available_backends()) == len(kvdd.available_backends())
    if "native" not in kvdd.available_backends():
        r = _pytest(tmp_path, "--kvdd-backend", "native")
        assert r.returncode != 0 and "kvdd backend 'native' is not available" in r.stdout + r.stderr
    r = _pytest(tmp_path, env={"KVDD_BACKEND": "nonsense"})
    assert r.returncode != 0 and "choose sim, native or all" in r.stdout + r.stderr


def test_a_test_without_kvdd_fixtures_is_untouched(tmp_path: Path) -> None:
    _write(tmp_path, "import socket\nS = []\ndef test_plain():\n"
                     "    s = socket.create_server(('127.0.0.1', 0)); S.append(s)\n")
    r = _pytest(tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout


def test_sim_only_marker(tmp_path: Path) -> None:
    _write(tmp_path, "import pytest\n@pytest.mark.kvdd_sim_only('needs faults')\n"
                     "def test_s(kvdd_backend):\n    assert kvdd_backend == 'sim'\n")
    r = _pytest(tmp_path, "-rs")
    assert r.returncode == 0
    if "native" in kvdd.available_backends():
        assert "simulator only: needs faults" in r.stdout


def test_faults_are_removed_after_the_test(tmp_path: Path) -> None:
    _write(tmp_path, """
import kvdd
from kvdd.sim import faults
def test_inject(kvdd_faults):
    kvdd_faults.inject("link", status="LLM_LINK_FAILED")
    assert len(faults.active()) == 1
def test_after():
    assert faults.active() == ()
""")
    r = _pytest(tmp_path, "-p", "no:randomly")
    assert r.returncode == 0, r.stdout + r.stderr


LEAKS = {
    "listener": ("dd = kvdd.LlmDataDist(5, kvdd.LlmRole.PROMPT)\n"
                 "    dd.initialize({'llm.DeviceId': '0', 'llm.ListenIpInfo': '127.0.0.1:0'})\n"
                 "    KEEP.append(dd)", "listening socket(s) still open"),
    "process": ("import subprocess, sys\n"
                "    KEEP.append(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']))",
                "child process(es) still running"),
    "thread": ("import threading, time\n"
               "    t = threading.Thread(target=time.sleep, args=(30,), name='kvdd-test-straggler', daemon=True)\n"
               "    t.start()", "kvdd threads still running: kvdd-test-straggler"),
}


def test_leaks_fail_the_test_and_say_what_leaked(tmp_path: Path) -> None:
    cases = "".join(f"""
def test_leaks_{name}(kvdd_instance):
    kvdd_instance(1)
    {code}
""" for name, (code, _what) in LEAKS.items())
    _write(tmp_path, "import kvdd\nKEEP = []\n" + cases + "\ndef test_clean(kvdd_instance):\n    kvdd_instance(1)\n")
    r = _pytest(tmp_path, "-p", "no:randomly")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "4 passed" in r.stdout and "3 errors" in r.stdout, r.stdout  # errors at tear-down
    sections = r.stdout.split("ERROR at teardown of ")
    for name, (_code, what) in LEAKS.items():
        section = next(s for s in sections if s.startswith(f"test_leaks_{name}"))
        assert "kvdd leak check" in section and what in section, section
    r = _pytest(tmp_path, "--kvdd-no-leak-check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_instances_are_finalized_at_tear_down(tmp_path: Path) -> None:
    _write(tmp_path, """
import kvdd
MADE = []
def test_make(kvdd_instance):
    MADE.append(kvdd_instance(1))
    assert MADE[0].listening_port > 0
def test_check():
    import pytest
    with pytest.raises(kvdd.LLMError):  # finalized: LLM_FAILED
        MADE[0].register_kv_cache(kvdd.CacheDesc(1, kvdd.DataType.DT_UINT8, (1, 8)), [1])
""")
    r = _pytest(tmp_path, "-p", "no:randomly")
    assert r.returncode == 0, r.stdout + r.stderr
