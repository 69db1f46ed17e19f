"""A READ sent with its LEASE (one round trip, ``wire.CHAINED_LEASE``), on both ends.

The owner's side against a raw peer: the READ gets the lease its LEASE request got, exactly once,
and nothing when that LEASE was refused, named another request, or was forgotten (the owner
remembers the last ``MAX_LEASES`` LEASE requests of a connection).  The caller's side against a raw
owner: both frames leave before the LEASE's answer, a refused LEASE gives its status with the
destination untouched and the link kept."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import numpy as np

from kvdd import Status
from kvdd.sim.fabric import wire

from hostile import rawpeer
from hostile.test_small_path_requests import GUARD, S, Honest, Peer, make  # noqa: F401 (fixture)

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
        assert _lease_reply_of(s, cid, 1)[0] == S
        for req in range(2, 2 + later):
            status, lease_id = _lease_reply_of(s, cid, req)
            assert status == S
            s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id)))
        s.sendall(rawpeer.frame(wire.F_READ, _read(wire.CHAINED_LEASE | 1), 9999))
        return _answer(s, 9999)


def _lease_reply_of(s: socket.socket, cid: int, req: int) -> tuple[int, int]:
    s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", cid), req))
    return _lease_reply(s, req)


def test_the_owner_remembers_the_last_max_leases_lease_requests(make: Callable[..., Honest]) -> None:
    """The owner keeps the lease of at most MAX_LEASES LEASE requests per connection for a READ
    to name: with MAX_LEASES - 1 after it, LEASE 1 is still named (all its bytes); one more and
    it is forgotten (LLM_TIMEOUT, no byte), though the lease itself lives on."""
    data, status = _remembered_after(make, wire.MAX_LEASES - 1)
    assert status == S and len(data) == N
    assert _remembered_after(make, wire.MAX_LEASES) == (b"", TIMEOUT)


def _frames_before_answering(
        make: Callable[..., Honest], lease_statuses: list[Status], fill: int,
        between: Callable[[Honest, Peer], None] | None = None,
) -> tuple[list[tuple[int, int, bytes]], list[Status], Honest]:
    """An honest caller pulls N bytes from a raw owner once per entry of ``lease_statuses``;
    the owner reads a LEASE and the next frame before it answers either: the LEASE with the
    entry's status (lease 7), then, for a granted lease, the READ's DATA (``fill`` bytes) and
    DONE, else a DONE with LLM_TIMEOUT; ``between`` runs after the first pull.  Every frame the
    owner read (its own reads' answers not included), and each pull's status."""
    h = make(N)
    frames: list[tuple[int, int, bytes]] = []
    asked: list[tuple[int, int, bytes]] = []
    answers = iter(lease_statuses)

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype in (wire.F_DATA, wire.F_DONE):  # the answer to the owner's own read
            return
        frames.append((ftype, req, body))
        if ftype == wire.F_RELEASE:
            return
        asked.append((ftype, req, body))
        if len(asked) < 2:
            return
        (lt, lreq, _), (rt, rreq, _) = asked
        asked.clear()
        if (lt, rt) != (wire.F_LEASE, wire.F_READ):
            return  # the caller waits for an answer that does not come: its pull fails
        lease_status = next(answers)
        s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", lease_status, 7), lreq))
        if lease_status == S:
            s.sendall(rawpeer.frame(wire.F_DATA, bytes([fill]) * N, rreq)
                      + rawpeer.frame(wire.F_DONE, struct.pack("<I", S), rreq))
        else:
            s.sendall(rawpeer.frame(wire.F_DONE, struct.pack("<I", TIMEOUT), rreq))

    peer = Peer(h.link(), on)
    try:
        statuses: list[Status] = []
        for status in lease_statuses:
            statuses.append(h.pull())
            if between is not None and len(statuses) == 1:
                between(h, peer)
        if lease_statuses[-1] == S:  # sent as the pull returns
            assert peer.wait(wire.F_RELEASE, 0, 5.0)
    finally:
        peer.close()
    return frames, statuses, h


def test_the_caller_sends_the_read_with_its_lease(make: Callable[..., Honest]) -> None:
    """The caller's LEASE and its READ (naming the LEASE's request) both reach the owner before
    the owner answered anything; the pull lands every byte, then releases lease 7."""
    frames, statuses, h = _frames_before_answering(make, [S], 0xC3)
    assert statuses == [S]
    (lt, lreq, lbody), (rt, rreq, rbody) = frames[:2]
    assert (lt, rt) == (wire.F_LEASE, wire.F_READ)
    assert struct.unpack("<Q", lbody) == (1,)  # the raw owner's cache 1
    field, tensors, off, length = wire.decode_request(rbody)
    assert field == wire.CHAINED_LEASE | lreq and rreq != lreq
    assert (tensors.tolist(), off.tolist(), length.tolist()) == ([0], [0], [N])
    assert (h.arenas[0][GUARD:GUARD + N] == 0xC3).all()
    assert (h.arenas[0][:GUARD] == 0x5A).all() and (h.arenas[0][GUARD + N:] == 0x5A).all()
    assert frames[2:] == [(wire.F_RELEASE, 0, struct.pack("<Q", 7))]


def test_a_refused_lease_leaves_the_destination_and_the_link(make: Callable[..., Honest]) -> None:
    """The owner refuses the LEASE (LLM_KV_CACHE_NOT_EXIST) and answers the READ with a DONE:
    the pull raises the LEASE's status, no byte of the destination changed, nothing is
    released (no lease was granted), the link still answers the owner's own reads at once
    (no request of the caller is left waiting), and the next pull lands every byte."""
    served: list[bool] = []

    def between(h: Honest, peer: Peer) -> None:
        ask = struct.pack("<QII", h.caches[0].cache_id, 1, 1) + struct.pack("<Iqq", 0, 0, 64)
        peer.s.sendall(rawpeer.frame(wire.F_LEASE_READ, ask, 500))
        served.append(peer.wait(wire.F_DONE, 500, 1.0))

    frames, statuses, h = _frames_before_answering(make, [Status.LLM_KV_CACHE_NOT_EXIST, S], 0xC3,
                                                   between)
    assert statuses == [Status.LLM_KV_CACHE_NOT_EXIST, S]
    assert served == [True]
    assert [f[0] for f in frames] == [wire.F_LEASE, wire.F_READ, wire.F_LEASE, wire.F_READ,
                                      wire.F_RELEASE]
    assert (h.arenas[0][GUARD:GUARD + N] == 0xC3).all()
