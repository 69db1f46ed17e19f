"""Where the fabric secret comes from, and which files are refused (kvdd.sim.fabric.auth)."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from kvdd.sim.fabric import auth


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (auth.ENV_SECRET, auth.ENV_SECRET_FILE, auth.ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)


def test_env_secret_hex_and_base64(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = os.urandom(24)
    for text in (raw.hex(), base64.b64encode(raw).decode()):
        monkeypatch.setenv(auth.ENV_SECRET, text)
        secret = auth.load_secret()
        assert secret.key == raw and secret.source == f"env {auth.ENV_SECRET}"
    monkeypatch.setenv(auth.ENV_SECRET, os.urandom(8).hex())
    with pytest.raises(auth.SecretError, match="at least 16 are needed"):
        auth.load_secret()
    monkeypatch.setenv(auth.ENV_SECRET, "not a secret!")
    with pytest.raises(auth.SecretError, match="neither hex nor base64"):
        auth.load_secret()


def test_generated_secret_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    text = auth.generate_secret()
    assert len(bytes.fromhex(text)) == 32
    monkeypatch.setenv(auth.ENV_SECRET, text)
    assert auth.load_secret().key == bytes.fromhex(text)


def test_automatic_per_user_file(tmp_path: Path) -> None:
    """Created on first use under $XDG_RUNTIME_DIR/kvdd, mode 0600, 32 bytes; read back after."""
    path = auth.default_secret_path()
    assert path == tmp_path / "run" / "kvdd" / "fabric.secret"
    with pytest.raises(auth.SecretError, match="created on the first link"):
        auth.load_secret(create=False)
    first = auth.load_secret()
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert len(first.key) == 32 and auth.load_secret().key == first.key
    assert "per-user" in auth.describe_secret()


def test_group_readable_or_symlinked_files_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_text(os.urandom(32).hex())
    f.chmod(0o640)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.load_secret()
    f.chmod(0o600)
    assert len(auth.load_secret().key) == 32
    # an attacker's symlink where the automatic file would be: refused, its target untouched
    monkeypatch.delenv(auth.ENV_SECRET_FILE)
    target = tmp_path / "target"
    target.write_bytes(b"")
    path = auth.default_secret_path()
    path.parent.mkdir(mode=0o700)
    path.symlink_to(target)
    with pytest.raises(auth.SecretError, match="symbolic link"):
        auth.load_secret()
    assert target.read_bytes() == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file owned by someone else")
def test_file_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_bytes(os.urandom(32))
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    with pytest.raises(auth.SecretError, match="belongs to uid 65534"):
        auth.load_secret()


def test_auth_off_is_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV_AUTH, "off")
    secret = auth.load_secret()
    assert secret.auth_off and secret.source == "off"
    assert "OFF" in auth.describe_secret()


def test_macs_bind_role_nonces_and_transcript() -> None:
    key, a, b, t = os.urandom(32), os.urandom(32), os.urandom(32), os.urandom(32)
    base = auth.mac(key, "initiator", a, b, t)
    assert base != auth.mac(key, "acceptor", a, b, t)  # no reflection
    assert base != auth.mac(key, "initiator", b, a, t)  # both nonces, in their places
    assert base != auth.mac(key, "initiator", a, b, os.urandom(32))
    assert base != auth.mac(os.urandom(32), "initiator", a, b, t)
    assert len(auth.session_key(key, a, b, t)) == 32


def test_a_mac_and_a_session_key_change_with_each_nonce_alone() -> None:
    key, a, b, t = os.urandom(32), os.urandom(32), os.urandom(32), os.urandom(32)
    for role in ("initiator", "acceptor"):
        base = auth.mac(key, role, a, b, t)
        assert base != auth.mac(key, role, os.urandom(32), b, t)  # the initiator's nonce
        assert base != auth.mac(key, role, a, os.urandom(32), t)  # the acceptor's nonce
    base = auth.session_key(key, a, b, t)
    assert base != auth.session_key(key, os.urandom(32), b, t)
    assert base != auth.session_key(key, a, os.urandom(32), t)
    assert base != auth.session_key(key, a, b, os.urandom(32))
