"""A READ sent with its LEASE (one round trip, ``wire.CHAINED_LEASE``): the caller's side against
a raw owner.  Both frames leave before the LEASE's answer; a refused LEASE gives its status, the
destination untouched and the link kept; a pull interrupted after its READ left (a signal
handler's exception) leaves nothing behind and no byte lands after it raised; a caller past its
deadline gets LLM_TIMEOUT; a hostile owner gets no success, no hold past the wait and no byte
outside the destination run.  The owner's side: test_chained_read.py."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvdd import Status
from kvdd.sim import fabric
from kvdd.sim.fabric import wire

from hostile import rawpeer
from hostile.test_chained_read import N, TIMEOUT, link_channel
from hostile.test_small_path_requests import GUARD, S, Honest, Peer, make  # noqa: F401 (fixture)


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
    untouched: list[bool] = []

    def between(h: Honest, peer: Peer) -> None:
        untouched.append(bool((h.arenas[0] == 0x5A).all()))  # guards and destination alike
        ask = struct.pack("<QII", h.caches[0].cache_id, 1, 1) + struct.pack("<Iqq", 0, 0, 64)
        peer.s.sendall(rawpeer.frame(wire.F_LEASE_READ, ask, 500))
        served.append(peer.wait(wire.F_DONE, 500, 1.0))

    frames, statuses, h = _frames_before_answering(make, [Status.LLM_KV_CACHE_NOT_EXIST, S], 0xC3,
                                                   between)
    assert statuses == [Status.LLM_KV_CACHE_NOT_EXIST, S]
    assert untouched == [True] and served == [True]
    assert [f[0] for f in frames] == [wire.F_LEASE, wire.F_READ, wire.F_LEASE, wire.F_READ,
                                      wire.F_RELEASE]
    assert (h.arenas[0][GUARD:GUARD + N] == 0xC3).all()


def _dies(chan: Any, timeout: float = 5.0) -> bool:
    """Whether ``chan`` is dead within ``timeout`` (a kill shuts the socket at once; the pool
    then finds the end)."""
    end = time.monotonic() + timeout
    while not chan.dead.is_set() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(chan.dead.is_set())


class _Signal:
    """A real signal whose handler raises KeyboardInterrupt (as Ctrl-C does), sent to this
    (main) thread from inside ``RemotePeer.receive`` once: after the LEASE's answer, before the
    READ's."""

    def __init__(self) -> None:
        self.fired = 0
        self._orig = fabric.RemotePeer.receive
        sig = self

        def receive(peer: Any, *args: Any) -> Any:
            if not sig.fired:
                sig.fired += 1
                os.kill(os.getpid(), signal.SIGUSR1)  # handled at the next bytecode
                time.sleep(1.0)  # (never reached)
            return sig._orig(peer, *args)

        def handler(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        self._old = signal.signal(signal.SIGUSR1, handler)
        fabric.RemotePeer.receive = receive  # type: ignore[method-assign,assignment]

    def close(self) -> None:
        fabric.RemotePeer.receive = self._orig  # type: ignore[method-assign]
        signal.signal(signal.SIGUSR1, self._old)


@pytest.fixture
def sig() -> Iterator[_Signal]:
    s = _Signal()
    try:
        yield s
    finally:
        s.close()


# -- a pull interrupted after its READ left -------------------------------------------------------

def test_an_interrupted_pull_leaves_no_read_behind(make: Callable[..., Honest],
                                                   sig: _Signal) -> None:
    """The owner grants the LEASE at once and answers the READ only later.  A signal handler's
    exception hits the caller right after the LEASE's answer: the pull raises.  Afterwards no
    request of the caller may stay registered, and the owner's late DATA must not land in the
    destination of the call that already raised (a caller frees it)."""
    h = make(N, n=2)
    reads: list[int] = []
    go = threading.Event()

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE:
            s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", S, 7), req))
        elif ftype == wire.F_READ:
            reads.append(req)
            if len(reads) == 1:
                def late() -> None:
                    go.wait(10)
                    s.sendall(rawpeer.frame(wire.F_DATA, b"\xee" * N, req)
                              + rawpeer.frame(wire.F_DONE, struct.pack("<I", S), req))
                threading.Thread(target=late, daemon=True).start()
            else:
                s.sendall(rawpeer.frame(wire.F_DATA, b"\x11" * N, req)
                          + rawpeer.frame(wire.F_DONE, struct.pack("<I", S), req))

    peer = Peer(h.link(), on)
    try:
        with pytest.raises(KeyboardInterrupt):
            h.pull(0)
        assert sig.fired == 1
        chan = link_channel(h)
        first = h.arenas[0].copy()
        leaked = {req: p for req, p in chan._pending.items()}
        active = chan._active
        go.set()  # the owner's answer to the abandoned READ arrives now
        time.sleep(0.3)
        h.pull(1)  # any later caller reads the connection
        time.sleep(0.1)
        changed = int(np.count_nonzero(h.arenas[0] != first))
        assert changed == 0, f"{changed} bytes landed after the pull raised"
        assert not leaked and active == 0, (leaked, active)
    finally:
        peer.close()


def test_an_interrupted_pull_breaks_its_link_at_once(make: Callable[..., Honest],
                                                     sig: _Signal) -> None:
    """The owner grants the LEASE and has not answered the READ when the pull is interrupted:
    the link is broken at once (the READ's answer may still come, and would break it in the
    middle of a later call), nothing of the pull stays counted, and the next pull gets
    LLM_TIMEOUT (relink: SEMANTICS.md §10 rule 8)."""
    h = make(N)

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE:
            s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", S, 7), req))

    peer = Peer(h.link(), on)
    try:
        with pytest.raises(KeyboardInterrupt):
            h.pull(0)
        chan = link_channel(h)
        assert _dies(chan)
        assert not chan._pending and chan._active == 0, (chan._pending, chan._active)
        assert h.pull(0) == TIMEOUT
    finally:
        peer.close()


@pytest.mark.parametrize("waiting_for", ["lease", "read"])
def test_an_interrupted_wait_leaves_no_read_behind(make: Callable[..., Honest],
                                                   waiting_for: str) -> None:
    """The caller interrupted while it waits for its LEASE's answer, or for its READ's, as a
    waiter whose reply another thread reads (so its own reading kills no link): the READ is
    given up (once), nothing of the pull stays registered or counted, the link is broken, and
    the destination is untouched."""
    h = make(N)

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE and waiting_for == "read":
            s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", S, 7), req))

    peer = Peer(h.link(), on)
    orig = fabric.channel.Channel._await

    def interrupted(chan: Any, p: Any, deadline: float) -> bool:
        if (p.sink is None) == (waiting_for == "lease"):
            raise KeyboardInterrupt
        return orig(chan, p, deadline)

    fabric.channel.Channel._await = interrupted  # type: ignore[method-assign,assignment]
    try:
        before = h.arenas[0].copy()
        with pytest.raises(KeyboardInterrupt):
            h.pull(0)
        fabric.channel.Channel._await = orig  # type: ignore[method-assign]
        chan = link_channel(h)
        assert _dies(chan)
        assert not chan._pending and chan._active == 0, (chan._pending, chan._active)
        assert np.array_equal(h.arenas[0], before)
    finally:
        fabric.channel.Channel._await = orig  # type: ignore[method-assign]
        peer.close()


def test_a_caller_late_past_its_deadline_gets_timeout(make: Callable[..., Honest]) -> None:
    """The owner answers LEASE and READ at once; the caller's thread is late (descheduled, a GC
    pause: held past SyncKvCacheWaitTime) after the LEASE's answer, though the READ's DONE and
    every byte were read in time.  As when a READ was sent only after its lease's answer (a
    caller past its deadline then sent none): LLM_TIMEOUT and the link broken, so the next pull
    gets LLM_TIMEOUT too; never LLM_SUCCESS on a link broken behind the caller's back."""
    n = (64 << 10) + 4096  # just too big for a LEASE_READ
    h = make(n, n=2, wait_ms=300)
    leases: dict[int, int] = {}

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE:
            leases[0] = req
        elif ftype == wire.F_READ:
            s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", S, 7), leases[0])
                      + rawpeer.frame(wire.F_DATA, b"\xee" * n, req)
                      + rawpeer.frame(wire.F_DONE, struct.pack("<I", S), req))

    orig = fabric.RemotePeer.receive
    late = [True]
    seen: list[bool] = []

    def receive(peer: Any, read: Any, deadline: float) -> Any:
        if late[0]:
            late[0] = False
            # the answer is read in time by whoever leads the receive side (this thread here)
            assert peer._chan._await(read, deadline)
            seen.append(read.done and not read.failed)
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
        return orig(peer, read, deadline)

    peer = Peer(h.link(caches=2), on)
    fabric.RemotePeer.receive = receive  # type: ignore[method-assign,assignment]
    try:
        first = h.pull(0)
        second = h.pull(1, remote=2)
        assert seen == [True], "the answer was not in before the deadline (inconclusive)"
        assert (first, second) == (TIMEOUT, TIMEOUT), (first, second)
    finally:
        fabric.RemotePeer.receive = orig  # type: ignore[method-assign]
        peer.close()


# -- hostile owners ----------------------------------------------------------------------------------

def _lease_reply_frame(req: int, status: int = S, lease_id: int = 7) -> bytes:
    return rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", status, lease_id), req)


def _done_frame(req: int, status: int = S) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)


_OWNERS: dict[str, Callable[[socket.socket, int, int], None]] = {
    # (socket, LEASE request, READ request): sent once both arrived
    "silent": lambda s, lr, rr: None,
    "lease_then_silent": lambda s, lr, rr: s.sendall(_lease_reply_frame(lr)),
    "refused_then_silent": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr, Status.LLM_KV_CACHE_NOT_EXIST, 0)),
    "lease_then_half_the_data": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr) + rawpeer.frame(wire.F_DATA, b"\xab" * (N // 2), rr)),
    "success_without_all_bytes": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr) + rawpeer.frame(wire.F_DATA, b"\xab" * (N // 2), rr)
        + _done_frame(rr)),
    "read_answered_first_then_refused": lambda s, lr, rr: s.sendall(
        rawpeer.frame(wire.F_DATA, b"\xab" * N, rr) + _done_frame(rr)
        + _lease_reply_frame(lr, Status.LLM_KV_CACHE_NOT_EXIST, 0)),
    "replies_swapped": lambda s, lr, rr: s.sendall(
        _done_frame(lr) + _lease_reply_frame(rr)),
    "huge_data_header_then_silence": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr) + rawpeer.hdr(wire.F_DATA, 64 << 20, rr)),
    "too_much_data": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr) + rawpeer.frame(wire.F_DATA, b"\xab" * (N + 1), rr)),
    "lease_reply_twice": lambda s, lr, rr: s.sendall(
        _lease_reply_frame(lr) + _lease_reply_frame(lr)
        + rawpeer.frame(wire.F_DATA, b"\xab" * N, rr) + _done_frame(rr)),
}


@pytest.mark.parametrize("case", list(_OWNERS))
def test_a_hostile_owner_of_a_chained_pull(make: Callable[..., Honest], case: str) -> None:
    """Each hostile answer to LEASE + chained READ: the pull ends within its wait (500 ms) +
    100 ms, never with LLM_SUCCESS, and no byte outside the destination run changes."""
    h = make(N)
    asked: list[tuple[int, int]] = []

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        asked.append((ftype, req))
        if ftype == wire.F_READ and len(asked) >= 2 and asked[-2][0] == wire.F_LEASE:
            _OWNERS[case](s, asked[-2][1], req)

    peer = Peer(h.link(), on)
    try:
        before = h.arenas[0].copy()
        t0 = time.monotonic()
        status = h.pull()
        took = time.monotonic() - t0
        assert status != S
        assert took < 0.6, (status, took)
        changed = np.flatnonzero(h.arenas[0] != before)
        assert changed.size == 0 or (changed.min() >= GUARD and changed.max() < GUARD + N)
    finally:
        peer.close()


def test_a_refused_lease_leaves_the_destination_only_with_an_honest_owner(
        make: Callable[..., Honest]) -> None:
    """A refused LEASE leaves the destination untouched when the owner is honest.  A hostile one
    refuses the LEASE and still sends the READ's DATA, which goes straight into the destination
    (the documented residual of a big READ refused after its DATA, docs/security.md); the pull
    raises the LEASE's status and nothing outside the run changes."""
    h = make(N)

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE:
            s.sendall(_lease_reply_frame(req, Status.LLM_KV_CACHE_NOT_EXIST, 0))
        elif ftype == wire.F_READ:
            s.sendall(rawpeer.frame(wire.F_DATA, b"\xab" * N, req) + _done_frame(req, TIMEOUT))

    peer = Peer(h.link(), on)
    try:
        before = h.arenas[0].copy()
        assert h.pull() == Status.LLM_KV_CACHE_NOT_EXIST
        changed = np.flatnonzero(h.arenas[0] != before)
        assert changed.size == N  # the residual: the hostile bytes are in the destination
        assert changed.min() >= GUARD and changed.max() < GUARD + N
    finally:
        peer.close()


def test_a_read_that_cannot_be_built_breaks_the_link(make: Callable[..., Honest],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the READ fails after its LEASE left (the LEASE may be granted, the owner waits
    for a READ): the pull raises that error, nothing of it stays registered, the link is
    broken and the destination untouched."""
    h = make(N)
    peer = Peer(h.link(), None)  # an owner that answers nothing

    def broken(*args: Any) -> Any:
        raise ValueError("run outside its region")

    monkeypatch.setattr(fabric.peers, "Layout", broken)
    try:
        before = h.arenas[0].copy()
        with pytest.raises(ValueError, match="run outside its region"):
            h.pull(0)
        chan = link_channel(h)
        assert _dies(chan)
        assert not chan._pending and chan._active == 0, (chan._pending, chan._active)
        assert np.array_equal(h.arenas[0], before)
    finally:
        peer.close()
