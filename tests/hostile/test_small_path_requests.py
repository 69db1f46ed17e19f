"""Requests on the one-request small TCP path (the caller reads its own reply, one deadline guard
per connection, LEASE_READ bytes staged until DONE) against hostile and busy peers: a peer's
request read along with a reply is served, many small reads in flight keep the link, a hostile
owner cannot hold callers past their wait time, replies reach their own callers, no byte lands
after a request returned, and the documented residual (docs/security.md): a big READ refused
after its DATA leaves that DATA in its destination."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvdd
from kvdd import Status
from kvdd.sim.fabric import LinkOffer, wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.streams import Cursor, Layout
from kvdd.sim.memory import Region

from hostile import rawpeer

S = Status.LLM_SUCCESS
ATTACKER = 9100
GUARD = 4096
Reply = Callable[[socket.socket, int, int, bytes], None]  # (sock, type, request id, payload)


def _done(req: int, status: int) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)


def _data(req: int, payload: bytes) -> bytes:
    return rawpeer.frame(wire.F_DATA, payload, req)


def _hello(caches: int, nbytes: int) -> bytes:
    """A HELLO_LINK announcing ``caches`` one-tensor caches (ids 1..caches) of ``nbytes``."""
    w = wire.Writer()
    wire.encode_offer(w, LinkOffer(ATTACKER, "comm", None, 1000))
    w.pack("B", 1)
    w.text("not-a-boot-id")
    w.pack("I", caches)
    for cid in range(1, caches + 1):
        w.raw(wire.RC.pack(cid, 1, nbytes, 1, nbytes, 0, 0) + struct.pack("<Q", 0x1000))
    wire.encode_extensions(w, {})
    return bytes(w.buf)


class Honest:
    """An instance in this process that listens, with ``n`` one-tensor caches of ``nbytes`` (each
    between guard bytes); a raw peer links to it announcing ``n`` caches of ``nbytes``."""

    def __init__(self, nbytes: int, n: int = 1, wait_ms: int = 500) -> None:
        self.nbytes = nbytes
        self.dd = kvdd.LlmDataDist(ATTACKER + 1, kvdd.LlmRole.DECODER, backend="sim")
        self.dd.initialize({kvdd.OPTION_DEVICE_ID: "0",
                            kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                            kvdd.OPTION_SYNC_CACHE_WAIT_TIME: str(wait_ms)})
        self.desc = kvdd.CacheDesc(1, kvdd.DataType.DT_UINT8, (1, nbytes))
        self.arenas = [np.full(nbytes + 2 * GUARD, 0x5A, dtype=np.uint8) for _ in range(n)]
        self.caches = []
        for arena in self.arenas:
            addr = int(arena.ctypes.data) + GUARD
            cid = self.dd.register_kv_cache(self.desc, [addr])
            self.caches.append(kvdd.Cache(cid, (addr,), self.desc))

    def link(self, caches: int = 1) -> socket.socket:
        port = self.dd.listen_port
        assert port
        s = rawpeer.connect(port)
        rawpeer.authenticate(s)
        s.sendall(rawpeer.frame(wire.F_HELLO_LINK, _hello(caches, self.nbytes)))
        ftype, _req, body = rawpeer.read_frame(s)
        assert ftype == wire.F_LINK_REPLY and struct.unpack_from("<I", body)[0] == 0
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def pull(self, i: int = 0, remote: int = 1) -> Status:
        try:
            self.dd.pull_kv_cache(kvdd.CacheIndex(ATTACKER, remote, 0), self.caches[i], 0, -1,
                                  kvdd.KvCacheExtParam(tensor_num_per_layer=1))
        except kvdd.LLMError as exc:
            return exc.status
        return S


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Honest]]:
    monkeypatch.setenv("KVDD_SIM_XPROC", "tcp")
    made: list[Honest] = []

    def _make(nbytes: int, n: int = 1, wait_ms: int = 500) -> Honest:
        made.append(Honest(nbytes, n, wait_ms))
        return made[-1]

    try:
        yield _make
    finally:
        for h in made:
            h.dd.finalize()


class Peer:
    """The raw peer's receive side on its own thread: ``on`` answers each frame; every frame is
    recorded, and :meth:`wait` waits for one."""

    def __init__(self, s: socket.socket, on: Reply | None = None) -> None:
        self.s = s
        self.on = on
        self.frames: list[tuple[int, int, bytes]] = []
        self.cv = threading.Condition()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            while True:
                ftype, req, body = rawpeer.read_frame(self.s)
                if self.on is not None:
                    self.on(self.s, ftype, req, body)
                with self.cv:
                    self.frames.append((ftype, req, body))
                    self.cv.notify_all()
        except (OSError, AssertionError, struct.error):
            return  # the link closed

    def wait(self, ftype: int, req: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cv:
            while not any(f == ftype and r == req for f, r, _ in self.frames):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the reading thread
            self.s.shutdown(socket.SHUT_RDWR)
        self.s.close()
        self.t.join(10)


# -- a frame of the peer read along with a caller's reply ------------------------------------------
# The idle receiver thread waits in recv itself: were it to sleep in poll(), a frame the leaving
# leader had buffered would wait for the next byte to arrive.

def test_a_peer_request_read_along_with_a_reply_is_served(make: Callable[..., Honest]) -> None:
    """The peer's own small read that arrives in the same segment as the answer our caller
    reads itself is answered at once, not whenever the next byte happens to arrive (an honest
    peer's pull would time out and break the link)."""
    h = make(64)
    mine = h.caches[0].cache_id
    ask = struct.pack("<QII", mine, 1, 1) + struct.pack("<Iqq", 0, 0, 64)
    pattern = bytes(range(64))
    ids = iter(range(1000, 2000))
    theirs: list[int] = []

    def on(s: socket.socket, ftype: int, req: int, _body: bytes) -> None:
        if ftype == wire.F_LEASE_READ and req < 1000:  # our caller's small read; then theirs
            theirs.append(next(ids))
            s.sendall(_data(req, pattern) + _done(req, S)
                      + rawpeer.frame(wire.F_LEASE_READ, ask, theirs[-1]))

    peer = Peer(h.link(), on)
    try:
        late = []
        for i in range(20):
            time.sleep(0.02)  # the link idle for a moment (the usual case between calls)
            assert h.pull() == S
            if not peer.wait(wire.F_DONE, theirs[-1], 1.0):
                late.append(i)
                break
        assert not late, f"the peer's read after call {late} not answered within 1 s"
    finally:
        peer.close()


# -- a big READ refused after its DATA: the documented residual -----------------------------------

def test_big_read_refused_after_its_data_stays_in_its_destination(
        make: Callable[..., Honest]) -> None:
    """A hostile owner answers a 256 KiB pull (LEASE + READ) with all its DATA, then DONE with
    LLM_PARAM_INVALID. An honest owner refuses before any DATA, so only a hostile one does this,
    and it could as well have answered success with the same bytes: big READ data goes straight
    into the destination (staging 256 MiB rows would cost a second copy), so the destination run
    holds what arrived, as after a timeout mid-transfer (docs/security.md, "What a linked peer
    can do"). The pull raises the status, and no byte outside the destination run changes."""
    n = 256 << 10
    h = make(n)

    def on(s: socket.socket, ftype: int, req: int, _body: bytes) -> None:
        if ftype == wire.F_LEASE:
            s.sendall(rawpeer.frame(wire.F_LEASE_REPLY, struct.pack("<IQ", S, 5), req))
        elif ftype == wire.F_READ:
            s.sendall(_data(req, b"\xab" * n) + _done(req, Status.LLM_PARAM_INVALID))

    peer = Peer(h.link(), on)
    try:
        before = h.arenas[0].copy()
        assert h.pull() == Status.LLM_PARAM_INVALID
        changed = np.flatnonzero(h.arenas[0] != before)
        assert changed.size > 0  # the residual is real: the hostile bytes arrived
        assert changed.min() >= GUARD and changed.max() < GUARD + n
        assert (h.arenas[0][changed] == 0xAB).all()
    finally:
        peer.close()


# -- a reading peer with many threads keeps its link behind one big answer ------------------------

def test_peer_reading_its_answers_keeps_its_link_with_40_small_reads_in_flight(
        make: Callable[..., Honest]) -> None:
    """40 threads of a peer each with one small read in flight while a 16 MiB READ of theirs is
    being sent: the peer starts reading 300 ms later and reads everything, so every request is
    answered and the link stays (an honest kvdd peer has one request in flight per thread)."""
    n = 16 << 20  # more than loopback socket buffers hold; read well within its 1 s lease
    h = make(n)
    cid = h.caches[0].cache_id
    s = h.link(caches=0)
    s.settimeout(10)
    try:
        status, lease = rawpeer.lease(s, cid, 1)
        assert status == S
        s.sendall(rawpeer.frame(wire.F_READ, wire.encode_request(lease, [0], np.array([0]),
                                                                 np.array([n])), 2))
        time.sleep(0.1)  # its answer is on the way (more than the socket buffers hold)
        ask = struct.pack("<QII", cid, 1, 1) + struct.pack("<Iqq", 0, 0, 64)
        s.sendall(b"".join(rawpeer.frame(wire.F_LEASE_READ, ask, 100 + i) for i in range(40)))
        time.sleep(0.3)  # busy for a moment (well within every wait time), then reads it all
        done: dict[int, int] = {}
        with pytest.raises(TimeoutError):  # everything answered, then silence
            while True:
                ftype, req, body = rawpeer.read_frame(s)
                if ftype == wire.F_DONE:
                    done[req] = struct.unpack("<I", body)[0]
                    if len(done) == 41:
                        s.settimeout(0.3)
        assert sorted(done) == [2, *range(100, 140)] and set(done.values()) == {S}
    finally:
        s.close()


# -- what held ------------------------------------------------------------------------------------

def _trickle(s: socket.socket, req: int) -> None:
    msg = _data(req, b"\x01" * 64) + _done(req, S)

    def run() -> None:
        try:
            for b in msg:
                time.sleep(0.1)
                s.sendall(bytes([b]))
        except OSError:
            return  # the caller gave up and closed the link

    threading.Thread(target=run, daemon=True).start()


def _flood(s: socket.socket, chunk: bytes) -> None:
    def run() -> None:
        try:
            while True:
                s.sendall(chunk)
                time.sleep(0.001)
        except OSError:
            return

    threading.Thread(target=run, daemon=True).start()


HOSTILE_OWNERS: dict[str, Reply] = {
    "silent": lambda s, f, r, b: None,
    "trickle": lambda s, f, r, b: _trickle(s, r),
    "huge_data_then_silence": lambda s, f, r, b: s.sendall(rawpeer.hdr(wire.F_DATA, 64 << 20, r)),
    "empty_data_forever": lambda s, f, r, b: _flood(s, rawpeer.hdr(wire.F_DATA, 0, r) * 1000),
    "done_for_another_request": lambda s, f, r, b: _flood(s, _done(r + 1, S) * 100),
    "stalled_lease_write_of_its_own": lambda s, f, r, b: s.sendall(rawpeer.frame(
        wire.F_LEASE_WRITE, struct.pack("<QII", 1, 1, 1) + struct.pack("<Iqq", 0, 0, 64), 9)),
}


@pytest.mark.parametrize("case", list(HOSTILE_OWNERS))
def test_hostile_owner_cannot_hold_callers_past_their_wait_time(make: Callable[..., Honest],
                                                                case: str) -> None:
    """Four threads pulling over one link from an owner that never answers properly all return
    LLM_TIMEOUT within SyncKvCacheWaitTime (500 ms) + slack, their memory unchanged."""
    h = make(64, n=4)
    reply = HOSTILE_OWNERS[case]

    def on(s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE_READ:
            reply(s, ftype, req, body)

    peer = Peer(h.link(), on)
    try:
        before = [a.copy() for a in h.arenas]
        out: list[tuple[Status, float]] = []
        t0 = time.monotonic()

        def one(i: int) -> None:
            out.append((h.pull(i), time.monotonic() - t0))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(out) == 4
        assert all(st == Status.LLM_TIMEOUT and took < 2.0 for st, took in out), out
        assert all((a == b).all() for a, b in zip(h.arenas, before))
    finally:
        peer.close()


def test_replies_reach_their_own_callers(make: Callable[..., Honest]) -> None:
    """Eight threads pull eight caches over one link (the engine runs one transfer per link at a
    time: the caller's thread and the receiver thread share the socket); the owner answers in
    shuffled order, each answer split in DATA pieces interleaved with the others' and the
    segments cut anywhere, with its own small reads in between: every caller gets exactly its
    cache's bytes, every read of the owner is answered."""
    n_callers, nbytes = 8, 4096
    h = make(nbytes, n=n_callers, wait_ms=3000)
    mine = h.caches[0].cache_id
    ask = struct.pack("<QII", mine, 1, 1) + struct.pack("<Iqq", 0, 0, 16)
    lock = threading.Lock()
    todo: list[tuple[int, int]] = []

    def on(_s: socket.socket, ftype: int, req: int, body: bytes) -> None:
        if ftype == wire.F_LEASE_READ:
            with lock:
                todo.append((req, struct.unpack_from("<Q", body)[0]))

    s = h.link(caches=n_callers)
    peer = Peer(s, on)
    stop = threading.Event()
    theirs = iter(range(50_000, 60_000))
    asked: list[int] = []

    def answer() -> None:
        rnd = random.Random(7)
        while not stop.wait(0.002):
            with lock:
                batch, todo[:] = todo[:], []
            if not batch:
                continue
            rnd.shuffle(batch)
            pieces = []
            for req, cid in batch:
                data = bytes([cid]) * nbytes
                pieces.append([_data(req, data[i:i + 1000]) for i in range(0, nbytes, 1000)]
                              + [_done(req, S)])
            out = b""
            while pieces:
                p = rnd.choice(pieces)
                out += p.pop(0)
                if not p:
                    pieces.remove(p)
            asked.append(next(theirs))
            out += rawpeer.frame(wire.F_LEASE_READ, ask, asked[-1])
            for i in range(0, len(out), 777):
                s.sendall(out[i:i + 777])

    answerer = threading.Thread(target=answer, daemon=True)
    answerer.start()
    wrong: list[tuple[int, int]] = []
    statuses: list[Status] = []

    def pulls(i: int) -> None:
        view = h.arenas[i][GUARD:GUARD + nbytes]
        for rnd in range(20):
            view[:] = 0
            statuses.append(h.pull(i, remote=i + 1))
            if not (view == i + 1).all():
                wrong.append((i, rnd))

    threads = [threading.Thread(target=pulls, args=(i,)) for i in range(n_callers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        answerer.join(10)
        assert set(statuses) == {S} and len(statuses) == 20 * n_callers
        assert not wrong
        assert all(peer.wait(wire.F_DONE, r, 2.0) for r in asked)
    finally:
        stop.set()
        peer.close()




# -- a READ answered DONE-first is not written after its request returned --------------------------
# Cursor.recv counts a DATA frame as received once its bytes are, and a request returning with its
# reply stops its sink (streams.py, channel.py).

class _Owner:
    """The least a Channel needs of its instance (it serves nothing here)."""

    cluster_id = 1
    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 2000
    initialized = True


def test_no_byte_lands_in_a_read_after_its_request_returned() -> None:
    """Two requests on one Channel (its contract: a caller whose reply another leader reads is
    woken by it): a hostile owner answers the second READ with DONE (success) first, then DATA
    it trickles, while the first caller leads.  Once ``request`` returned (whatever it returned;
    ``peers.move`` reports success only when the cursor has every byte), no byte of the
    destination may change any more."""
    n = 256 << 10
    mine, theirs = socket.socketpair()
    theirs.settimeout(5)
    chan = Channel(mine, _Owner(), "done-first")  # type: ignore[arg-type]
    chan.start()
    arena = np.zeros(n, dtype=np.uint8)
    cursor = Cursor(Layout([Region(int(arena.ctypes.data), n, arena)], np.array([0]),
                           np.array([n])))
    try:
        deadline = time.monotonic() + 2.0
        first = threading.Thread(target=chan.request, args=(wire.F_PING, b"", deadline))
        first.start()  # never answered: this caller reads the socket
        assert rawpeer.read_frame(theirs)[0] == wire.F_PING
        out: list[bytes | None] = []
        second = threading.Thread(target=lambda: out.append(
            chan.request(wire.F_READ, b"", deadline, sink=cursor)))
        second.start()
        ftype, req, _ = rawpeer.read_frame(theirs)
        assert ftype == wire.F_READ
        theirs.sendall(_done(req, S) + rawpeer.hdr(wire.F_DATA, n, req) + b"\x01" * 1000)
        second.join(5)
        assert out, "the READ did not return"
        before = arena.copy()  # the request returned: the memory is the caller's again
        with contextlib.suppress(OSError):  # the link may be closed by now
            theirs.sendall(b"\x02" * 4096)
        time.sleep(0.3)
        changed = np.flatnonzero(arena != before)
        assert changed.size == 0, f"{changed.size} byte(s) written after the READ returned"
    finally:
        chan.kill()
        theirs.close()
