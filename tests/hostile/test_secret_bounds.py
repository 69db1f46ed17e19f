"""Where the fabric secret may live, and what reading it costs, at the bounds (docs/security.md,
*The secret*; :mod:`kvdd.sim.fabric.secret`).

Each test names a rule and sits on its boundary, so a check weakened by one, or skipped, fails:

* a directory on the way to the secret is refused when others can write it: a symbolic link that
  lies in such a directory, or that leads to one, is no way around it; a sticky directory such
  as ``/tmp`` is fine above the secret's own directory, never as that directory's parent itself;
* ``$XDG_RUNTIME_DIR`` is used only when it is an absolute path to a real directory of this user,
  not world-writable; anything else falls back to ``~/.config``;
* a secret file holds at most 4096 bytes; exactly 32 bytes are the raw key, even when they are text;
* a secret of all zero bytes, a FIFO (even with a secret in it), a secret directory of any mode but
  exactly 0700, and a symbolic link of another user on the way are refused; a file made readable by
  others after it was read is refused on the next call (what was kept is not used);
* while nothing changes, the per-user secret costs three ``lstat`` calls and no ``open`` per call;
  a rewritten file is read again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdd.sim.fabric import auth, secret


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No secret configured; HOME is ``tmp_path/home`` (0700); XDG_RUNTIME_DIR unset."""
    for name in (auth.ENV_SECRET, auth.ENV_SECRET_FILE, auth.ENV_AUTH, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    tmp_path.chmod(0o700)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    return tmp_path


def _dir(path: Path, mode: int) -> Path:
    path.mkdir(parents=True)
    path.chmod(mode)
    return path


# ---- world-writable directories on the way ----------------------------------------------------------


def test_a_link_lying_in_a_world_writable_directory_is_refused(env: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # another user could replace the link (no sticky bit): its real target being ours is no help
    real = _dir(env / "real" / "home", 0o700)
    shared = _dir(env / "shared", 0o777)
    (shared / "home").symlink_to(real)
    monkeypatch.setenv("HOME", str(shared / "home"))
    with pytest.raises(auth.SecretError, match="lies under a world-writable directory"):
        auth.load_secret()
    assert not (real / ".config" / "kvdd" / "fabric.secret").exists()


def test_a_runtime_directory_inside_a_sticky_world_writable_directory_is_used(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # like /tmp/<user>: others cannot rename what the sticky directory holds
    runtime = _dir(_dir(env / "sticky", 0o1777) / "run", 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert auth.default_secret_path() == runtime / "kvdd" / "fabric.secret"
    key = auth.load_secret().key
    assert (runtime / "kvdd" / "fabric.secret").read_bytes() == key


def test_a_directory_linked_to_a_sticky_world_writable_directory_is_refused(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ~/.config -> a directory like /tmp: the secret's directory would lie right in it
    sticky = _dir(env / "sticky", 0o1777)
    (env / "home" / ".config").symlink_to(sticky)
    with pytest.raises(auth.SecretError, match="lies under a world-writable directory"):
        auth.load_secret()
    assert not (sticky / "kvdd" / "fabric.secret").exists()


@pytest.mark.parametrize("kind", ["used", "missing", "relative", "a file", "a symbolic link",
                                  "world-writable", "another user's"])
def test_runtime_directory_is_used_only_when_it_is_a_private_directory_of_ours(
        env: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    runtime = env / "run"
    if kind == "used":
        _dir(runtime, 0o700)
    elif kind == "relative":
        _dir(runtime, 0o700)
        monkeypatch.chdir(env)
        runtime = Path("run")
    elif kind == "a file":
        runtime.write_bytes(b"")
    elif kind == "a symbolic link":
        runtime.symlink_to(_dir(env / "real-run", 0o700))
    elif kind == "world-writable":
        _dir(runtime, 0o777)
    elif kind == "another user's":
        if os.geteuid() != 0:
            pytest.skip("needs root to make a directory owned by someone else")
        _dir(runtime, 0o700)
        os.chown(runtime, 12345, 12345)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    fallback = env / "home" / ".config" / "kvdd" / "fabric.secret"
    want = runtime / "kvdd" / "fabric.secret" if kind == "used" else fallback
    assert auth.default_secret_path() == want


# ---- the secret's own directory and file --------------------------------------------------------------


def test_a_secret_directory_that_is_a_symbolic_link_is_refused_as_such(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _dir(env / "run", 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    (runtime / "kvdd").symlink_to(_dir(env / "elsewhere", 0o700))
    with pytest.raises(auth.SecretError, match="kvdd is not a directory \\(a symbolic link\\?\\); "
                       "refusing it"):
        auth.load_secret()
    assert list((env / "elsewhere").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by someone else")
def test_a_secret_directory_of_another_user_is_refused(env: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _dir(env / "run", 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    theirs = _dir(runtime / "kvdd", 0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(auth.SecretError, match="kvdd belongs to uid 12345, not to this user"):
        auth.load_secret()
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("source", ["file", "automatic"])
def test_a_secret_file_that_is_a_symbolic_link_is_refused_as_such(
        env: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    target = env / "target"
    target.write_bytes(os.urandom(32))
    target.chmod(0o600)
    if source == "file":
        link = env / "secret"
        monkeypatch.setenv(auth.ENV_SECRET_FILE, str(link))
    else:
        runtime = _dir(env / "run", 0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        link = _dir(runtime / "kvdd", 0o700) / "fabric.secret"
    link.symlink_to(target)
    with pytest.raises(auth.SecretError, match=f"secret file {link} is a symbolic link; refusing it"):
        auth.load_secret()


# ---- what a secret file may hold ----------------------------------------------------------------------


@pytest.mark.parametrize("size,ok", [(4096, True), (4097, False)])
def test_a_secret_file_holds_at_most_4096_bytes(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                size: int, ok: bool) -> None:
    key = os.urandom(32)
    f = env / "secret"
    f.write_bytes(key.hex().encode().ljust(size, b"\n"))  # hex text, then blank lines
    f.chmod(0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    if ok:
        assert auth.load_secret().key == key
    else:
        with pytest.raises(auth.SecretError, match="is larger than 4096 bytes"):
            auth.load_secret()


@pytest.mark.parametrize("text,key", [
    (b"0123456789abcdef0123456789abcdef", b"0123456789abcdef0123456789abcdef"),  # 32: raw
    (b"0123456789abcdef0123456789abcdef\n", bytes.fromhex("0123456789abcdef" * 2)),  # 33: text
    (b"00112233445566778899aabbccddee", None),  # 30 bytes of hex: 15 bytes, too short
])
def test_a_32_byte_secret_file_is_the_raw_key_even_when_it_is_text(
        env: Path, monkeypatch: pytest.MonkeyPatch, text: bytes, key: bytes | None) -> None:
    f = env / "secret"
    f.write_bytes(text)
    f.chmod(0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    if key is not None:
        assert auth.load_secret().key == key
    else:
        with pytest.raises(auth.SecretError, match="holds 15 bytes; at least 16"):
            auth.load_secret()


# ---- what reading the per-user secret costs -------------------------------------------------------------


def test_the_per_user_secret_costs_three_lstat_calls_and_no_open_while_unchanged(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _dir(env / "run", 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    path = runtime / "kvdd" / "fabric.secret"
    first = auth.load_secret().key  # created
    assert path.read_bytes() == first
    assert auth.load_secret().key == first  # (creating kvdd/ changed the runtime directory)
    lstats: list[str] = []
    opens: list[str] = []
    real_lstat, real_open = os.lstat, os.open

    def counting_lstat(p: object, *args: object, **kw: object) -> os.stat_result:
        lstats.append(str(p))
        return real_lstat(p, *args, **kw)  # type: ignore[arg-type]

    def counting_open(p: object, *args: object, **kw: object) -> int:
        opens.append(str(p))
        return real_open(p, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", counting_lstat)
    monkeypatch.setattr(os, "open", counting_open)
    for _ in range(100):
        assert auth.load_secret().key == first
    # the runtime directory (the path), the secret's directory and the file: one lstat each
    assert len(lstats) == 300 and set(lstats) == {str(runtime), str(path.parent), str(path)}
    assert opens == []
    second = os.urandom(32)
    path.write_bytes(second)  # rewritten (same size): read again on the next call
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert auth.load_secret().key == second
    assert opens == [str(path)]
    assert secret.load_secret() == auth.load_secret()


_FIRST_CALL = ("from kvdd.sim.fabric.auth import load_secret; s = load_secret(); "
               "print(s.source); print(s.key.hex())")


@pytest.mark.parametrize("source", ["env", "automatic"])
def test_the_first_call_of_a_process_reads_the_secret(env: Path, source: str) -> None:
    """Nothing is kept yet in a new process: its first call reads the source."""
    environ = dict(os.environ)
    if source == "env":
        key = os.urandom(32)
        environ[auth.ENV_SECRET] = key.hex()
        want = f"env {auth.ENV_SECRET}"
    else:
        runtime = _dir(env / "run", 0o700)
        environ["XDG_RUNTIME_DIR"] = str(runtime)
        path = runtime / "kvdd" / "fabric.secret"
        want = f"file {path} (per-user, automatic)"
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=environ, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if source == "automatic":
        key = path.read_bytes()
    assert out.stdout.split("\n")[:2] == [want, key.hex()]


# ---- what else a secret source must be -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["env", "file"])
def test_a_secret_of_all_zero_bytes_is_refused(env: Path, monkeypatch: pytest.MonkeyPatch,
                                               how: str) -> None:
    if how == "env":
        monkeypatch.setenv(auth.ENV_SECRET, bytes(32).hex())
        where = f"\\${auth.ENV_SECRET}"
    else:
        f = env / "secret"
        f.write_bytes(bytes(32))  # raw, as the automatic file holds a key
        f.chmod(0o600)
        monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
        where = f"secret file {f}"
    with pytest.raises(auth.SecretError, match=f"{where} is all zero bytes, not a secret"):
        auth.load_secret()


def test_a_fifo_is_refused_as_such_even_with_a_secret_waiting_in_it(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = env / "secret"
    os.mkfifo(fifo, 0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(fifo))
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # (a writer holds it open)
    try:
        os.write(writer, os.urandom(32).hex().encode())
        with pytest.raises(auth.SecretError,
                           match=f"secret file {fifo} is not a regular file \\(a FIFO\\)"):
            auth.load_secret()
    finally:
        os.close(writer)


@pytest.mark.parametrize("mode", [0o500, 0o300, 0o1700, 0o2700], ids=lambda m: f"{m:o}")
def test_the_secret_directory_must_have_mode_exactly_700(env: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         mode: int) -> None:
    runtime = _dir(env / "run", 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    d = _dir(runtime / "kvdd", mode)
    with pytest.raises(auth.SecretError, match=f"kvdd has mode {mode:o}, not 700"):
        auth.load_secret(create=False)
    d.chmod(0o700)
    with pytest.raises(auth.SecretError, match="is created on the first link"):
        auth.load_secret(create=False)  # the same directory at 0700 passes that check


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a link owned by someone else")
def test_a_symbolic_link_of_another_user_on_the_way_is_refused(env: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Its owner could point it elsewhere at any time: what it leads to is not judged."""
    real = _dir(env / "real-home", 0o700)
    link = env / "home-link"
    link.symlink_to(real)
    monkeypatch.setenv("HOME", str(link))
    os.lchown(link, 12345, 12345)
    with pytest.raises(auth.SecretError, match="lies under a world-writable directory"):
        auth.load_secret()
    assert not (real / ".config" / "kvdd" / "fabric.secret").exists()
    os.lchown(link, os.geteuid(), os.getegid())  # ours: its target is judged, and it passes
    assert len(auth.load_secret().key) == 32


def test_a_secret_file_made_readable_by_others_after_it_was_read_is_refused(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = env / "secret"
    key = os.urandom(32)
    f.write_bytes(key.hex().encode())
    f.chmod(0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    assert auth.load_secret().key == key
    f.chmod(0o644)
    with pytest.raises(auth.SecretError, match="is accessible by group or others \\(mode 644\\)"):
        auth.load_secret()
    f.chmod(0o600)
    other = os.urandom(32)
    f.write_bytes(other.hex().encode())  # rewritten: the new secret, not the one kept
    os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert auth.load_secret().key == other
