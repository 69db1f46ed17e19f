"""The link and unlink handshakes (:mod:`kvdd.sim.fabric.handshake`) at their bounds, both sides.

Each test names a rule of docs/security.md or SEMANTICS.md §3.5-3.6 and plays the other side from
a raw socket (or is an instance of this process), so a check weakened by one, or skipped, fails:

* every send and receive of an initiator is bounded by the link's deadline, exactly: with no time
  left nothing is sent, and an answer waiting exactly at the deadline is not read;
* an initiator refuses a challenge of the other authentication mode without sending a proof, and
  says what to set on its side; a refusal after its proof keeps the acceptor's status and reason;
* a reply of the wrong frame type fails a link (LLM_LINK_FAILED) and an unlink (UNLINK_FAILED);
* a hello or a reply of exactly ``MAX_HELLO`` bytes goes out, one byte more is refused before it
  is sent (the initiator) or instead of the reply (the acceptor, which then closes the connection);
* an acceptor takes at most ``MAX_LINKS_PER_SOURCE`` links and ``MAX_LINKED_CACHES_PER_SOURCE``
  caches of their tables from one address: exactly at the cap links, one past is refused;
* an instance of this process is reached in process; its refusal is a status, and an unlink
  notice reaches it (but never an instance's notice to itself);
* :func:`~kvdd.sim.fabric.handshake.linger` waits for the peer's FIN, at most its time, and reads
  nothing once that time is up.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import struct
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import numpy as np
import pytest

import kvdd
from kvdd import CacheDesc, DataType, Status
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import handshake, wire
from kvdd.sim.fabric.auth import NONCE_BYTES, Secret, mac
from kvdd.sim.fabric.handshake import (InProcessConnection, RemoteConnection, auth_refusal, linger,
                                       transcript_of)
from kvdd.sim.fabric.channel import GoneOwner
from kvdd.sim.fabric.protocol import LinkOwner, LinkResult
from kvdd.types import RegisterCfg

from hostile import rawpeer

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

LOCALHOST = "127.0.0.1"
S = Status.LLM_SUCCESS
TIMEOUT_DETAIL = "no answer within the timeout"
ON = Secret(secrets.token_bytes(32), "test")
OFF = Secret(b"off", "off", auth_off=True)


class Clock:
    """handshake's clock, moved only by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class SteppingSocket(socket.socket):
    """A socket that moves ``clock`` to ``after_send`` once it sent something."""

    clock: Clock
    after_send: float

    def sendall(self, data: ReadableBuffer, flags: int = 0, /) -> None:
        super().sendall(data, flags)
        self.clock.now = self.after_send


def _frames(s: socket.socket, timeout: float = 1.0) -> list[tuple[int, bytes]]:
    """The frames waiting on ``s`` until it is quiet for ``timeout`` or closed."""
    out: list[tuple[int, bytes]] = []
    s.settimeout(timeout)
    try:
        while True:
            ftype, _req, payload = rawpeer.read_frame(s)
            out.append((ftype, payload))
    except (socket.timeout, ConnectionError):
        return out


def _stub_owner(cluster_id: int = 5) -> LinkOwner:
    """Enough of a LinkOwner for a handshake that fails during authentication (its link hello,
    encoded while the acceptor checks the proof: no caches)."""
    return cast(LinkOwner, GoneOwner(cluster_id))


@pytest.fixture
def secret_on(monkeypatch: pytest.MonkeyPatch) -> Secret:
    monkeypatch.setattr(handshake, "load_secret", lambda: ON)
    return ON


# ---- the initiator's deadline ------------------------------------------------------------------------


def test_no_time_left_sends_nothing(monkeypatch: pytest.MonkeyPatch, secret_on: Secret) -> None:
    monkeypatch.setattr(handshake, "time", types.SimpleNamespace(monotonic=Clock(100.0).monotonic))
    a, b = socket.socketpair()
    with b:
        conn = RemoteConnection(a, deadline=100.0)  # exactly now
        res = conn.link(_stub_owner(), False)
        conn.close()
        assert (res.status, res.detail) == (Status.LLM_TIMEOUT, TIMEOUT_DETAIL)
        assert _frames(b, 1.0) == []  # closed without a byte


def test_an_answer_waiting_exactly_at_the_deadline_is_not_read(monkeypatch: pytest.MonkeyPatch,
                                                               secret_on: Secret) -> None:
    clock = Clock(99.0)
    monkeypatch.setattr(handshake, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    a, b = socket.socketpair()
    s = SteppingSocket(a.family, a.type, fileno=a.detach())
    s.clock, s.after_send = clock, 100.0  # the hello leaves with 1 s left; then none is left
    with b:
        b.sendall(auth_refusal(Status.LLM_LINK_FAILED, "refused by the test"))  # already there
        conn = RemoteConnection(s, deadline=100.0)
        res = conn.link(_stub_owner(), False)
        conn.close()
        assert (res.status, res.detail) == (Status.LLM_TIMEOUT, TIMEOUT_DETAIL)
        assert [f for f, _ in _frames(b, 0.2)] == [wire.F_AUTH_HELLO]


# ---- the initiator's authentication ------------------------------------------------------------------


@pytest.mark.parametrize("mine_off", [False, True])
def test_a_challenge_of_the_other_mode_is_refused_without_a_proof(monkeypatch: pytest.MonkeyPatch,
                                                                  mine_off: bool) -> None:
    monkeypatch.setattr(handshake, "load_secret", lambda: OFF if mine_off else ON)
    a, b = socket.socketpair()
    with b:
        b.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE,
                                secrets.token_bytes(NONCE_BYTES) + bytes([int(not mine_off)])))
        conn = RemoteConnection(a, time.monotonic() + 3.0)
        res = conn.link(_stub_owner(), False)
        conn.close()
        assert res.status == Status.LLM_LINK_FAILED
        if mine_off:
            assert res.detail.startswith("the peer requires authentication but this process has "
                                         "KVDD_FABRIC_AUTH=off: unset it")
        else:
            assert res.detail.startswith("the peer has KVDD_FABRIC_AUTH=off (no authentication): "
                                         "set KVDD_FABRIC_AUTH=off here too")
        assert [f for f, _ in _frames(b, 0.2)] == [wire.F_AUTH_HELLO]  # no proof


def test_a_refusal_after_the_proof_keeps_its_status_and_reason(secret_on: Secret) -> None:
    why = "authentication failed: the two sides hold different fabric secrets (test)"
    a, b = socket.socketpair()
    with b:
        b.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, secrets.token_bytes(NONCE_BYTES) + b"\x00"))
        b.sendall(auth_refusal(Status.LLM_LINK_FAILED, why))
        conn = RemoteConnection(a, time.monotonic() + 3.0)
        res = conn.link(_stub_owner(), False)
        conn.close()
        assert (res.status, res.detail) == (Status.LLM_LINK_FAILED, why)
        assert [f for f, _ in _frames(b, 0.2)] == [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF]


# ---- replies of the wrong type ------------------------------------------------------------------------


def _fake_acceptor(b: socket.socket, reply: bytes) -> threading.Thread:
    """An acceptor holding ``ON``'s key: it authenticates properly, reads the hello and sends
    ``reply`` (a whole frame)."""

    def run() -> None:
        with b:
            b.settimeout(5.0)
            try:
                _f, _r, hello = rawpeer.read_frame(b)
                challenge = secrets.token_bytes(NONCE_BYTES) + b"\x00"
                b.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, challenge))
                t0 = transcript_of(hello, challenge)
                _f, _r, proof = rawpeer.read_frame(b)
                t1 = hashlib.sha256(t0 + proof).digest()
                b.sendall(rawpeer.frame(wire.F_AUTH_OK, mac(ON.key, "acceptor", hello[:NONCE_BYTES],
                                                            challenge[:NONCE_BYTES], t1)))
                rawpeer.read_frame(b)  # the link or unlink hello
                b.sendall(reply)
                b.recv(1)  # until the initiator closes
            except OSError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def owner() -> Iterator[SimBackend]:
    o = SimBackend(72, 2)
    assert o.initialize({"llm.DeviceId": "0"}) == S
    yield o
    o.finalize()


def test_a_link_answered_with_an_unlink_reply_fails(secret_on: Secret, owner: SimBackend) -> None:
    a, b = socket.socketpair()
    # a body a link reply could hold (a refusal): only its frame type is wrong
    body = bytes(wire.Writer().pack("I", Status.LLM_FAILED).text("not a link reply").buf)
    t = _fake_acceptor(b, rawpeer.frame(wire.F_UNLINK_REPLY, body))
    conn = RemoteConnection(a, time.monotonic() + 5.0)
    res = conn.link(owner, True)
    conn.close()
    t.join(10)
    assert (res.status, res.detail) == (Status.LLM_LINK_FAILED,
                                        "the handshake failed: unexpected reply")


def test_an_unlink_answered_with_a_link_reply_fails(secret_on: Secret, owner: SimBackend) -> None:
    a, b = socket.socketpair()
    t = _fake_acceptor(b, rawpeer.frame(wire.F_LINK_REPLY, struct.pack("<I", S)))
    conn = RemoteConnection(a, time.monotonic() + 5.0)
    status = conn.notify_unlink(owner)
    conn.close()
    t.join(10)
    assert status == Status.LLM_UNLINK_FAILED


# ---- MAX_HELLO, both sides -----------------------------------------------------------------------------


def _backend(cluster_id: int, caches: int, listen: bool) -> tuple[SimBackend, list[np.ndarray]]:
    o = SimBackend(cluster_id, 2 if listen else 1)
    options = {"llm.DeviceId": "0"}
    if listen:
        options["llm.ListenIpInfo"] = f"{LOCALHOST}:0"
    assert o.initialize(options) == S
    keep = []
    desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(1, 64))
    for _ in range(caches):
        arr = np.zeros(64, np.uint8)
        keep.append(arr)
        st, _cid = o.register_kv_cache(desc, kvdd.tensor_addrs([arr]), RegisterCfg())
        assert st == S
    return o, keep


def _link_over_tcp(acceptor: SimBackend, initiator: SimBackend) -> tuple[RemoteConnection,
                                                                         LinkResult]:
    port = acceptor.listen_port
    assert port
    sock = socket.create_connection((LOCALHOST, port), timeout=5)
    conn = RemoteConnection(sock, time.monotonic() + 5)
    return conn, conn.link(initiator, True)


def _hello_size(monkeypatch: pytest.MonkeyPatch, acceptor: SimBackend, initiator: SimBackend) -> int:
    """The bytes of ``initiator``'s link hello to ``acceptor`` (a link made, then unmade)."""
    sizes: list[int] = []
    real = wire.frame  # what handshake sends frames with

    def recording(ftype: int, req: int, payload: bytes | bytearray = b"") -> bytes:
        if ftype == wire.F_HELLO_LINK:
            sizes.append(len(payload))
        return real(ftype, req, payload)

    monkeypatch.setattr(handshake, "frame", recording)
    conn, res = _link_over_tcp(acceptor, initiator)
    conn.close()
    assert res.status == S and res.handle is not None
    res.handle.close()
    monkeypatch.setattr(handshake, "frame", real)
    assert len(sizes) == 1
    return sizes[0]


def test_a_hello_of_exactly_max_hello_bytes_links_one_more_is_refused_unsent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    acceptor, _a = _backend(81, 0, listen=True)
    initiator, _i = _backend(82, 3, listen=False)  # its hello is bigger than the reply
    try:
        n = _hello_size(monkeypatch, acceptor, initiator)
        monkeypatch.setattr(handshake, "MAX_HELLO", n)
        conn, res = _link_over_tcp(acceptor, initiator)
        conn.close()
        assert res.status == S and res.handle is not None
        res.handle.close()
        monkeypatch.setattr(handshake, "MAX_HELLO", n - 1)
        sent: list[int] = []
        real = wire.frame  # what handshake sends frames with

        def recording(ftype: int, req: int, payload: bytes | bytearray = b"") -> bytes:
            sent.append(ftype)
            return real(ftype, req, payload)

        monkeypatch.setattr(handshake, "frame", recording)
        conn, res = _link_over_tcp(acceptor, initiator)
        conn.close()
        assert (res.status, res.detail) == (
            Status.LLM_FAILED, f"the local cache table is too large to link (the hello would "
            f"exceed {n - 1} bytes)")
        assert sent == [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF]  # authenticated; no hello
    finally:
        initiator.finalize()
        acceptor.finalize()


def test_a_reply_over_max_hello_fails_the_link_and_the_acceptor_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    acceptor, _a = _backend(83, 3, listen=True)  # its reply is bigger than the hello
    initiator, _i = _backend(84, 0, listen=False)
    try:
        n = _hello_size(monkeypatch, acceptor, initiator)
        monkeypatch.setattr(handshake, "MAX_HELLO", n)
        conn, res = _link_over_tcp(acceptor, initiator)
        assert (res.status, res.detail) == (
            Status.LLM_FAILED, f"the peer's cache table is too large to link (over {n} bytes)")
        # the acceptor made no link of it: it closes the connection (no channel serves it)
        assert conn.sock is not None
        conn.sock.settimeout(3.0)
        assert conn.sock.recv(1 << 10) == b""
        conn.close()
    finally:
        initiator.finalize()
        acceptor.finalize()


# ---- the acceptor's link bounds per address ---------------------------------------------------------


def _raw_link(port: int, cluster_id: int, caches: int = 0) -> tuple[int, str, socket.socket]:
    s = rawpeer.connect(port)
    rawpeer.authenticate(s)
    s.sendall(rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(cluster_id, caches=caches)))
    ftype, _req, body = rawpeer.read_frame(s)
    assert ftype == wire.F_LINK_REPLY
    r = wire.Reader(body)
    return r.u("I"), r.text() or "", s


@pytest.fixture
def acceptor() -> Iterator[SimBackend]:
    o, _keep = _backend(90, 0, listen=True)
    yield o
    o.finalize()


def test_links_from_one_address_stop_exactly_at_the_cap(acceptor: SimBackend) -> None:
    port = acceptor.listen_port
    assert port
    held: list[socket.socket] = []
    try:
        for i in range(wire.MAX_LINKS_PER_SOURCE):
            status, detail, s = _raw_link(port, 1000 + i)
            held.append(s)
            assert status == S, (i, detail)
        status, detail, s = _raw_link(port, 2000)  # one past
        held.append(s)
        assert status == Status.LLM_LINK_FAILED
        assert detail.startswith(f"the peer accepts at most {wire.MAX_LINKS_PER_SOURCE} links "
                                 "from one address")
        assert 2000 not in acceptor.entities
        assert {1000 + i for i in range(wire.MAX_LINKS_PER_SOURCE)} <= set(acceptor.entities)
    finally:
        for s in held:
            s.close()


def test_linked_caches_from_one_address_stop_exactly_at_the_cap(acceptor: SimBackend) -> None:
    port = acceptor.listen_port
    assert port
    cap = wire.MAX_LINKED_CACHES_PER_SOURCE
    held: list[socket.socket] = []
    try:
        for cluster_id, caches in ((3001, cap - 1), (3002, 1)):  # exactly the cap in all
            status, detail, s = _raw_link(port, cluster_id, caches)
            held.append(s)
            assert status == S, detail
        status, detail, s = _raw_link(port, 3003, 1)  # one cache past it
        held.append(s)
        assert status == Status.LLM_LINK_FAILED
        assert detail.startswith(f"the peer keeps the cache tables of its links from one address "
                                 f"up to {cap} caches")
        assert detail.endswith("this link's table has 1")
        assert 3003 not in acceptor.entities and {3001, 3002} <= set(acceptor.entities)
    finally:
        for s in held:
            s.close()


# ---- instances of this process --------------------------------------------------------------------


def test_an_instance_of_this_process_is_reached_in_process(acceptor: SimBackend,
                                                           owner: SimBackend) -> None:
    port = acceptor.listen_port
    assert port
    status, conn = handshake.connect(LOCALHOST, port, 1000)
    assert status == S and isinstance(conn, InProcessConnection)
    res = conn.link(owner, True)
    assert res.status == S and res.handle is not None and owner.cluster_id in acceptor.entities
    # linked already and not forced: the acceptor's refusal is a status, with no handle
    res2 = conn.link(owner, False)
    assert (res2.status, res2.offer, res2.handle) == (Status.LLM_ALREADY_LINK, None, None)
    assert res2.detail == f"already linked to cluster {owner.cluster_id}"
    # a non-force unlink's notice reaches the acceptor: its entity for us is gone
    assert conn.notify_unlink(owner) == S
    assert owner.cluster_id not in acceptor.entities
    res.handle.close()
    conn.close()


def test_an_instance_s_unlink_notice_to_itself_changes_nothing(acceptor: SimBackend) -> None:
    port = acceptor.listen_port
    assert port
    status, conn = handshake.connect(LOCALHOST, port, 1000)
    assert status == S and isinstance(conn, InProcessConnection)
    res = conn.link(acceptor, True)  # linked to itself: its entity for itself
    assert res.status == S and acceptor.cluster_id in acceptor.entities
    assert conn.notify_unlink(acceptor) == S
    assert acceptor.cluster_id in acceptor.entities  # (the unlink destroys it, not the notice)


# ---- linger ----------------------------------------------------------------------------------------------


def test_linger_waits_for_the_peer_s_fin() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x" * 100)  # the peer still sends, then closes 0.3 s later

        def close_later() -> None:
            time.sleep(0.3)
            b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=close_later)
        t.start()
        t0 = time.monotonic()
        linger(a, 5.0)
        elapsed = time.monotonic() - t0
        t.join()
        assert 0.25 <= elapsed < 4.0, elapsed
        assert b.recv(1) == b""  # our FIN came first


def test_linger_waits_at_most_its_time_for_a_silent_peer() -> None:
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        linger(a, 1.0)
        elapsed = time.monotonic() - t0
        assert 0.9 <= elapsed < 3.0, elapsed


def _stepping_clock(monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    now = [0.0]

    def monotonic() -> float:
        value = now[0]
        now[0] += step
        return value

    monkeypatch.setattr(handshake, "time", types.SimpleNamespace(monotonic=monotonic))


@pytest.mark.parametrize("step", [0.25, 0.3])
def test_linger_reads_nothing_once_its_time_is_up(monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    """A peer that keeps sending: each turn costs ``step`` s of a 1 s linger; after three reads
    exactly nothing is left (0.25 s steps) or less (0.3 s steps: -0.2 s), and no fourth read
    is made."""
    _stepping_clock(monkeypatch, step)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"y" * (64 << 10))
        linger(a, 1.0)
        left = 0
        b.shutdown(socket.SHUT_WR)
        a.settimeout(2.0)
        while chunk := a.recv(1 << 16):
            left += len(chunk)
        assert left == (64 << 10) - 3 * 4096
