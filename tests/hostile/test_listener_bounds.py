"""The listener's tables (:mod:`kvdd.sim.fabric.listener`) at their bounds, played from raw sockets.

Each test names a rule of docs/security.md (*Bounds*) and watches the listener's tables through
``Listener.held()``, so a check weakened by one, or skipped, fails here:

* a connection that closes before authenticating, or after it before its hello, leaves its table
  at once (not when its time is up);
* an authenticated connection that sends any frame but a link or unlink hello is closed without
  an answer (an unlink hello's body in another frame unlinks nothing);
* the hello bytes held are bounded by ``MAX_HELLO_BUFFERED``: a hello that fits exactly is held; one
  that does not evicts the biggest announced hello if that is at least as big, else it is refused;
* a refused connection that keeps sending is read, not reset, until it closes.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvdd import Status
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import Listener, wire
from kvdd.sim.fabric import listener as listener_mod
from kvdd.sim.fabric.auth import NONCE_BYTES

from hostile import rawpeer

S = Status.LLM_SUCCESS
MIB = 1 << 20


@pytest.fixture
def owner() -> Iterator[SimBackend]:
    o = SimBackend(61, 2)
    assert o.initialize({"llm.DeviceId": "0", "llm.ListenIpInfo": "127.0.0.1:0"}) == S
    yield o
    o.finalize()


def _listener(o: SimBackend) -> Listener:
    assert o.listener is not None
    return o.listener


def _within(seconds: float, cond: Callable[[], bool]) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _closed(s: socket.socket, timeout: float) -> bool:
    """True when the listener closed ``s`` within ``timeout`` without sending anything."""
    s.settimeout(timeout)
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _ends(s: socket.socket, timeout: float) -> bool:
    """True when the listener closes ``s`` within ``timeout`` (whatever it sent before)."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_connection_closed_before_authenticating_leaves_at_once(owner: SimBackend) -> None:
    listener = _listener(owner)
    s = rawpeer.connect(listener.port)
    s.sendall(rawpeer.hdr(wire.F_AUTH_HELLO, NONCE_BYTES + 1)[:5])  # half a header
    assert _within(1.0, lambda: listener.held()["preauth"] == 1)
    s.close()
    # PREAUTH_TIMEOUT_S would drop it after 2 s; its close drops it now
    assert _within(0.5, lambda: listener.held()["preauth"] == 0), listener.held()


def test_a_connection_closed_before_its_hello_leaves_at_once(owner: SimBackend) -> None:
    listener = _listener(owner)
    s = rawpeer.connect(listener.port)
    rawpeer.authenticate(s)
    assert _within(1.0, lambda: listener.held()["hello"] == 1)
    s.close()
    # HELLO_TIMEOUT_S would drop it after 5 s; its close drops it now
    assert _within(0.5, lambda: listener.held()["hello"] == 0), listener.held()


def test_a_frame_other_than_a_hello_after_authentication_is_closed_unanswered(
        owner: SimBackend) -> None:
    listener = _listener(owner)
    s, _snap = rawpeer.link(listener.port, 4242)  # a linked peer, cluster 4242
    with s:
        assert 4242 in owner.entities
        for ftype in (wire.F_LEASE, wire.F_LINK_REPLY, wire.F_UNLINK_REPLY):
            with rawpeer.connect(listener.port) as t:
                rawpeer.authenticate(t)
                # an unlink hello's body (cluster 4242) in another frame: no unlink, no answer
                t.sendall(rawpeer.frame(ftype, struct.pack("<Q", 4242)))
                assert _closed(t, 3.0), ftype
        assert 4242 in owner.entities
        assert listener.held()["hello"] == 0
    # announced, not sent: a READ of 1 MiB is closed on its header, nothing is held for its body
    with rawpeer.connect(listener.port) as t:
        rawpeer.authenticate(t)
        t.sendall(rawpeer.hdr(wire.F_READ, MIB))
        assert _closed(t, 3.0)
        assert listener.held()["hello_bytes"] == 0


def test_a_hello_header_in_pieces_links(owner: SimBackend) -> None:
    listener = _listener(owner)
    with rawpeer.connect(listener.port) as s:
        rawpeer.authenticate(s)
        hello = rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(4343))
        s.sendall(hello[:5])  # part of the header; the rest after the listener read it
        time.sleep(0.2)
        s.sendall(hello[5:])
        ftype, _req, body = rawpeer.read_frame(s)
        assert ftype == wire.F_LINK_REPLY and wire.Reader(body).u("I") == S
        assert 4343 in owner.entities


def _announce(port: int, length: int) -> socket.socket:
    """An authenticated connection that announced a link hello of ``length`` bytes (none sent)."""
    s = rawpeer.connect(port)
    rawpeer.authenticate(s)
    s.sendall(rawpeer.hdr(wire.F_HELLO_LINK, length))
    return s


@pytest.mark.parametrize("each", [2 * MIB, MIB])
def test_hello_bytes_fill_exactly_the_cap_then_the_biggest_is_evicted(owner: SimBackend,
                                                                      each: int) -> None:
    listener = _listener(owner)
    cap = wire.MAX_HELLO_BUFFERED
    count = cap // each
    assert count * each == cap and count <= wire.MAX_POSTAUTH_PER_SOURCE
    held = [_announce(listener.port, each) for _ in range(count)]
    try:
        assert _within(2.0, lambda: listener.held()["hello_bytes"] == cap), listener.held()
        assert listener.held()["hello"] == count  # exactly at the cap: every one held
        new = _announce(listener.port, each)  # one past: as big as the biggest, which goes
        held.append(new)
        assert _closed(held[0], 3.0)  # the oldest of the biggest
        assert not _closed(new, 0.3)
        assert listener.held()["hello_bytes"] == cap and listener.held()["hello"] == count
    finally:
        for s in held:
            s.close()


def test_a_hello_bigger_than_every_held_one_is_refused_when_it_does_not_fit(
        owner: SimBackend) -> None:
    listener = _listener(owner)
    cap = wire.MAX_HELLO_BUFFERED
    count = cap // MIB
    held = [_announce(listener.port, MIB) for _ in range(count)]
    try:
        assert _within(2.0, lambda: listener.held()["hello_bytes"] == cap), listener.held()
        new = _announce(listener.port, MIB + 1)  # bigger than any held: it is refused
        assert _closed(new, 3.0)
        new.close()
        assert listener.held()["hello_bytes"] == cap and listener.held()["hello"] == count
        assert not any(_closed(s, 0.05) for s in held)
    finally:
        for s in held:
            s.close()


def test_a_refused_connection_that_keeps_sending_is_read_until_it_closes(owner: SimBackend) -> None:
    listener = _listener(owner)
    s = rawpeer.connect(listener.port)
    with s:
        with pytest.raises(PermissionError):
            rawpeer.authenticate(s, auth_off=True)  # refused: the modes differ
        assert _within(1.0, lambda: listener.held()["draining"] == 1)
        for _ in range(5):  # within LINGER_S, it keeps sending: still read, never reset
            s.sendall(np.random.default_rng(1).integers(0, 256, 512, dtype=np.uint8).tobytes())
            time.sleep(0.05)
            assert listener.held()["draining"] == 1
        s.shutdown(socket.SHUT_WR)
        assert _closed(s, 2.0)
    assert _within(1.0, lambda: listener.held()["draining"] == 0)


def test_closing_a_listener_while_it_accepts_logs_no_accept_failure(
        owner: SimBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    # the listener is closed (from its own thread: the first hello it reads closes it) in the
    # middle of a turn of accepting: the next accept fails on the closed socket, and that is
    # no failure worth a warning, nor a reason to drop a connection
    listener = _listener(owner)
    warned: list[str] = []
    real_check = wire.check_header  # what the listener checks headers with

    def closing_check(head: bytes | bytearray | memoryview) -> tuple[int, int, int]:
        listener.stop_accepting()
        return real_check(head)

    monkeypatch.setattr(listener_mod, "warn_limited",
                        lambda _logger, kind, *_args: warned.append(kind))
    monkeypatch.setattr(listener_mod, "check_header", closing_check)
    with rawpeer.connect(listener.port) as s:
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, bytes(NONCE_BYTES) + b"\x00"))
        # the hello came with the connection, so it is answered at accept (a challenge) before
        # the loop notices it was closed; then the loop ends and closes what it held
        assert _ends(s, 3.0)
    assert warned == []


@pytest.mark.parametrize("ftype", [wire.F_HELLO_LINK, wire.F_AUTH_PROOF, wire.F_AUTH_CHALLENGE])
def test_a_first_frame_other_than_the_authentication_hello_is_closed_unanswered(
        owner: SimBackend, ftype: int) -> None:
    listener = _listener(owner)
    with rawpeer.connect(listener.port) as s:
        s.sendall(rawpeer.frame(ftype, bytes(NONCE_BYTES) + b"\x00"))  # a hello's shape and size
        assert _closed(s, 3.0)  # no challenge


def test_a_second_hello_instead_of_the_proof_is_closed_unanswered(owner: SimBackend) -> None:
    listener = _listener(owner)
    with rawpeer.connect(listener.port) as s:
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, bytes(NONCE_BYTES) + b"\x00"))
        ftype, _req, _challenge = rawpeer.read_frame(s)
        assert ftype == wire.F_AUTH_CHALLENGE
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, bytes(NONCE_BYTES) + b"\x00"))
        assert _closed(s, 3.0)  # no second challenge


def test_a_connection_closed_in_the_middle_of_its_hello_leaves_at_once(owner: SimBackend) -> None:
    listener = _listener(owner)
    s = rawpeer.connect(listener.port)
    rawpeer.authenticate(s)
    s.sendall(rawpeer.hdr(wire.F_HELLO_LINK, 1000) + bytes(10))  # 10 of 1000 bytes, then gone
    assert _within(1.0, lambda: listener.held()["hello_bytes"] == 1000)
    s.close()
    assert _within(0.5, lambda: listener.held()["hello"] == 0), listener.held()
    assert listener.held()["hello_bytes"] == 0
    t, _snap = rawpeer.link(listener.port, 4444)  # and the listener goes on
    t.close()
