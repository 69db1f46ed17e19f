"""A READ sent with its LEASE (one round trip, ``wire.CHAINED_LEASE``): the owner's side against a
raw peer.  The READ gets the lease its LEASE request got, exactly once, and nothing when that LEASE
was refused, named another request or connection, was released, expired, revoked or forgotten (the
owner remembers the last ``MAX_LEASES`` LEASE requests of a connection), and the owner stays
bounded.  The caller's side: test_chained_read_caller.py."""

from __future__ import annotations

import gc
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvdd import Status
from kvdd.sim import faults
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.channel import Channel

from hostile import rawpeer
from hostile.test_small_path_requests import GUARD, S, Honest, make  # noqa: F401 (fixture)

N = 256 << 10  # a pull too big for one LEASE_READ: LEASE and READ
TIMEOUT = Status.LLM_TIMEOUT


def _read(field: int, nbytes: int = N) -> bytes:
    return wire.encode_request(field, [0], np.zeros(1, np.int64), np.array([nbytes], np.int64))


def _answer(s: socket.socket, req: int) -> tuple[bytes, int]:
    """The DATA bytes and the DONE status of READ ``req`` (nothing else may come meanwhile)."""
    data = bytearray()
    while True:
        ftype, rreq, body = rawpeer.read_frame(s)
        assert rreq == req, (ftype, rreq)
        if ftype == wire.F_DONE:
            return bytes(data), struct.unpack("<I", body)[0]
        assert ftype == wire.F_DATA, ftype
        data += body


def _lease_reply(s: socket.socket, req: int) -> tuple[int, int]:
    ftype, rreq, body = rawpeer.read_frame(s)
    assert (ftype, rreq) == (wire.F_LEASE_REPLY, req)
    status, lease_id = struct.unpack("<IQ", body)
    return status, lease_id


def _owner(make: Callable[..., Honest]) -> tuple[Honest, socket.socket, bytes]:
    """An owner with one cache of N pattern bytes, and a raw peer linked to it."""
    h = make(N)
    pattern = (np.arange(N) % 251).astype(np.uint8)
    h.arenas[0][GUARD:GUARD + N] = pattern
    s = h.link(caches=0)
    s.settimeout(10)
    return h, s, pattern.tobytes()


def test_a_read_sent_with_its_lease_gets_that_lease(make: Callable[..., Honest]) -> None:
    """LEASE 5 and a READ naming it, sent together: the lease's answer, then every byte of the
    cache and DONE with success; the name is good once (a second READ naming it gets
    LLM_TIMEOUT and no byte), the lease itself stays usable by its id until released."""
    h, s, pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), 5)
                  + rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 6))
        status, lease_id = _lease_reply(s, 5)
        assert status == S and lease_id
        assert _answer(s, 6) == (pattern, S)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 7))
        assert _answer(s, 7) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_READ, _read(lease_id, 64), 8))
        assert _answer(s, 8) == (pattern[:64], S)


def test_a_read_gets_nothing_without_its_lease(make: Callable[..., Honest]) -> None:
    """A READ naming a refused LEASE (an unknown cache), a request that was no LEASE, or its
    LEASE's id with any other bit of the lease field set: DONE with LLM_TIMEOUT and no DATA;
    the connection serves on."""
    h, s, pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid + 100), 1)
                  + rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 1), 2))
        assert _lease_reply(s, 1)[0] == Status.LLM_KV_CACHE_NOT_EXIST
        assert _answer(s, 2) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 3), 4))  # 3: no LEASE
        assert _answer(s, 4) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), 5))
        assert _lease_reply(s, 5)[0] == S
        for bit in (32, 62):  # request 5 with a bit between the id and the flag
            s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 1 << bit | 5), 6))
            assert _answer(s, 6) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 7))
        assert _answer(s, 7) == (pattern, S)


def _remembered_after(make: Callable[..., Honest], later: int) -> tuple[bytes, int]:
    """LEASE 1 (kept), then ``later`` LEASE requests each released at once: what a READ naming
    request 1 gets."""
    h, s, _pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        assert _lease(s, cid, 1)[0] == S
        for req in range(2, 2 + later):
            status, lease_id = _lease(s, cid, req)
            assert status == S
            s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id)))
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 1), 9999))
        return _answer(s, 9999)


def _lease(s: socket.socket, cid: int, req: int) -> tuple[int, int]:
    s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), req))
    return _lease_reply(s, req)


def test_the_owner_remembers_the_last_max_leases_lease_requests(make: Callable[..., Honest]) -> None:
    """The owner keeps the lease of at most MAX_LEASES LEASE requests per connection for a READ
    to name: with MAX_LEASES - 1 after it, LEASE 1 is still named (all its bytes); one more and
    it is forgotten (LLM_TIMEOUT, no byte), though the lease itself lives on."""
    data, status = _remembered_after(make, wire.MAX_LEASES - 1)
    assert status == S and len(data) == N
    assert _remembered_after(make, wire.MAX_LEASES) == (b"", TIMEOUT)


def link_channel(h: Honest) -> Any:
    """The channel of ``h``'s one link, alive or dead."""
    backend: object = h.dd.backend
    chans = [o for o in gc.get_objects() if isinstance(o, Channel) and o.owner is backend]
    assert len(chans) == 1, chans
    return chans[0]


def test_another_connections_lease_gives_nothing(make: Callable[..., Honest]) -> None:
    """A READ on connection B naming a LEASE request of connection A, or A's lease id: no byte,
    LLM_TIMEOUT; A's READ naming it still gets every byte."""
    h, a, pattern = _owner(make)
    cid = h.caches[0].cache_id
    port = h.dd.listen_port
    assert port
    b, _snap = rawpeer.link(port, 9200)
    b.settimeout(10)
    with a, b:
        status, lease_id = _lease(a, cid, 5)
        assert status == S
        b.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 6))
        assert _answer(b, 6) == (b"", TIMEOUT)
        b.sendall(rawpeer.frame(wire.F_READ, _read(lease_id), 7))
        assert _answer(b, 7) == (b"", TIMEOUT)
        a.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 8))
        assert _answer(a, 8) == (pattern, S)


def test_released_expired_and_early_named_leases_give_nothing(make: Callable[..., Honest]) -> None:
    """A READ naming a LEASE whose lease was released, one naming a LEASE request that comes
    only after it (that LEASE is then granted as usual), and one naming a lease that expired
    (the raw peer's wait of 1000 ms plus the 250 ms grace): no byte, LLM_TIMEOUT."""
    h, s, _pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        status, lease_id = _lease(s, cid, 5)
        assert status == S
        s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id))
                  + rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 6))
        assert _answer(s, 6) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 9), 10))
        assert _answer(s, 10) == (b"", TIMEOUT)
        assert _lease(s, cid, 9)[0] == S
        assert _lease(s, cid, 11)[0] == S
        time.sleep(1.4)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 11), 12))
        assert _answer(s, 12) == (b"", TIMEOUT)


def test_a_revoked_lease_named_by_its_request_gives_not_exist(make: Callable[..., Honest]) -> None:
    """The cache unregistered while the lease sat unused (revoked after REVOKE_GRACE_S): the
    READ naming its LEASE request gets LLM_KV_CACHE_NOT_EXIST and no byte, as a READ naming
    the lease id would."""
    h, s, _pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        assert _lease(s, cid, 5)[0] == S
        t = threading.Thread(target=h.dd.unregister_kv_cache, args=(cid,))
        t.start()
        time.sleep(1.3)
        t.join(10)
        assert not t.is_alive()
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 6))
        assert _answer(s, 6) == (b"", Status.LLM_KV_CACHE_NOT_EXIST)


def test_reused_request_ids_and_the_lease_cap(make: Callable[..., Honest]) -> None:
    """Two LEASEs under one request id: the name gives the newer lease, once, and the older
    lives on by its id; a LEASE refused at the cap of MAX_LEASES (LLM_FAILED) names nothing;
    the owner's names stay within MAX_LEASES."""
    h, s, pattern = _owner(make)
    cid = h.caches[0].cache_id
    with s:
        st1, l1 = _lease(s, cid, 5)
        st2, l2 = _lease(s, cid, 5)
        assert (st1, st2) == (S, S) and l1 != l2
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5, 64), 6))
        assert _answer(s, 6) == (pattern[:64], S)
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5, 64), 7))
        assert _answer(s, 7) == (b"", TIMEOUT)
        s.sendall(rawpeer.frame(wire.F_READ, _read(l1, 64), 8))
        assert _answer(s, 8) == (pattern[:64], S)
        for req in range(100, 100 + wire.MAX_LEASES - 2):
            assert _lease(s, cid, req)[0] == S
        assert _lease(s, cid, 999)[0] == Status.LLM_FAILED
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 999, 64), 1000))
        assert _answer(s, 1000) == (b"", TIMEOUT)
        assert len(link_channel(h).leases._by_request) <= wire.MAX_LEASES


def test_many_chained_reads_keep_the_owner_bounded(make: Callable[..., Honest]) -> None:
    """3,000 LEASE (+ READ naming it, every other time) + RELEASE rounds: no lease and at most
    MAX_LEASES names left, and this process's peak RSS grows by less than 64 MiB."""
    h, s, pattern = _owner(make)
    cid = h.caches[0].cache_id
    chan = link_channel(h)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with s:
        for i in range(3000):
            req = 2 * i + 1
            batch = rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), req)
            if i % 2:
                batch += rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | req, 64), req + 1)
            s.sendall(batch)
            status, lease_id = _lease_reply(s, req)
            assert status == S
            if i % 2:
                assert _answer(s, req + 1) == (pattern[:64], S)
            s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id)))
        time.sleep(0.1)
        assert len(chan.leases._by_request) <= wire.MAX_LEASES
        assert len(chan.leases._leases) == 0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss1 - rss0 < 64 << 10  # KiB


def test_with_a_serving_fault_armed_the_read_follows_its_lease(make: Callable[..., Honest]) -> None:
    """Armed fault injections queue the LEASE instead of answering it at once: the READ sent
    with it is still served under that lease."""
    h, s, pattern = _owner(make)
    cid = h.caches[0].cache_id
    with faults.inject("pull", delay_ms=30, serve=True), s:
        s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), 5)
                  + rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 5), 6))
        assert _lease_reply(s, 5)[0] == S
        assert _answer(s, 6) == (pattern, S)
