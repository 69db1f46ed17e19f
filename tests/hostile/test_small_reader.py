"""The compiled small TCP path's reader (kvdd/_native/_small.pyx: FrameReader, Stage, small_reply).

The reader is driven directly over a socket pair with bytes a hostile owner would send (split at
every byte, interleaved with other requests' frames, too long, too short, DONE before DATA, a
peer that stops mid-frame, signals while blocked); the owner's compiled answer is compared with
the generic framing.  Real links and Channels: test_small_path_hostile_owner.py; the owner's
compiled serve: test_small_serve.py.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import socket
import struct
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd import Status
from kvdd._native._small import read_answer
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.rx import RX_BUFFER, Rx, Stage

from hostile import rawpeer

S = int(Status.LLM_SUCCESS)
REQ = 77


def _data(req: int, payload: bytes) -> bytes:
    return rawpeer.frame(wire.F_DATA, payload, req)


def _done(req: int, status: int = S) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)


@pytest.fixture
def pair() -> Iterator[tuple[Rx, socket.socket]]:
    """A reader on one end of a connected socket pair; the test writes to the other end."""
    a, b = socket.socketpair()
    try:
        yield Rx(a), b
    finally:
        a.close()
        b.close()


def _feed(s: socket.socket, data: bytes, step: int, delay: float = 0.0) -> threading.Thread:
    """Send ``data`` ``step`` bytes at a time from a thread (``delay`` seconds apart)."""
    def run() -> None:
        with contextlib.suppress(OSError):
            for i in range(0, len(data), step):
                s.sendall(data[i:i + step])
                if delay:
                    time.sleep(delay)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _staged(stage: Stage) -> bytes:
    """The bytes a stage would land (into a scratch buffer)."""
    out = np.zeros(max(stage.size, 1), dtype=np.uint8)
    stage.land(int(out.ctypes.data))
    return out[:stage.size].tobytes()


# -- what held ----------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 5, 12, 13, 4096])
def test_answer_split_anywhere_lands_whole(pair: tuple[Rx, socket.socket], step: int) -> None:
    """DATA in three pieces then DONE, the byte stream cut every ``step`` bytes: every byte lands
    in order and the status is DONE's."""
    rx, peer = pair
    body = bytes((i * 31 + 7) & 0xFF for i in range(200))
    msg = _data(REQ, body[:1]) + _data(REQ, b"") + _data(REQ, body[1:150]) + _data(REQ, body[150:])
    t = _feed(peer, msg + _done(REQ), step)
    stage = Stage(len(body), 1 << 16)
    assert rx.small_reply(REQ, stage) == S
    t.join(5)
    assert stage.left == 0 and _staged(stage) == body
    assert rx.buffered == 0


def test_done_before_data_returns_with_the_stage_incomplete(pair: tuple[Rx, socket.socket]) -> None:
    """DONE(success) before any DATA: small_reply returns the status, ``left`` shows the gap and
    the stage refuses to land (the caller kills the link); the late DATA stays unread."""
    rx, peer = pair
    peer.sendall(_done(REQ) + _data(REQ, b"\x01" * 8))
    stage = Stage(8, 1 << 16)
    assert rx.small_reply(REQ, stage) == S
    assert stage.left == 8
    with pytest.raises(ValueError):
        stage.land(0)  # nothing is copied (address 0 would crash if it were)
    assert rx.buffered == 12 + 8


@pytest.mark.parametrize("case", ["other_request", "too_long", "duplicate", "bad_magic",
                                  "done_of_5_bytes", "unknown_type"])
def test_anything_else_is_left_unread_for_the_generic_path(pair: tuple[Rx, socket.socket],
                                                           case: str) -> None:
    """small_reply stops (-1) at the first frame that is not exactly this request's DATA (within
    the stage) or 4-byte DONE, leaving that frame whole in the buffer: the generic path reads
    and refuses it.  Bytes accepted before it stay staged."""
    rx, peer = pair
    first = _data(REQ, b"\x11" * 4)
    bad = {
        "other_request": _data(REQ + 1, b"\x22" * 4),
        "too_long": _data(REQ, b"\x33" * 5),  # 4 staged of 8: 5 more is too many
        "duplicate": _data(REQ, b"\x44" * 4) + _data(REQ, b"\x44"),
        "bad_magic": b"XX" + _data(REQ, b"\x55" * 4)[2:],
        "done_of_5_bytes": rawpeer.frame(wire.F_DONE, b"\0" * 5, REQ),
        "unknown_type": rawpeer.frame(200, b"", REQ),
    }[case]
    peer.sendall(first + bad)
    stage = Stage(8, 1 << 16)
    assert rx.small_reply(REQ, stage) == -1
    if case == "duplicate":  # the second 4 bytes fill the stage; the 1 more is refused
        assert stage.left == 0 and rx.buffered == 12 + 1
    else:
        assert stage.left == 4
        assert rx.buffered == len(bad)
    assert rx.small_reply(REQ, stage) == -1  # still refused, still unread


@pytest.mark.parametrize("n", [RX_BUFFER - 12, RX_BUFFER - 11, RX_BUFFER])
def test_data_at_the_buffer_size_goes_staged_or_generic(pair: tuple[Rx, socket.socket],
                                                        n: int) -> None:
    """A DATA payload that fits the buffer with its header is staged by small_reply; one byte
    more is left for the generic path (Stage.recv), which stages it straight from the socket."""
    rx, peer = pair
    body = bytes((i * 13) & 0xFF for i in range(n))
    t = _feed(peer, _data(REQ, body) + _done(REQ), 1 << 16)
    stage = Stage(n, 1 << 16)
    got = rx.small_reply(REQ, stage)
    if n <= RX_BUFFER - 12:
        assert got == S
    else:
        assert got == -1 and stage.left == n
        ftype, req, length = rx.header()
        assert (ftype, req, length) == (wire.F_DATA, REQ, n)
        stage.recv(rx, length)
        assert rx.small_reply(REQ, stage) == S
    t.join(5)
    assert stage.left == 0 and _staged(stage) == body


def test_stage_recv_refuses_more_than_it_lacks(pair: tuple[Rx, socket.socket]) -> None:
    rx, _peer = pair
    stage = Stage(8, 1 << 16)
    for n in (9, -1, 1 << 40):
        with pytest.raises(wire.ProtocolError):
            stage.recv(rx, n)
    assert stage.left == 8
    with pytest.raises(ValueError):
        Stage(65537, 1 << 16)
    with pytest.raises(ValueError):
        Stage(-1, 1 << 16)


def test_peer_stopping_mid_frame_in_timeout_mode_times_out(pair: tuple[Rx, socket.socket]) -> None:
    """A socket in timeout mode (non-blocking underneath: recv says EAGAIN) waits through the
    socket's own timeout: a peer that stops half-way through a DATA payload gets TimeoutError
    after the timeout, not a hang and not a busy loop."""
    rx, peer = pair
    rx.sock.settimeout(0.2)
    peer.sendall(_data(REQ, b"\x01" * 64)[:12 + 30])
    stage = Stage(64, 1 << 16)
    t0 = time.monotonic()
    t1 = time.process_time()
    with pytest.raises(TimeoutError):
        rx.small_reply(REQ, stage)
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert time.process_time() - t1 < 0.15  # waited, did not spin


def test_timeout_mode_split_answer_lands(pair: tuple[Rx, socket.socket]) -> None:
    rx, peer = pair
    rx.sock.settimeout(2.0)
    body = bytes(range(100))
    t = _feed(peer, _data(REQ, body) + _done(REQ, 0x123), 7, 0.001)
    stage = Stage(100, 1 << 16)
    assert rx.small_reply(REQ, stage) == 0x123
    t.join(5)
    assert _staged(stage) == body


def test_peer_closing_mid_frame_is_a_connection_error(pair: tuple[Rx, socket.socket]) -> None:
    rx, peer = pair
    peer.sendall(_data(REQ, b"\x01" * 64)[:20])
    peer.shutdown(socket.SHUT_WR)
    stage = Stage(64, 1 << 16)
    with pytest.raises(ConnectionError):
        rx.small_reply(REQ, stage)
    assert stage.left == 64


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_signals_while_blocked_are_retried(pair: tuple[Rx, socket.socket]) -> None:
    """A signal handler that returns (SIGALRM every 5 ms while the owner answers slowly): recv's
    EINTR is retried after the handler ran, and the answer lands whole."""
    rx, peer = pair
    ticks = [0]

    def on_alarm(_sig: int, _frame: object) -> None:
        ticks[0] += 1

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
    try:
        body = bytes(range(64))
        t = _feed(peer, _data(REQ, body) + _done(REQ), 16, 0.03)
        stage = Stage(64, 1 << 16)
        assert rx.small_reply(REQ, stage) == S
        t.join(5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert ticks[0] >= 3
    assert _staged(stage) == body


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_a_signal_handlers_exception_leaves_the_reader_consistent(
        pair: tuple[Rx, socket.socket]) -> None:
    """A handler that raises while recv is blocked: the exception comes out of small_reply, no
    byte is lost (what arrived before is still buffered, the stage unchanged), and reading again
    goes on from there."""
    rx, peer = pair

    class Alarm(Exception):
        pass

    def on_alarm(_sig: int, _frame: object) -> None:
        raise Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    body = bytes(range(64))
    msg = _data(REQ, body) + _done(REQ)
    peer.sendall(msg[:20])
    stage = Stage(64, 1 << 16)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            rx.small_reply(REQ, stage)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert stage.left == 64 and rx.buffered == 20
    peer.sendall(msg[20:])
    assert rx.small_reply(REQ, stage) == S
    assert _staged(stage) == body


def test_a_long_frame_announced_costs_only_what_arrives(pair: tuple[Rx, socket.socket]) -> None:
    """A header announcing the longest request (MAX_REQUEST) followed by a trickle: the reader's
    memory grows with what arrives (one RECV_CHUNK at a time), not with the announced length."""
    rx, peer = pair
    rx.sock.settimeout(0.2)
    n = wire.MAX_LEN[wire.F_READ]
    assert n > 2 * wire.RECV_CHUNK
    peer.sendall(rawpeer.hdr(wire.F_READ, n, 5) + b"\x01" * 100)
    assert rx.header() == (wire.F_READ, 5, n)
    tracemalloc.start()
    try:
        with pytest.raises(TimeoutError):
            rx.exact(n)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < wire.RECV_CHUNK + RX_BUFFER + (64 << 10), peak


def test_no_reference_leaks_in_the_compiled_reader(pair: tuple[Rx, socket.socket]) -> None:
    """A thousand answers through small_reply, header/exact/into/discard: the stage's and the
    reader's reference counts and the number of live objects come back where they were."""
    rx, peer = pair
    stage_refs: list[int] = []
    body = b"\x07" * 32
    one = _data(REQ, body) + _done(REQ) + rawpeer.frame(wire.F_PONG, b"abc", 3) + _data(REQ, b"xy")
    for rnd in range(2):
        gc.collect()
        objects = len(gc.get_objects())
        rx_refs = sys.getrefcount(rx)
        for _ in range(500):
            stage = Stage(32, 1 << 16)
            peer.sendall(one)
            assert rx.small_reply(REQ, stage) == S
            assert rx.header() == (wire.F_PONG, 3, 3) and rx.exact(3) == b"abc"
            assert rx.header() == (wire.F_DATA, REQ, 2)
            rx.discard(2)
            stage_refs.append(sys.getrefcount(stage))
        del stage
        gc.collect()
        if rnd:  # the first round warms caches up
            assert sys.getrefcount(rx) == rx_refs
            assert len(gc.get_objects()) <= objects + 10
    assert len(set(stage_refs)) == 1


@pytest.mark.parametrize("req", [0, 1, 0x12345678, 2**32 - 1])
@pytest.mark.parametrize("n", [1, 63, 64, 65536])
def test_read_answer_is_exactly_data_then_done(req: int, n: int) -> None:
    """The owner's compiled answer equals the generic framing of DATA(n bytes) + DONE(success),
    byte for byte, and copies exactly [addr, addr + n)."""
    src = np.frombuffer(bytes((i * 7 + req) & 0xFF for i in range(n + 32)), dtype=np.uint8).copy()
    out = read_answer(req, int(src.ctypes.data) + 16, n, wire.MAGIC, wire.PROTOCOL_VERSION)
    assert out == _data(req, src[16:16 + n].tobytes()) + _done(req, S)


@pytest.mark.parametrize("req, n, magic", [(-1, 8, wire.MAGIC), (2**32, 8, wire.MAGIC),
                                           (1, 0, wire.MAGIC), (1, -8, wire.MAGIC),
                                           (1, 2**32, wire.MAGIC), (1, 8, b"K"), (1, 8, b"KVX")])
def test_read_answer_refuses_what_is_not_a_frame(req: int, n: int, magic: bytes) -> None:
    src = np.zeros(16, dtype=np.uint8)
    with pytest.raises((ValueError, OverflowError)):
        read_answer(req, int(src.ctypes.data), n, magic, wire.PROTOCOL_VERSION)


# -- out-of-range arguments and shared readers ---------------------------------------------------

def test_discard_refuses_a_negative_count(pair: tuple[Rx, socket.socket]) -> None:
    rx, _peer = pair
    with pytest.raises(ValueError):
        rx.discard(-100)
    assert rx.buffered == 0


def test_stage_left_cannot_be_set_beyond_the_stage() -> None:
    stage = Stage(8, 1 << 16)
    with pytest.raises((AttributeError, ValueError)):
        stage.left = 1 << 20  # type: ignore[misc]  # read-only: the point of the test
    assert stage.left == 8


def test_two_threads_on_one_reader_cannot_overrun_its_buffer(
        pair: tuple[Rx, socket.socket]) -> None:
    rx, peer = pair
    errors: list[BaseException] = []

    def read() -> None:
        try:
            rx.exact(12)
        except BaseException as exc:  # noqa: BLE001  (what the second reader gets, if refused)
            errors.append(exc)

    threads = [threading.Thread(target=read, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # both wait in recv (GIL released) on the same free space
    peer.sendall(b"\x01" * 40000)
    time.sleep(0.2)
    peer.sendall(b"\x02" * 40000)
    for t in threads:
        t.join(5)
    got = rx.buffered
    # leave the reader in a safe state whatever happened (its destructor only frees the buffer)
    assert got <= RX_BUFFER, f"{got} bytes counted as buffered in a {RX_BUFFER}-byte buffer"
