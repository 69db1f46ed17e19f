"""``examples/decode.py`` ends in one clear line, never a traceback, when it cannot link: another
fabric secret than prefill's, or no prefill on the port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from demo_support import child_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SECRET_VARS = ("KVDD_FABRIC_SECRET", "KVDD_FABRIC_SECRET_FILE", "KVDD_FABRIC_AUTH")


def _env(secret: str) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if k not in SECRET_VARS}
    env["KVDD_FABRIC_SECRET"] = secret
    return env


def _decode(port: str, cache_id: str, secret: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / "decode.py"), port, cache_id], capture_output=True,
                          text=True, timeout=120, env=_env(secret))


def test_another_secret_is_one_line() -> None:
    prefill = subprocess.Popen([sys.executable, str(EXAMPLES / "prefill.py")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_env(os.urandom(32).hex()))
    try:
        assert prefill.stdout is not None
        port, cache_id = prefill.stdout.readline().split()
        out = _decode(port, cache_id, os.urandom(32).hex())
        assert out.returncode == 1 and out.stdout == ""
        [line] = out.stderr.splitlines()
        assert line.startswith(f"examples/decode.py: FAILED: cannot link to prefill at 127.0.0.1:{port}: "
                               "LLM_LINK_FAILED")
        assert "different fabric secrets" in line and "KVDD_FABRIC_SECRET" in line
    finally:
        prefill.communicate("\n", timeout=60)


def test_no_prefill_on_the_port_is_one_line() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = _decode(port, "1", os.urandom(32).hex())
    assert out.returncode == 1 and out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith(f"examples/decode.py: FAILED: cannot link to prefill at 127.0.0.1:{port}: LLM_LINK_FAILED")
