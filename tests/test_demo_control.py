"""The demo's control channel trusts no one: the fabric's challenge-response first, bounded lines,
stray connections refused while the prefill side keeps waiting (kvdd.demo.control)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdd.cli import main as cli_main
from kvdd.demo import (DEFAULT_MODEL, DemoError, DemoOptions, Geometry, control, resolve_model, run_decode,
                       run_demo)
from kvdd.demo.control import ReadyInfo
from kvdd.sim.fabric import (ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE, AuthError, Secret, authenticate_socket,
                             load_secret)

from demo_support import PrefillThread, prefill_thread

SECRET_A = os.urandom(32).hex()
SECRET_B = os.urandom(32).hex()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (ENV_SECRET, ENV_SECRET_FILE, ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_SECRET, SECRET_A)
    monkeypatch.setattr(control, "AUTH_TIMEOUT_S", 1.0)  # a silent stray costs 1 s, not 5


def quick() -> DemoOptions:
    return DemoOptions(geometry=Geometry(resolve_model(DEFAULT_MODEL), 1, 256), timeout=30.0)


# ---- the helper: authenticate a plain socket ------------------------------------------------------

def _pair(a: Secret, b: Secret, timeout: float = 2.0) -> tuple[Any, Any]:
    """Run initiator (secret ``a``) and acceptor (``b``) over a socketpair: (result_i, result_a)."""
    s1, s2 = socket.socketpair()
    out: dict[str, Any] = {}

    def side(name: str, sock: socket.socket, initiator: bool, secret: Secret) -> None:
        try:
            out[name] = authenticate_socket(sock, initiator=initiator, context=b"test/1", timeout=timeout,
                                            secret=secret)
        except AuthError as exc:
            out[name] = exc
        finally:
            if isinstance(out.get(name), AuthError):
                sock.close()

    threads = [threading.Thread(target=side, args=("i", s1, True, a)),
               threading.Thread(target=side, args=("a", s2, False, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    s1.close()
    s2.close()
    return out["i"], out["a"]


def test_authenticate_socket_same_secret_gives_one_session() -> None:
    secret = Secret(bytes.fromhex(SECRET_A), "test")
    si, sa = _pair(secret, secret)
    assert not isinstance(si, AuthError) and not isinstance(sa, AuthError)
    assert si.key == sa.key and si.transcript == sa.transcript and len(si.key) == 32
    assert si.initiator and not sa.initiator
    si2, _ = _pair(secret, secret)
    assert si2.key != si.key  # fresh nonces: another session key


def test_authenticate_socket_wrong_secret_refused_on_both_sides() -> None:
    si, sa = _pair(Secret(bytes.fromhex(SECRET_A), "a"), Secret(bytes.fromhex(SECRET_B), "b"))
    assert isinstance(si, AuthError) and isinstance(sa, AuthError)
    for exc in (si, sa):
        assert ENV_SECRET in str(exc)
        assert SECRET_A not in str(exc) and SECRET_B not in str(exc)


def test_authenticate_socket_auth_off_must_match() -> None:
    monkey = pytest.MonkeyPatch()
    with monkey.context() as m:
        m.setenv(ENV_AUTH, "off")
        off = load_secret()
    on = Secret(bytes.fromhex(SECRET_A), "a")
    si, sa = _pair(off, on)
    assert isinstance(si, AuthError) and isinstance(sa, AuthError)
    assert f"{ENV_AUTH}=off" in str(si) and f"{ENV_AUTH}=off" in str(sa)
    ok_i, ok_a = _pair(off, off)
    assert ok_i.auth_off and ok_a.auth_off and ok_i.key == ok_a.key


def test_authenticate_socket_silent_peer_times_out() -> None:
    s1, s2 = socket.socketpair()
    try:
        with pytest.raises(AuthError, match="in time"):
            authenticate_socket(s2, initiator=False, context=b"test/1", timeout=0.3,
                                secret=Secret(bytes.fromhex(SECRET_A), "a"))
    finally:
        s1.close()
        s2.close()


# ---- the demo -------------------------------------------------------------------------------------

@pytest.fixture
def prefill() -> Iterator[PrefillThread]:
    """A prefill side running in a thread (secret A): its ReadyInfo, its outcome, its thread."""
    yield from prefill_thread(quick())


def _raw(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=5)


def _closed(s: socket.socket) -> bool:
    """True when the peer closed the connection without sending anything."""
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:  # it closed with our unread bytes in its buffer
        return True


def test_strays_are_refused_and_the_real_decode_is_served(
        prefill: tuple[ReadyInfo, dict[str, Any], threading.Thread], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ready, out, thread = prefill
    # 1. JSON straight away (a pre-authentication client): never parsed, never answered with JSON.
    with _raw(ready.control) as s:
        s.sendall(b'{"type":"hello","protocol":1}\n' + b"x" * 64)
        assert _closed(s)  # closed without a word: a malformed hello gets no challenge
    # 2. A peer that says nothing: dropped after the authentication deadline.
    with _raw(ready.control) as s:
        s.settimeout(10)
        assert _closed(s)
    # 3. A decode side holding another secret: refused, with one clear error naming what to set.
    monkeypatch.setenv(ENV_SECRET, SECRET_B)
    wrong = run_decode(quick(), ready.listen, ready.control)
    assert wrong.error is not None and not wrong.ok
    assert "authentication with the prefill's control channel" in wrong.error.message
    assert "refused this side's proof" in wrong.error.message and ENV_SECRET in wrong.error.message
    assert SECRET_A not in wrong.error.message and SECRET_B not in wrong.error.message
    assert thread.is_alive() and "error" not in out  # the prefill side is still waiting
    # 4. The real decode side.
    monkeypatch.setenv(ENV_SECRET, SECRET_A)
    report = run_decode(quick(), ready.listen, ready.control)
    assert report.error is None, report.error.message
    assert report.ok and report.source_intact is True
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert out["result"]["refused_control"] == 3
    assert out["result"]["source_intact"] is True
    # the prefill operator sees every refusal on stderr, progress lines enabled or not
    err = capsys.readouterr().err
    assert err.count("kvdd demo [prefill] warning: refused a control connection from 127.0.0.1") == 3, err


def test_oversized_line_is_refused(prefill: tuple[ReadyInfo, dict[str, Any], threading.Thread],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    ready, out, thread = prefill
    with _raw(ready.control) as s:
        authenticate_socket(s, initiator=True, context=control.CONTEXT, timeout=5, secret=load_secret())
        chunk = b"x" * (1 << 16)
        closed: OSError | None = None
        try:
            for _ in range(control.MAX_LINE // len(chunk) + 2):
                s.sendall(chunk)
        except OSError as exc:  # the prefill side closed the connection before reading it all
            closed = exc
        s.settimeout(10)
        try:
            while s.recv(1 << 16):  # the refusal (an error line), then the close
                pass
        except OSError:
            pass
    assert closed is None or isinstance(closed, (BrokenPipeError, ConnectionResetError))
    # refused like a peer without the secret: prefill keeps waiting and serves the real decode side
    assert thread.is_alive() and "error" not in out
    report = run_decode(quick(), ready.listen, ready.control)
    assert report.error is None, report.error.message
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert out["result"]["refused_control"] == 1
    err = capsys.readouterr().err
    assert f"refused decode from 127.0.0.1: the decode side sent a control line longer than {control.MAX_LINE} " \
           "bytes" in err


def test_decode_without_a_usable_secret_fails_in_one_line(
        prefill: tuple[ReadyInfo, dict[str, Any], threading.Thread], monkeypatch: pytest.MonkeyPatch) -> None:
    ready, out, thread = prefill
    monkeypatch.setenv(ENV_SECRET, "tooshort")
    report = run_decode(quick(), ready.listen, ready.control)
    assert report.error is not None
    assert "no usable secret for the control channel" in report.error.message
    assert "Traceback" not in report.error.message
    assert thread.is_alive() and "error" not in out


def test_cli_decode_with_another_secret_says_what_to_set(
        prefill: tuple[ReadyInfo, dict[str, Any], threading.Thread], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ready, out, thread = prefill
    monkeypatch.setenv(ENV_SECRET, SECRET_B)
    host, port = ready.listen
    code = cli_main(["demo", "--role", "decode", "--quick", "--no-progress", "--json",
                     "--connect", f"{host}:{port}", "--control-port", str(ready.control[1])])
    captured = capsys.readouterr()
    assert code == 1
    # the decode CLI's own lines (the prefill side, in this process, warns about the refusal too)
    lines = [ln for ln in captured.err.strip().splitlines() if not ln.startswith("kvdd demo [prefill]")]
    assert len(lines) == 1 and lines[0].startswith("kvdd demo: FAILED: authentication with"), captured.err
    assert ENV_SECRET in lines[0] and "Traceback" not in captured.err
    for secret in (SECRET_A, SECRET_B):
        assert secret not in captured.err and secret not in captured.out
    assert thread.is_alive() and "error" not in out


def test_auth_off_on_both_sides_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AUTH, "off")
    report = run_demo(quick(), in_process=True)
    assert report.error is None, report.error.message
    assert report.ok and report.source_intact is True
