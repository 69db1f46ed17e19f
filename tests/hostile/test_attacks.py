"""Attacks on a listening instance from raw sockets speaking the fabric's wire protocol.

The victim ``P`` lives in its own process (:mod:`peer_proc`); a legitimate peer ``D`` lives here and
is linked to it.  Every test checks, besides its own assertions:

* 0 bytes changed outside what the legitimate transfers wrote: every arena of every process,
  guard bytes around every tensor included (``World.snapshot``);
* the victim alive and serving ``D`` in both directions during and after the attack
  (byte-checked pulls and pushes);
* the victim's RSS growth per attacker below ``RSS_BOUND_MIB`` (docs/security.md states it).

Attacks that need the secret (request bombs, never-reading peers, lease hogging) use this
process's secret: they show what a *peer that authenticated* can cost, which the bounds limit.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import DataType, LlmRole, Status
from kvdd.sim.fabric import load_secret, wire
from kvdd.sim.fabric.auth import ENV_AUTH, ENV_SECRET
from kvdd.sim.fabric.auth import mac as auth_mac
from kvdd.sim.fabric.handshake import transcript_of
from kvdd.sim.fabric.leases import REVOKE_GRACE_S

from conformance.checked import (
    pull_cache_checked,
    push_cache_checked,
)
from conformance.harness import (
    CacheHandle,
    Node,
    Snapshot,
    Spec,
    World,
    link,
    register,
)
from hostile import rawpeer
from hostile.conftest import LONG
from peer_node import ProcessNode
from peer_proc import PeerProcess

S = Status.LLM_SUCCESS
RSS_BOUND_MIB = 64  # victim RSS growth allowed per attack (docs/security.md)
BIG = Spec(n=4, dtype=DataType.DT_INT32, shape=(4, 1 << 16))  # 4 tensors of 1 MiB


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


def _setup(world: World) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle, int]:
    """Victim P (other process, listening, one cache), D here (one cache), D linked to P."""
    p = world.peer(1, LlmRole.PROMPT)
    assert isinstance(p, ProcessNode)
    p.initialize(listen=True)
    ph = register(p, Spec())
    d = world.dut(2, LlmRole.DECODER)
    d.initialize()
    dh = register(d, Spec())
    assert link(d, p) == [S]
    port = p.listen_port
    assert port
    return d, p, dh, ph, port


def _legit(world: World, d: Node, dh: CacheHandle, ph: CacheHandle) -> None:
    """D pulls from and pushes to the victim; every byte of every arena checked."""
    pull_cache_checked(world, d, ph, dh)
    push_cache_checked(world, d, dh, ph)


def _untouched(world: World, before: Snapshot, legit: set[tuple[int, int]]) -> None:
    """No byte of any arena (guards included) changed, except arenas ``legit`` transfers of
    the test itself wrote (checked byte for byte by those transfers)."""
    after = world.snapshot()
    for key, exp in before.arenas.items():
        if key in legit:
            continue
        changed = int(np.count_nonzero(exp != after.arenas[key]))
        assert changed == 0, f"the attack changed {changed} byte(s) of arena {key}"


class Victim:
    def __init__(self, d: Node, p: ProcessNode, dh: CacheHandle, ph: CacheHandle, port: int) -> None:
        self.d, self.p, self.dh, self.ph, self.port = d, p, dh, ph, port
        self.legit: set[tuple[int, int]] = set()

    def serve_d(self, world: World) -> None:
        """D pulls from the victim during an attack (its destination is then excluded from the
        untouched check; the pull itself checks every byte)."""
        self.legit.add((self.dh.owner, self.dh.slot))
        pull_cache_checked(world, self.d, self.ph, self.dh)


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closed ``s`` (EOF or reset) within ``timeout``, discarding input."""
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not s.recv(1 << 20):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


@pytest.fixture
def victim(world: World, victim_proc: PeerProcess) -> Iterator[Victim]:
    v = Victim(*_setup(world))
    rss0 = _rss_mib(victim_proc.pid)
    before = world.snapshot()
    yield v
    _untouched(world, before, v.legit)
    _legit(world, v.d, v.dh, v.ph)
    grown = _rss_mib(victim_proc.pid) - rss0
    assert grown < RSS_BOUND_MIB, f"the victim's RSS grew by {grown:.1f} MiB"


# ---- identity ------------------------------------------------------------------------------------


def test_impersonation_without_the_secret(victim: Victim) -> None:
    """Without the secret nothing gets past authentication: a wrong key is refused with a reason,
    and link/unlink/lease frames sent instead of authenticating (forged HELLO_LINK with force
    naming D's cluster id, forged HELLO_UNLINK) close the connection without effect."""
    d, p, port = victim.d, victim.p, victim.port
    with rawpeer.connect(port) as s:
        with pytest.raises(PermissionError, match="authentication failed.*KVDD_FABRIC_SECRET"):
            rawpeer.authenticate(s, key=os.urandom(32))
    forged = [
        rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(d.cluster_id, force=True)),
        rawpeer.frame(wire.F_HELLO_UNLINK, struct.pack("<Q", d.cluster_id)),
        rawpeer.frame(wire.F_LEASE, struct.pack("<Q", 1), 1),
        rawpeer.frame(wire.F_AUTH_PROOF, os.urandom(32)),
    ]
    for data in forged:
        with rawpeer.connect(port) as s:
            s.sendall(data)
            assert _closed(s)
    assert d.cluster_id in p.entity_keys()  # D's link on the victim is intact


def test_replayed_and_reflected_handshakes(victim: Victim) -> None:
    """A recorded handshake (nonce and proof) replayed on a new connection is refused (the
    acceptor's nonce is fresh); so is the acceptor's own MAC reflected as the initiator's proof,
    and a MAC made with the secret for the wrong role."""
    port = victim.port
    with rawpeer.connect(port) as s:
        rec = rawpeer.authenticate(s)  # a legitimate handshake, recorded
    nonce_i = rec.hello[:32]
    with rawpeer.connect(port) as s:
        with pytest.raises(PermissionError, match="authentication failed"):
            rawpeer.authenticate(s, nonce=nonce_i, proof=rec.proof)
    with rawpeer.connect(port) as s:
        with pytest.raises(PermissionError, match="authentication failed"):
            rawpeer.authenticate(s, nonce=nonce_i, proof=rec.answer)
    key = load_secret().key
    with rawpeer.connect(port) as s:  # the right secret, the acceptor's role label
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, nonce_i + b"\0"))
        _t, _r, challenge = rawpeer.read_frame(s)
        t0 = transcript_of(nonce_i + b"\0", challenge)
        s.sendall(rawpeer.frame(wire.F_AUTH_PROOF, auth_mac(key, "acceptor", nonce_i, challenge[:32], t0)))
        ftype, _r, body = rawpeer.read_frame(s)
        assert ftype == wire.F_AUTH_REFUSED, ftype


def test_other_secret_or_auth_off_is_refused_with_a_reason(
        victim: Victim, world: World, victim_proc: PeerProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real instance with another secret, or with KVDD_FABRIC_AUTH=off, gets LLM_LINK_FAILED
    whose message says what to set; the victim keeps no state of it.  With KVDD_FABRIC_AUTH=off
    on both sides the link is made."""
    p, port = victim.p, victim.port
    e = world.dut(3, LlmRole.DECODER)
    e.initialize()
    keys = set(p.entity_keys())
    monkeypatch.setenv(ENV_SECRET, os.urandom(32).hex())
    with pytest.raises(kvdd.LLMError, match=f"{ENV_SECRET}") as info:
        e.link(port, p.cluster_id)
    assert info.value.status == Status.LLM_LINK_FAILED
    monkeypatch.delenv(ENV_SECRET)
    monkeypatch.setenv(ENV_AUTH, "off")
    with pytest.raises(kvdd.LLMError, match=f"{ENV_AUTH}") as info:
        e.link(port, p.cluster_id)
    assert info.value.status == Status.LLM_LINK_FAILED
    assert set(p.entity_keys()) == keys
    victim_proc.root("setenv", ENV_AUTH, "off")  # off on both sides: links (trusted networks)
    try:
        assert e.link(port, p.cluster_id) == [S]
    finally:
        victim_proc.root("setenv", ENV_AUTH, None)
    monkeypatch.delenv(ENV_AUTH)
    assert e.unlink(port, p.cluster_id) == [S]  # authenticated again: unlinks
    assert e.link(port, p.cluster_id) == [S]  # the same instance with the right secret links


def test_other_protocol_version_gets_a_clear_refusal(
        victim: Victim) -> None:
    """A peer speaking protocol version 1 (no authentication) gets a version-1 LINK_REPLY with
    LLM_LINK_FAILED and a message naming the versions, not a silent close."""
    port = victim.port
    with rawpeer.connect(port) as s:
        s.sendall(rawpeer.hdr(wire.F_HELLO_LINK, 40, version=1) + bytes(40))
        head = rawpeer.recv_exact(s, 12)
        _m, version, ftype, _req, n = rawpeer.HDR.unpack(head)
        body = rawpeer.recv_exact(s, n)
    assert (version, ftype) == (1, wire.F_LINK_REPLY)
    r = wire.Reader(body)
    assert r.u("I") == Status.LLM_LINK_FAILED
    assert "protocol version" in (r.text() or "")


# ---- resources before authentication -------------------------------------------------------------


def test_idle_and_slowloris_do_not_starve_links(victim: Victim, world: World) -> None:
    """500 idle and 80 slowloris connections (each dripping an authentication hello, reconnecting
    when dropped) are open; 40 of 40 legitimate links succeed, each within 1 s, and D is served."""
    port = victim.port
    n_idle, n_slow, n_legit = (2000, 300, 200) if LONG else (500, 80, 40)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n_idle + n_slow + 256
    if soft < need:  # this process holds every attacking socket
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors (hard limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    idle = [rawpeer.connect(port) for _ in range(n_idle)]
    stop = threading.Event()
    hello = rawpeer.frame(wire.F_AUTH_HELLO, bytes(33))

    def slowloris() -> None:
        socks = [rawpeer.connect(port) for _ in range(n_slow)]
        pos = [0] * n_slow
        while not stop.is_set():
            for i, s in enumerate(socks):
                try:
                    s.send(hello[pos[i] % len(hello):pos[i] % len(hello) + 1])
                    pos[i] += 1
                except OSError:  # dropped by the victim: come back
                    s.close()
                    try:
                        socks[i] = rawpeer.connect(port)
                    except OSError:
                        continue
                    pos[i] = 0
            stop.wait(0.1)
        for s in socks:
            s.close()

    dripper = threading.Thread(target=slowloris)
    dripper.start()
    try:
        time.sleep(0.5)
        times = []
        for i in range(n_legit):
            t0 = time.monotonic()
            s, snap = rawpeer.link(port, 1000 + i)
            times.append(time.monotonic() - t0)
            assert snap  # the victim's cache is visible to an authenticated link
            s.close()
        victim.serve_d(world)  # and the linked peer is served meanwhile
    finally:
        stop.set()
        dripper.join()
        for s in idle:
            s.close()
    assert len(times) == n_legit and max(times) < 1.0, f"slowest link took {max(times):.2f} s"


def test_flood_of_garbage_connections(victim: Victim,
                                      world: World) -> None:
    """Many short connections with random bytes, bad headers, oversized lengths and frames of
    the wrong phase, from several threads, while D keeps transferring."""
    port = victim.port
    rng = np.random.default_rng(7)
    per_thread = 1000 if LONG else 150
    payloads = [
        rng.integers(0, 256, 64, dtype=np.uint8).tobytes(),
        rawpeer.hdr(wire.F_AUTH_HELLO, 0xFFFFFFFF),
        rawpeer.hdr(wire.F_HELLO_LINK, wire.MAX_HELLO),
        rawpeer.hdr(wire.F_DATA, 1 << 20) + bytes(4096),
        rawpeer.frame(wire.F_AUTH_HELLO, bytes(33)) + rawpeer.frame(wire.F_AUTH_PROOF, bytes(32)),
        rawpeer.hdr(wire.F_AUTH_HELLO, 33, magic=b"XX"),
    ]

    def flood(seed: int) -> None:
        for i in range(per_thread):
            try:
                with rawpeer.connect(port, timeout=2) as s:
                    s.sendall(payloads[(seed + i) % len(payloads)])
            except OSError:
                pass  # refused or reset while the victim drops it: expected

    threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            victim.serve_d(world)  # served during the flood
    finally:
        for t in threads:
            t.join()


# ---- resources after authentication ---------------------------------------------------------------


def test_request_bomb_is_refused_without_work(
        victim: Victim) -> None:
    """A READ of 500,000 tensor indices x 130,000 one-byte runs (all in range) gets
    LLM_PARAM_INVALID at once and no DATA; the same as a WRITE closes the connection."""
    ph, port = victim.ph, victim.port
    tensors = np.zeros(500_000, np.int64)
    off = np.zeros(130_000, np.int64)
    length = np.ones(130_000, np.int64)
    s, snap = rawpeer.link(port, 4242)
    with s:
        status, lease_id = rawpeer.lease(s, ph.cache_id)
        assert status == S
        req = wire.encode_request(lease_id, tensors.tolist(), off, length)
        t0 = time.monotonic()
        s.sendall(rawpeer.frame(wire.F_READ, req, 9))
        ftype, rreq, body = rawpeer.read_frame(s)
        assert (ftype, rreq) == (wire.F_DONE, 9)
        assert struct.unpack("<I", body)[0] == Status.LLM_PARAM_INVALID
        assert time.monotonic() - t0 < 5.0
        s.sendall(rawpeer.frame(wire.F_WRITE, req, 10) + rawpeer.frame(wire.F_DATA, bytes(4096), 10))
        assert _closed(s)


def test_oversize_snapshots_are_refused(victim: Victim,
                                        victim_proc: PeerProcess) -> None:
    """A hello announcing 400k caches (16 MiB) is refused on its header; one of 40,000 caches
    in 1.7 MB is refused on its count, so are 9 extensions or 4 KiB of them; none leaves an
    entity or memory behind."""
    p, port = victim.p, victim.port
    keys = set(p.entity_keys())
    with rawpeer.connect(port) as s:
        rawpeer.authenticate(s)
        s.sendall(rawpeer.hdr(wire.F_HELLO_LINK, 400_000 * 42 + 64))
        assert _closed(s)
    body = rawpeer.hello_link(5555, caches=40_000)
    assert len(body) <= wire.MAX_HELLO
    with rawpeer.connect(port) as s:
        rawpeer.authenticate(s)
        s.sendall(rawpeer.frame(wire.F_HELLO_LINK, body))
        assert _closed(s)
    too_many = {f"x{i}": b"" for i in range(wire.MAX_EXTENSIONS + 1)}
    too_big = {"x": bytes(wire.MAX_EXTENSION_BYTES)}
    for exts in (too_many, too_big):  # hello extensions beyond their bounds
        with rawpeer.connect(port) as s:
            rawpeer.authenticate(s)
            s.sendall(rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(5556, extensions=exts)))
            assert _closed(s)
    assert set(p.entity_keys()) == keys


def test_never_reading_peer_is_cut_off(victim: Victim,
                                       world: World) -> None:
    """A linked peer that asks for 1 MiB reads and never reads the answers: after MAX_JOBS
    queued requests the victim closes its connection; D is served meanwhile."""
    p, port = victim.p, victim.port
    big = register(p, BIG)
    s, _snap = rawpeer.link(port, 4343)
    with s:
        status, lease_id = rawpeer.lease(s, big.cache_id)
        assert status == S
        req = wire.encode_request(lease_id, [0, 1, 2, 3], np.zeros(1, np.int64),
                                  np.array([1 << 18], np.int64))
        frames = b"".join(rawpeer.frame(wire.F_READ, req, 100 + i) for i in range(4 * wire.MAX_JOBS))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(frames)
        time.sleep(1.0)  # never read: the victim's worker blocks, its queue overflows
        victim.serve_d(world)  # the victim serves D meanwhile
        assert _closed(s, 10.0)  # then the attacker's data and EOF
        victim.serve_d(world)
    p.unregister(big.cache_id)
def test_lease_hog_cannot_block_unregister(victim: Victim,
                                           victim_proc: PeerProcess) -> None:
    """A linked peer announcing SyncKvCacheWaitTime = 2^32-1 takes a lease and sits on it: the
    owner's unregister revokes the idle lease after REVOKE_GRACE_S and returns; the peer's READ under it then
    gets LLM_KV_CACHE_NOT_EXIST and no data."""
    p, port = victim.p, victim.port
    extra = register(p, Spec())
    s, _snap = rawpeer.link(port, 4444, wait_ms=0xFFFFFFFF)
    with s:
        status, lease_id = rawpeer.lease(s, extra.cache_id)
        assert status == S
        t0 = time.monotonic()
        p.unregister(extra.cache_id)
        assert time.monotonic() - t0 < REVOKE_GRACE_S + 2.0  # not the 60 s lease lifetime
        req = wire.encode_request(lease_id, [0], np.zeros(1, np.int64), np.array([64], np.int64))
        s.sendall(rawpeer.frame(wire.F_READ, req, 7))
        ftype, rreq, body = rawpeer.read_frame(s)
        assert (ftype, rreq) == (wire.F_DONE, 7)
        assert struct.unpack("<I", body)[0] == Status.LLM_KV_CACHE_NOT_EXIST


def test_fake_acceptor_learns_nothing(victim: Victim, world: World) -> None:
    """A listener without the secret posing as a peer: the initiator's link fails with
    LLM_LINK_FAILED saying the peer did not prove it holds the secret, and it never sends its
    hello (its cluster id, cache table and addresses) to that listener."""
    d = victim.d
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received: list[bytes] = []

    def fake() -> None:
        conn, _addr = server.accept()
        with conn:
            conn.settimeout(5)
            _t, _r, hello = rawpeer.read_frame(conn)
            conn.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, os.urandom(32) + hello[32:33]))
            rawpeer.read_frame(conn)  # the initiator's proof (useless without the secret)
            conn.sendall(rawpeer.frame(wire.F_AUTH_OK, os.urandom(32)))
            try:
                while chunk := conn.recv(65536):
                    received.append(chunk)
            except OSError:
                pass  # reset by the initiator: what we expect

    t = threading.Thread(target=fake)
    t.start()
    try:
        with pytest.raises(kvdd.LLMError, match="did not prove") as info:
            d.link(port, 9)
        assert info.value.status == Status.LLM_LINK_FAILED
    finally:
        t.join(10)
        server.close()
    assert received == []


# ---- one-request small transfers (LEASE_READ / LEASE_WRITE, served by the victim's reader) -------


def _small(ftype: int, cache_id: int, tensors: list[int], off: int, n: int, req: int,
           runs: int = 1) -> bytes:
    body = wire.encode_request(cache_id, tensors, np.full(runs, off, np.int64),
                               np.full(runs, n, np.int64))
    return rawpeer.frame(ftype, body, req)


def test_small_requests_get_the_statuses_of_lease_and_read(victim: Victim, world: World) -> None:
    """A LEASE_READ of an unknown cache gets LLM_KV_CACHE_NOT_EXIST, one of a run outside the
    cache LLM_PARAM_INVALID (no DATA either time); a valid one the exact bytes, then LLM_SUCCESS."""
    ph, port = victim.ph, victim.port
    s, _snap = rawpeer.link(port, 4545)
    with s:
        for cache_id, off, want in ((ph.cache_id + 1000, 0, Status.LLM_KV_CACHE_NOT_EXIST),
                                    (ph.cache_id, ph.nbytes - 8, Status.LLM_PARAM_INVALID)):
            s.sendall(_small(wire.F_LEASE_READ, cache_id, [0], off, 64, 3))
            ftype, rreq, body = rawpeer.read_frame(s)
            assert (ftype, rreq, struct.unpack("<I", body)[0]) == (wire.F_DONE, 3, want)
        s.sendall(_small(wire.F_LEASE_READ, ph.cache_id, [1, 3], 32, 64, 4))
        ftype, rreq, data = rawpeer.read_frame(s)
        assert (ftype, rreq, len(data)) == (wire.F_DATA, 4, 128)
        tensors = world.snapshot().tensors(ph)
        assert data == bytes(tensors[1][32:96]) + bytes(tensors[3][32:96])
        ftype, rreq, body = rawpeer.read_frame(s)
        assert (ftype, rreq, struct.unpack("<I", body)[0]) == (wire.F_DONE, 4, S)


@pytest.mark.parametrize("case", ["too_many_bytes", "too_many_runs", "truncated", "write_outside",
                                  "write_wrong_data"])
def test_malformed_small_requests_close_the_link(victim: Victim, victim_proc: PeerProcess,
                                                 case: str) -> None:
    """LEASE_READ / LEASE_WRITE beyond SMALL_BYTES or SMALL_MAX_RUNS, truncated, writing outside
    the cache or followed by the wrong DATA: the connection closes, no DATA is sent and no byte
    changes (the fixture checks every arena)."""
    p, port = victim.p, victim.port
    big = register(p, BIG)
    s, _snap = rawpeer.link(port, 4646)
    with s:
        if case == "too_many_bytes":
            s.sendall(_small(wire.F_LEASE_READ, big.cache_id, [0], 0, wire.SMALL_BYTES + 1, 5))
        elif case == "too_many_runs":
            s.sendall(_small(wire.F_LEASE_READ, big.cache_id, [0], 0, 1, 5,
                             runs=wire.SMALL_MAX_RUNS + 1))
        elif case == "truncated":
            body = wire.encode_request(big.cache_id, [0], np.zeros(1, np.int64),
                                       np.full(1, 64, np.int64))
            s.sendall(rawpeer.frame(wire.F_LEASE_READ, body[:-3], 5))  # runs cut short
        elif case == "write_outside":
            s.sendall(_small(wire.F_LEASE_WRITE, big.cache_id, [0], big.nbytes - 32, 64, 5)
                      + rawpeer.frame(wire.F_DATA, bytes(64), 5))
        else:
            s.sendall(_small(wire.F_LEASE_WRITE, big.cache_id, [0], 0, 64, 5)
                      + rawpeer.frame(wire.F_DATA, bytes(64), 6))
        s.settimeout(5.0)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        assert got == b"", "the victim answered a malformed small request"
    p.unregister(big.cache_id)


def test_stalled_small_write_holds_no_cache(victim: Victim, victim_proc: PeerProcess) -> None:
    """A LEASE_WRITE whose DATA never comes holds nothing: the owner's unregister returns at once;
    the DATA sent afterwards is answered LLM_KV_CACHE_NOT_EXIST and written nowhere."""
    p, port = victim.p, victim.port
    extra = register(p, Spec())
    s, _snap = rawpeer.link(port, 4747, wait_ms=0xFFFFFFFF)
    with s:
        s.sendall(_small(wire.F_LEASE_WRITE, extra.cache_id, [0], 0, 64, 8))
        time.sleep(0.1)
        t0 = time.monotonic()
        p.unregister(extra.cache_id)
        assert time.monotonic() - t0 < REVOKE_GRACE_S / 2
        s.sendall(rawpeer.frame(wire.F_DATA, bytes(range(64)), 8))
        ftype, rreq, body = rawpeer.read_frame(s)
        assert (ftype, rreq) == (wire.F_DONE, 8)
        assert struct.unpack("<I", body)[0] == Status.LLM_KV_CACHE_NOT_EXIST


def test_never_reading_small_requests_are_cut_off(victim: Victim, world: World) -> None:
    """A peer sending LEASE_READs of 64 KiB and never reading: the victim's reader never blocks
    on it (answers it cannot send wait in the bounded queue); the connection closes once the
    queue's bytes are full (twice as many answers as fit); D is served meanwhile."""
    p, port = victim.p, victim.port
    big = register(p, BIG)
    s, _snap = rawpeer.link(port, 4848)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        frames = b"".join(_small(wire.F_LEASE_READ, big.cache_id, [0], 0, wire.SMALL_BYTES, 100 + i)
                          for i in range(2 * wire.MAX_QUEUED_BYTES // wire.SMALL_BYTES))
        s.sendall(frames)
        time.sleep(1.0)
        victim.serve_d(world)
        assert _closed(s, 10.0)
        victim.serve_d(world)
    p.unregister(big.cache_id)
