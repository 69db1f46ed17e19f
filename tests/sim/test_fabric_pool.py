"""The fabric's shared pool (kvdd/sim/fabric/reactor.py): links have no threads of their own.

Connections are :class:`~kvdd.sim.fabric.channel.Channel` objects over socket pairs, driven by a
raw peer on the other end (PING answered with PONG by the connection's queue of jobs).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvdd.status import S_OK
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.auth import Session
from kvdd.sim.fabric.handshake import serve_link
from kvdd.sim.fabric.protocol import LinkOffer, PeerHandle, RemoteCache, ServedCache
from kvdd.sim.fabric.wire import Writer, encode_extensions, encode_offer, encode_snapshot
from kvdd.sim.fabric.channel import Channel, GoneOwner
from kvdd.sim.fabric.reactor import POOL_THREADS, REACTOR

import pytest

from hostile import rawpeer
from hostile.rawpeer import MinimalOwner
from shared_support import passes_in_a_forked_child

PONG_WAIT_S = 5.0




def _read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    head = b""
    while len(head) < wire.HDR.size:
        got = s.recv(wire.HDR.size - len(head))
        assert got, "the connection ended"
        head += got
    _magic, _version, ftype, req, length = wire.HDR.unpack(head)
    body = b""
    while len(body) < length:
        got = s.recv(length - len(body))
        assert got, "the connection ended"
        body += got
    return ftype, req, body


def _open(n: int, owner: MinimalOwner) -> list[tuple[Channel, socket.socket]]:
    out = []
    for i in range(n):
        mine, theirs = socket.socketpair()
        theirs.settimeout(PONG_WAIT_S)
        chan = Channel(mine, owner, f"pool-test-{i}")  # type: ignore[arg-type]
        chan.start()
        out.append((chan, theirs))
    return out


def _close(links: list[tuple[Channel, socket.socket]]) -> None:
    for chan, theirs in links:
        chan.kill()
        theirs.close()
    deadline = time.monotonic() + 5
    while any(not chan.dead.is_set() for chan, _ in links) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(chan.dead.is_set() for chan, _ in links)


def _ping(theirs: socket.socket, req: int) -> None:
    theirs.sendall(rawpeer.frame(wire.F_PING, req=req))
    assert _read_frame(theirs)[:2] == (wire.F_PONG, req)


def test_threads_do_not_grow_with_links() -> None:
    """1 connection and 64 connections, each answering a PING: the process has the same
    threads (the pool's POOL_THREADS at most, started with the first connection), never one
    per connection."""
    owner = MinimalOwner()
    base = threading.active_count()
    one = _open(1, owner)
    try:
        _ping(one[0][1], 1)
        with_one = threading.active_count()
        assert with_one - base <= POOL_THREADS
        many = _open(63, owner)
        try:
            for i, (_chan, theirs) in enumerate(many):
                _ping(theirs, 100 + i)
            _ping(one[0][1], 2)
            assert threading.active_count() == with_one
            assert REACTOR.threads == POOL_THREADS
        finally:
            _close(many)
    finally:
        _close(one)


def test_a_peer_that_does_not_read_stalls_no_other_link() -> None:
    """2 x POOL_THREADS peers send small reads (LEASE_READ of one run: answered inline, 16 bytes
    each) as fast as they can and never read the answers: their sockets fill, the rest of the
    answers wait for the sending side (which waits for the socket without a thread), then in the
    queue, and each is cut off at the queue bound; meanwhile another connection answers its PINGs
    at once, and every flooding one ends."""
    owner = MinimalOwner()
    stuck = _open(2 * POOL_THREADS, owner)
    live = _open(1, owner)
    try:
        one_run = struct.pack("<QII", 5, 1, 1) + struct.pack("<Iqq", 0, 0, 64)
        pings = b"".join(rawpeer.frame(wire.F_LEASE_READ, one_run, 1 + i) for i in range(1000))
        stop = time.monotonic() + 10

        def flood(s: socket.socket) -> None:
            try:
                while time.monotonic() < stop:
                    s.sendall(pings)
            except OSError:  # cut off: what the bound does
                pass

        floods = [threading.Thread(target=flood, args=(s,), daemon=True) for _c, s in stuck]
        for t in floods:
            t.start()
        time.sleep(0.3)
        for i in range(20):
            t0 = time.monotonic()
            _ping(live[0][1], 1000 + i)
            assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + 10
        while (not all(chan.dead.is_set() for chan, _ in stuck)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert all(chan.dead.is_set() for chan, _ in stuck)
        assert not live[0][0].dead.is_set()
        for t in floods:
            t.join(15)
    finally:
        _close(stuck + live)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """A child forked while the pool runs has none of its threads (they did not survive the
    fork) and its own epoll set: a connection it makes is served by a pool it starts."""
    owner = MinimalOwner()
    links = _open(1, owner)
    try:
        _ping(links[0][1], 1)

        def in_child() -> bool:
            if REACTOR.threads != 0:
                return False
            child = _open(1, owner)
            _ping(child[0][1], 5)
            return REACTOR.threads == POOL_THREADS

        passes_in_a_forked_child(in_child)
        _ping(links[0][1], 2)  # the parent's pool is untouched
    finally:
        _close(links)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def test_a_half_sent_payload_costs_what_arrived() -> None:
    """32 peers announce a READ of 4 MiB (the bound of a request) and send 8 KiB of it, then
    wait: the pool reads what arrived and no more (memory grows with the bytes that came, not the
    announced length: 32 x 4 MiB would be 128 MiB), and the other links are served meanwhile;
    a peer that then sends the rest has its request handled (here refused: it is malformed)."""
    owner = MinimalOwner()
    live = _open(1, owner)
    _ping(live[0][1], 1)
    rss0 = _rss_mib()
    half = _open(32, owner)
    try:
        head = wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_READ, 9, wire.MAX_REQUEST)
        for _chan, theirs in half:
            theirs.sendall(head + bytes(8192))
        time.sleep(0.5)
        _ping(live[0][1], 2)
        grown = _rss_mib() - rss0
        assert grown < 32, f"RSS grew by {grown:.0f} MiB"
        assert not any(chan.dead.is_set() for chan, _ in half)
        chan, theirs = half[0]
        theirs.sendall(bytes(wire.MAX_REQUEST - 8192))  # the rest: a malformed request
        deadline = time.monotonic() + 5
        while not chan.dead.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert chan.dead.is_set()
    finally:
        _close(half + live)


def test_a_connection_closed_before_it_started_fails_to_start_with_oserror() -> None:
    """An unlink can close the acceptor's connection before its handshake worker starts it (the
    link's reply and same-host answer are out by then): start() says so with OSError, which the
    worker handles by ending the connection, instead of a ValueError from the poller."""
    a, b = socket.socketpair()
    with b:
        chan = Channel(a, GoneOwner(1), "closed-first")
        a.close()
        with pytest.raises(OSError, match="closed before it started"):
            chan.start()
        chan.kill()
        assert chan.dead.is_set()


class _UnlinkedAtOnce(MinimalOwner):
    """Makes the entity, then (as our unlink, finalize or a replacing link on another thread
    would) closes it before the handshake worker sends the reply."""

    def snapshot_for_link(self) -> tuple[dict[int, RemoteCache], dict[int, ServedCache]]:
        return {}, {}

    def serve_link(self, peer: LinkOffer, force_link: bool, make_handle: Callable[[], PeerHandle]
                   ) -> tuple[int, str, tuple[dict[int, RemoteCache], dict[int, ServedCache]]]:
        make_handle().close()
        return S_OK, "", ({}, {})

    def peer_unlinked(self, peer_cluster_id: int) -> int:
        return S_OK


def test_a_link_closed_before_its_reply_ends_without_an_error() -> None:
    """Our side may close a link (unlink, finalize, a replacing link) right after the engine made
    it, while the handshake worker has still to send the reply: the connection is closed under
    the worker, which ends the link as one whose reply could not be sent (no OSError out of
    serve_link, so no "handshake ended" warning and no half-done accounting)."""
    a, b = socket.socketpair()
    with b:
        w = Writer()
        encode_offer(w, LinkOffer(3, "comm", None, 1000))
        w.pack("B", 0)
        w.text("")
        encode_snapshot(w, {})
        encode_extensions(w, {})
        session = Session(bytes(32), bytes(32), False, 7, 3, "", False, b"", b"")
        finished: list[socket.socket] = []
        assert not serve_link(_UnlinkedAtOnce(), a, memoryview(bytes(w.buf)), session,
                              finish=finished.append)
        assert finished == [a] and a.fileno() < 0
