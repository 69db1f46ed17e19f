"""DATA frames longer than their transfer, and a refused WRITE's announced size, from a hostile peer.

A peer's DATA header says how many bytes follow; every reader of DATA bounds it by what its
transfer still lacks and refuses a frame that says more (ProtocolError: the connection is
closed and the transfer gets no answer), rather than reading past its buffer or taking the
rest of the frame as the next header:

* the owner of a WRITE (:class:`~kvdd.sim.fabric.serving.RunPlan`), of a WRITE refused for its
  lease (its DATA read into nothing, :func:`~kvdd.sim.fabric.serving.serve_write_steps`) and of a
  LEASE_WRITE (:func:`~kvdd.sim.fabric.small.serve_small_write_steps`);
* the caller of a small READ of several runs (:class:`~kvdd.sim.fabric.small.SmallSink`).

A refused WRITE announcing more than ``MAX_DISCARD`` bytes is not read at all: the owner closes
the connection at once.  Each bound is checked at the limit (served) and one byte past it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd import Status
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.rx import Rx
from kvdd.sim.fabric.serving import MAX_DISCARD, RunPlan, serve_write, serve_write_steps
from kvdd.sim.fabric.small import SmallSink, encode_small, serve_small_write
from kvdd.sim.memory import Region

from conformance.harness import Spec, register
from hostile import rawpeer
from hostile.rawpeer import MinimalOwner
from hostile.test_attacks import Victim, victim  # noqa: F401  (the fixture)
from test_fabric_small import pair  # noqa: F401  (the fixture: a reader on a socket pair's end)

S = int(Status.LLM_SUCCESS)
PI = int(Status.LLM_PARAM_INVALID)
TIMEOUT = int(Status.LLM_TIMEOUT)
FORGED = 0xDEAD  # a lease id no owner granted: its WRITE is refused with LLM_TIMEOUT
PATTERN = bytes((13 * i + 7) & 0xFF for i in range(256))


def _data(req: int, payload: bytes) -> bytes:
    return rawpeer.frame(wire.F_DATA, payload, req)


def _pieces(req: int, sizes: list[int]) -> bytes:
    """DATA frames of ``req`` carrying PATTERN from its start, cut into pieces of ``sizes``."""
    out, pos = b"", 0
    for n in sizes:
        out += _data(req, PATTERN[pos:pos + n])
        pos += n
    return out


def _two_runs_written() -> np.ndarray:
    """A 64-byte arena of 0x5A once runs (4, 16) and (40, 8) got PATTERN's first 24 bytes."""
    want = np.full(64, 0x5A, dtype=np.uint8)
    want[4:20] = np.frombuffer(PATTERN[:16], np.uint8)
    want[40:48] = np.frombuffer(PATTERN[16:24], np.uint8)
    return want


def _done(req: int, status: int) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)


def _arena(n: int) -> tuple[np.ndarray, Region]:
    a = np.full(n, 0x5A, dtype=np.uint8)
    return a, Region(int(a.ctypes.data), n, a)


@pytest.fixture
def chan() -> Iterator[tuple[Channel, socket.socket]]:
    """A started Channel of an instance that serves no cache, over loopback TCP; the other end
    (the hostile peer) is returned with a 5 s timeout."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        mine, _ = server.accept()
    c = Channel(mine, MinimalOwner(), "data-lengths")  # type: ignore[arg-type]
    c.start()
    theirs.settimeout(5.0)
    try:
        yield c, theirs
    finally:
        c.kill()
        theirs.close()


def _answer_then_closed(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the other end sends until it closes the connection (within ``timeout``)."""
    s.settimeout(timeout)
    got = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            chunk = s.recv(1 << 16)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got
    except TimeoutError:
        pass
    raise AssertionError(f"the connection is still open after {timeout} s ({got!r} received)")


def _send(s: socket.socket, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed on the way
        s.sendall(data)


# -- a WRITE under a lease: RunPlan.receive --------------------------------------------------------

@pytest.mark.parametrize("frames, fits", [
    ([24], True),  # exactly the WRITE's bytes
    ([10, 14], True),
    ([25], False),  # one byte more in one frame
    ([10, 15], False),  # the last frame one byte longer than what is left
    ([24, 1], None),  # a frame after the last byte: the next frame, not this WRITE's
])
def test_write_data_longer_than_the_write_is_refused(pair: tuple[socket.socket, Rx],
                                                     frames: list[int], fits: bool | None) -> None:
    """A WRITE of two runs (16 + 8 bytes) into a tensor: DATA frames holding exactly its bytes
    land them; a frame holding more than what the WRITE still lacks is a ProtocolError, and the
    rest of that frame is never taken for a header."""
    a, rx = pair
    arena, region = _arena(64)
    plan = RunPlan([region], np.array([0]), np.array([4, 40]), np.array([16, 8]))
    a.sendall(_pieces(9, frames))
    if fits is False:
        with pytest.raises(wire.ProtocolError, match="more DATA than the WRITE holds"):
            plan.receive(rx, 9)
        return
    plan.receive(rx, 9)
    want = _two_runs_written()
    assert (arena == want).all()
    if fits is None:  # the frame after is left whole for the connection's next read
        assert rx.header() == (wire.F_DATA, 9, 1)


def test_over_long_data_of_a_write_under_a_lease_closes_the_link(victim: Victim) -> None:  # noqa: F811
    """A WRITE of 64 bytes under a granted lease followed by 65 bytes of DATA: the owner sends
    no DONE and closes the connection; the same WRITE with exactly 64 bytes gets
    DONE(LLM_SUCCESS)."""
    p = victim.p
    target = register(p, Spec())  # written by this test: not part of the untouched check
    for extra, want in ((0, _done(7, S)), (1, b"")):
        s, _snap = rawpeer.link(victim.port, 5454)
        with s:
            status, lease_id = rawpeer.lease(s, target.cache_id)
            assert status == S
            req = wire.encode_request(lease_id, [0], np.array([0]), np.array([64]))
            _send(s, rawpeer.frame(wire.F_WRITE, req, 7) + _data(7, PATTERN[:64 + extra]))
            if want:
                assert rawpeer.read_frame(s) == (wire.F_DONE, 7, struct.pack("<I", S))
            else:
                assert _answer_then_closed(s) == b""
    p.unregister(target.cache_id)


# -- a WRITE refused for its lease: its DATA read into nothing -------------------------------------

class _Refusing:
    """The lease checks of an owner that granted no lease: every WRITE refused (LLM_TIMEOUT)."""

    def __init__(self) -> None:
        self.calls = 0

    def check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                   length: np.ndarray) -> tuple[int, None]:
        self.calls += 1
        return TIMEOUT, None


@pytest.mark.parametrize("frames, fits", [
    ([64], True), ([32, 32], True), ([1] * 64, True),
    ([65], False), ([32, 33], False), ([63, 2], False),
])
def test_refused_write_data_longer_than_announced_is_refused(pair: tuple[socket.socket, Rx],
                                                             frames: list[int],
                                                             fits: bool) -> None:
    """A WRITE refused for its lease announcing 64 bytes: DATA frames of exactly 64 bytes are
    read into nothing and the WRITE gets LLM_TIMEOUT; a frame longer than what is left is a
    ProtocolError."""
    a, rx = pair
    payload = wire.encode_request(FORGED, [0], np.array([0]), np.array([64]))
    a.sendall(b"".join(_data(3, bytes(n)) for n in frames) + rawpeer.frame(wire.F_PING, b"", 4))
    if not fits:
        with pytest.raises(wire.ProtocolError, match="WRITE data expected"):
            serve_write(_Refusing(), MinimalOwner(), rx, 3, payload)  # type: ignore[arg-type]
        return
    assert serve_write(_Refusing(), MinimalOwner(), rx, 3, payload) == TIMEOUT  # type: ignore[arg-type]
    assert rx.header() == (wire.F_PING, 4, 0)  # every DATA byte read, nothing more


@pytest.mark.parametrize("frames, want", [
    ([64], _done(3, TIMEOUT)), ([40, 24], _done(3, TIMEOUT)),
    ([65], b""), ([40, 25], b""),
])
def test_refused_write_with_over_long_data_closes_the_link(chan: tuple[Channel, socket.socket],
                                                           frames: list[int], want: bytes) -> None:
    """On a connection: the refused WRITE whose DATA fits gets DONE(LLM_TIMEOUT) and the link
    stays (a PING is answered); one whose DATA is longer than it announced gets no answer and
    the connection is closed."""
    c, theirs = chan
    payload = wire.encode_request(FORGED, [0], np.array([0]), np.array([64]))
    _send(theirs, rawpeer.frame(wire.F_WRITE, payload, 3)
          + b"".join(_data(3, PATTERN[:n]) for n in frames))
    if want:
        assert rawpeer.read_frame(theirs) == (wire.F_DONE, 3, struct.pack("<I", TIMEOUT))
        theirs.sendall(rawpeer.frame(wire.F_PING, b"", 4))
        assert rawpeer.read_frame(theirs) == (wire.F_PONG, 4, b"")
    else:
        assert _answer_then_closed(theirs) == b""
        assert c.dead.wait(5.0)


@pytest.mark.parametrize("tensors, length, refused", [
    ([0], [MAX_DISCARD], False),
    ([0], [MAX_DISCARD + 1], True),
    ([0], [MAX_DISCARD // 2, MAX_DISCARD // 2], False),
    ([0], [MAX_DISCARD // 2, MAX_DISCARD // 2 + 1], True),
    ([0, 1], [MAX_DISCARD // 4, MAX_DISCARD // 4], False),  # K x the runs' bytes
    ([0, 1], [MAX_DISCARD // 4, MAX_DISCARD // 4 + 1], True),
])
def test_a_refused_write_announcing_more_than_max_discard_is_not_read(
        tensors: list[int], length: list[int], refused: bool) -> None:
    """A WRITE refused for its lease announcing at most MAX_DISCARD bytes (tensors x runs) has
    its DATA awaited (to be read into nothing); one announcing more is a ProtocolError before a
    single byte is read."""
    payload = wire.encode_request(FORGED, tensors, np.zeros(len(length), np.int64),
                                  np.array(length, np.int64))
    a, b = socket.socketpair()
    with a, b:
        rx = Rx(b)
        steps = serve_write_steps(_Refusing(), MinimalOwner(), rx, 5, payload)  # type: ignore[arg-type]
        if refused:
            with pytest.raises(wire.ProtocolError, match="refused WRITE of too many bytes"):
                next(steps)
        else:
            assert next(steps) == wire.HDR.size  # waiting for the first DATA header
            steps.close()
        assert rx.buffered == 0


def test_a_refused_write_announcing_more_than_max_discard_closes_the_link_at_once(
        chan: tuple[Channel, socket.socket]) -> None:
    """On a connection: the WRITE announcing MAX_DISCARD + 1 bytes under a forged lease, with no
    DATA sent: the owner answers nothing and closes the connection without waiting for any."""
    c, theirs = chan
    payload = wire.encode_request(FORGED, [0], np.array([0]), np.array([MAX_DISCARD + 1]))
    theirs.sendall(rawpeer.frame(wire.F_WRITE, payload, 6))
    assert _answer_then_closed(theirs, 2.0) == b""
    assert c.dead.wait(5.0)


# -- a LEASE_WRITE: its DATA staged ----------------------------------------------------------------

class _Entry:
    """A served cache of one 64-byte tensor; counts its grants."""

    def __init__(self) -> None:
        self.arena, region = _arena(64)
        self.regions = [region]
        self.n = 1
        self.T = 64
        self.grants = 0
        self.held = 0

    def grant(self, cache_id: int) -> tuple[int, _Entry]:
        self.grants += 1
        self.held += 1
        return S, self

    def release(self) -> None:
        self.held -= 1


@pytest.mark.parametrize("frames, fits", [
    ([24], True), ([10, 14], True), ([23, 1], True),
    ([25], False), ([10, 15], False), ([24, 1], None),
])
def test_lease_write_data_longer_than_the_request_is_refused(pair: tuple[socket.socket, Rx],
                                                             frames: list[int],
                                                             fits: bool | None) -> None:
    """A LEASE_WRITE of two runs (16 + 8 bytes): DATA frames of exactly its bytes land them and
    the answer is DONE(LLM_SUCCESS); a frame longer than what is left is a ProtocolError before
    the cache is granted (not one byte lands); a frame after the last byte is left unread."""
    a, rx = pair
    e = _Entry()
    payload = encode_small(1, [0], [4, 40], [16, 8])
    a.sendall(_pieces(8, frames))
    if fits is False:
        with pytest.raises(wire.ProtocolError, match="WRITE data expected"):
            serve_small_write(MinimalOwner(), e.grant, rx, 8, payload)  # type: ignore[arg-type]
        assert e.grants == 0 and (e.arena == 0x5A).all()
        return
    got = serve_small_write(MinimalOwner(), e.grant, rx, 8, payload)  # type: ignore[arg-type]
    assert got == _done(8, S)
    want = _two_runs_written()
    assert (e.arena == want).all() and e.grants == 1 and e.held == 0
    if fits is None:
        assert rx.header() == (wire.F_DATA, 8, 1)


def test_lease_write_with_over_long_data_closes_the_link(chan: tuple[Channel, socket.socket]) -> None:
    """On a connection: a LEASE_WRITE of 24 bytes followed by DATA of 10 then 15 bytes gets no
    answer and the connection is closed (with 10 then 14 bytes it is answered: the cache does
    not exist here)."""
    c, theirs = chan
    payload = encode_small(1, [0], [4, 40], [16, 8])
    theirs.sendall(rawpeer.frame(wire.F_LEASE_WRITE, payload, 2) + _data(2, PATTERN[:10])
                   + _data(2, PATTERN[10:24]))
    assert rawpeer.read_frame(theirs) == (wire.F_DONE, 2, struct.pack(
        "<I", Status.LLM_KV_CACHE_NOT_EXIST))
    _send(theirs, rawpeer.frame(wire.F_LEASE_WRITE, payload, 3) + _data(3, PATTERN[:10])
          + _data(3, PATTERN[10:25]))
    assert _answer_then_closed(theirs) == b""
    assert c.dead.wait(5.0)


# -- the caller of a small READ of several runs: SmallSink ----------------------------------------

def test_small_sink_takes_no_more_than_the_transfer_lacks(pair: tuple[socket.socket, Rx]) -> None:
    """A sink of two runs (16 + 8 bytes) refuses a piece longer than what it lacks before reading
    a byte of it (ProtocolError); it takes exactly what it lacks, then not one byte more."""
    a, rx = pair
    _arena_unused, region = _arena(64)
    sink = SmallSink([region], [4, 40], [16, 8])
    a.sendall(PATTERN[:30])
    with pytest.raises(wire.ProtocolError, match="more DATA than the transfer holds"):
        sink.recv(rx, 25)
    assert sink.parts == [] and sink.left == 24
    sink.recv(rx, 10)
    with pytest.raises(wire.ProtocolError, match="more DATA than the transfer holds"):
        sink.recv(rx, 15)
    sink.recv(rx, 14)
    assert sink.left == 0 and b"".join(sink.parts) == PATTERN[:24]
    with pytest.raises(wire.ProtocolError, match="more DATA than the transfer holds"):
        sink.recv(rx, 1)
    assert sink.left == 0 and b"".join(sink.parts) == PATTERN[:24]
    assert rx.exact(6) == PATTERN[24:30]  # the refused pieces were left unread


@pytest.mark.parametrize("status", [S, PI], ids=["success", "refusal"])
def test_owner_sending_more_data_than_a_small_read_asked_breaks_the_link(
        chan: tuple[Channel, socket.socket], status: int) -> None:
    """A hostile owner answers a small READ of two runs (24 bytes) with those 24 bytes, one DATA
    byte more, then DONE (success or a refusal): the caller gets no reply (the link is broken,
    the transfer's status is LLM_TIMEOUT), and its sink holds exactly the 24 bytes it asked for."""
    c, theirs = chan
    _arena_unused, region = _arena(64)
    sink = SmallSink([region], [4, 40], [16, 8])

    def owner() -> None:
        with contextlib.suppress(OSError, AssertionError, struct.error):
            ftype, req, _body = rawpeer.read_frame(theirs)
            assert ftype == wire.F_LEASE_READ
            theirs.sendall(_data(req, PATTERN[:24]) + _data(req, b"\xee") + _done(req, status))

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    try:
        payload = encode_small(1, [0], [4, 40], [16, 8])
        assert c.request(wire.F_LEASE_READ, payload, time.monotonic() + 5.0, sink=sink) is None
        assert c.dead.wait(5.0)
        assert sink.left == 0 and b"".join(sink.parts) == PATTERN[:24]
    finally:
        t.join(10)

