"""``examples/prefill.py`` and ``examples/decode.py`` (README, *Across processes and hosts*) as a
user runs them: two processes that move and verify blocks, and a prefill that refuses to start
with a fabric secret no decode could ever authenticate against (instead of failing at link time)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdd.cli import main as cli_main
from kvdd.sim.fabric import ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE, SecretError, load_secret

from demo_support import child_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _env(**extra: str) -> dict[str, str]:
    """A child's environment: the kvdd under test, no fabric settings but ``extra``."""
    env = {k: v for k, v in child_env().items() if k not in (ENV_SECRET, ENV_SECRET_FILE, ENV_AUTH)}
    return env | extra


def _missing(p: Path) -> None:
    """Nothing at the path."""


def _empty(p: Path) -> None:
    p.write_bytes(b"")
    p.chmod(0o600)


def _too_short(p: Path) -> None:
    p.write_text(os.urandom(8).hex())  # 8 bytes decoded; 16 are needed
    p.chmod(0o600)


def _world_readable(p: Path) -> None:
    p.write_text(os.urandom(32).hex())
    p.chmod(0o644)


@pytest.mark.parametrize("make, says", [
    (_missing, "No such file or directory"),
    (_empty, "holds 0 bytes"),
    (_too_short, "holds 8 bytes; at least 16"),
    (_world_readable, "accessible by group or others"),
], ids=["missing", "empty", "too-short", "world-readable"])
def test_prefill_with_an_unusable_secret_file_fails_at_start(
        make: Callable[[Path], None], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "fabric.secret"
    make(secret)
    for name in (ENV_SECRET, ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_SECRET_FILE, str(secret))
    with pytest.raises(SecretError) as info:  # the library's check, and its message
        load_secret()
    reason = str(info.value)
    assert says in reason

    proc = subprocess.run([sys.executable, str(EXAMPLES / "prefill.py")], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, env=_env(**{ENV_SECRET_FILE: str(secret)}))
    assert proc.returncode == 1
    assert proc.stdout == ""  # no port: nobody is told to connect to a prefill that cannot authenticate
    assert proc.stderr == f"examples/prefill.py: FAILED: no usable fabric secret: {reason}\n"

    # `kvdd demo --role prefill` refuses the same file with the same reason.
    assert cli_main(["demo", "--role", "prefill", "--quick", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kvdd demo: FAILED: no usable secret for the control channel: {reason}\n"


def test_prefill_and_decode_examples_move_and_verify_blocks() -> None:
    env = _env(**{ENV_SECRET: os.urandom(32).hex()})
    prefill = subprocess.Popen([sys.executable, str(EXAMPLES / "prefill.py")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert prefill.stdout is not None and prefill.stdin is not None
        port, cache_id = prefill.stdout.readline().split()
        decode = subprocess.run([sys.executable, str(EXAMPLES / "decode.py"), port, cache_id],
                                capture_output=True, text=True, timeout=120, env=env)
        assert decode.returncode == 0, decode.stderr
        assert decode.stdout == "pulled 2 blocks x 4 tensors from the prefill process, bytes verified\n"
        out, err = prefill.communicate("\n", timeout=60)
        assert prefill.returncode == 0, err
        assert out == ""
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
