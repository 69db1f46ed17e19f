"""Review 3 of the compiled small TCP path (kvdd/_native/_small.pyx: FrameReader, Stage, small_reply).

The reader is driven directly over a socket pair with bytes a hostile owner would send (split at
every byte, interleaved with other requests' frames, too long, too short, DONE before DATA, a
peer that stops mid-frame, signals while blocked), then over a real link (a caller pulling from
a raw owner that floods it).  Tests marked ``xfail(strict=True)`` are findings: they fail on the
code they were written against and pass once it is fixed (then drop the mark).
"""

from __future__ import annotations

import contextlib
import gc
import random
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
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.rx import RX_BUFFER, Rx, Stage

from hostile import rawpeer
from hostile.test_small_path import Caller, caller  # noqa: F401  (the fixture)

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


def test_owner_flooding_empty_data_at_full_speed_is_cut_at_the_deadline(
        caller: Caller) -> None:  # noqa: F811
    """A raw owner answers the caller's LEASE_READ with zero-length DATA frames for it as fast
    as it can (no pause): the compiled loop consumes them with the GIL held between recvs, yet
    the caller returns LLM_TIMEOUT within its wait time (500 ms) + slack, memory unchanged."""
    port = caller.dd.listen_port
    assert port
    s, _snap = rawpeer.link(port, 9100, caches=1)
    s.settimeout(None)
    stop = threading.Event()

    def owner() -> None:
        with contextlib.suppress(OSError, AssertionError, struct.error):
            ftype, req, _body = rawpeer.read_frame(s)
            while ftype != wire.F_LEASE_READ:
                ftype, req, _body = rawpeer.read_frame(s)
            chunk = rawpeer.hdr(wire.F_DATA, 0, req) * 4096
            while not stop.is_set():
                s.sendall(chunk)

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    try:
        before = caller.arena.copy()
        t0 = time.monotonic()
        assert caller.pull() == Status.LLM_TIMEOUT
        assert time.monotonic() - t0 < 2.0
        assert (caller.arena == before).all()
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
        t.join(10)


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


PI = int(Status.LLM_PARAM_INVALID)
TIMEOUT = int(Status.LLM_TIMEOUT)
ANSWER = bytes((5 * i + 1) & 0xFF for i in range(64))


def _random_answer(rng: random.Random, req: int) -> tuple[list[bytes], int]:
    """A hostile owner's answer to LEASE_READ ``req`` (64 bytes asked): frames drawn from valid
    pieces and every kind of mistake, and the status the caller must get (TIMEOUT: the link
    is broken).  The rule: the first DONE(req) of 4 bytes decides, provided nothing before it
    broke the protocol (DATA of another request, more DATA than asked, a refused header, a
    malformed DONE of this request); success also needs every byte.  Nothing follows the frame
    that decides (frames after a DONE are F5's, test_the_first_done_decides)."""
    frames: list[bytes] = []
    want: int | None = None
    got = 0
    pieces = sorted(rng.sample(range(1, 64), rng.randint(0, 4)))
    chunks = [ANSWER[a:b] for a, b in zip([0, *pieces], [*pieces, 64])]
    for _ in range(rng.randint(1, 8)):
        if want is not None:  # decided: what a hostile owner sends after that is F5's (below)
            break
        kind = rng.choice(["data", "data", "data", "empty", "done", "done", "refuse", "other_data",
                           "other_done", "pong", "bad_header", "long_done", "extra"])
        if kind == "data" and chunks:
            chunk = chunks.pop(0)
            frames.append(_data(req, chunk))
            got += len(chunk)
        elif kind == "empty":
            frames.append(_data(req, b""))
        elif kind == "extra":
            n = rng.choice([1, 64, 65])
            frames.append(_data(req, b"\xee" * n))
            if want is None and got + n > 64:
                want = TIMEOUT
            got += n
        elif kind in ("done", "refuse"):
            status = S if kind == "done" else PI
            frames.append(_done(req, status))
            if want is None:
                want = PI if status == PI else (S if got == 64 else TIMEOUT)
        elif kind == "other_data":
            frames.append(_data(req + rng.choice([1, 2, 1 << 31]), b"\xdd" * rng.randint(0, 8)))
            want = TIMEOUT if want is None else want
        elif kind == "other_done":
            frames.append(_done(req ^ 0x100))  # no such request: ignored
        elif kind == "pong":
            frames.append(rawpeer.frame(wire.F_PONG, b"", req + 3))  # ignored
        elif kind == "bad_header":
            frames.append(rawpeer.hdr(wire.F_DATA, 8, req, magic=b"XY") + b"\0" * 8)
            want = TIMEOUT if want is None else want
        elif kind == "long_done":
            frames.append(rawpeer.frame(wire.F_DONE, b"\0" * 8, req))
            want = TIMEOUT if want is None else want
    if want is None:  # never decided: end with a DONE (a silent owner costs the whole wait)
        frames.append(_done(req))
        want = S if got == 64 else TIMEOUT
    return frames, want


def _show(f: bytes, req: int) -> str:
    """A frame, briefly (for failure messages)."""
    _m, _v, ftype, freq, n = rawpeer.HDR.unpack(f[:12])
    return f"{_m!r}:{ftype}:{'req' if freq == req else hex(freq)}:{n}" + (
        f"={struct.unpack('<I', f[12:16])[0]:#x}" if ftype == wire.F_DONE and n == 4 else "")


def _landing(frames: list[bytes], req: int) -> bytes:
    """The bytes of this request's DATA before its first DONE (what lands on success)."""
    body = b""
    for f in frames:
        _m, _v, ftype, freq, _n = rawpeer.HDR.unpack(f[:12])
        if freq == req and ftype == wire.F_DONE:
            break
        if freq == req and ftype == wire.F_DATA and _m == b"KV":
            body += f[12:]
    return body


@pytest.mark.parametrize("seed", range(4))
def test_random_hostile_answers_split_anywhere(caller: Caller, seed: int) -> None:  # noqa: F811
    """Random answers of a hostile owner (valid pieces, empty, extra and misrouted DATA, DONE
    before or after the data, refusals, malformed frames), every byte stream cut at random
    points (single bytes included), the caller leading or not: each pull gets exactly the
    status the protocol gives, returns at once (no wait time spent: every answer decides), and
    the caller's memory changes only on success, to exactly the answer."""
    rng = random.Random(seed)
    port = caller.dd.listen_port
    assert port
    for _case in range(10):
        s, _snap = rawpeer.link(port, 9100, caches=1)
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        outcome: list[int] = []
        shown: list[str] = []
        landed: list[bytes] = []

        def owner() -> None:
            with contextlib.suppress(OSError, AssertionError, struct.error):
                while True:
                    ftype, req, _body = rawpeer.read_frame(s)
                    if ftype != wire.F_LEASE_READ:
                        continue
                    frames, want = _random_answer(rng, req)
                    outcome.append(want)
                    landed.append(_landing(frames, req))
                    shown.extend(_show(f, req) for f in frames)
                    data = b"".join(frames)
                    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1,
                                                                      rng.randint(0, 12))))
                    for a, b in zip([0, *cuts], [*cuts, len(data)]):
                        s.sendall(data[a:b])
                        if rng.random() < 0.3:
                            time.sleep(0.001)

        t = threading.Thread(target=owner, daemon=True)
        t.start()
        try:
            caller.arena[:] = 0x5A
            t0 = time.monotonic()
            got = int(caller.pull())
            took = time.monotonic() - t0
            assert len(outcome) == 1
            assert got == outcome[0], (seed, _case, hex(got), hex(outcome[0]), shown)
            assert took < 0.4, took
            expected = np.full_like(caller.arena, 0x5A)
            if got == S:
                expected[4096:4096 + 64] = np.frombuffer(landed[0], dtype=np.uint8)
            changed = np.flatnonzero(caller.arena != expected)
            assert changed.size == 0, changed[:8]
        finally:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            t.join(10)


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


# -- findings -----------------------------------------------------------------------------------

@pytest.mark.xfail(strict=True, reason="review3 F2: FrameReader.discard takes a negative count and "
                   "moves its read position before the buffer (later reads are out of bounds)")
def test_discard_refuses_a_negative_count(pair: tuple[Rx, socket.socket]) -> None:
    rx, _peer = pair
    with pytest.raises(ValueError):
        rx.discard(-100)
    assert rx.buffered == 0


@pytest.mark.xfail(strict=True, reason="review3 F3: Stage.left is writable from Python; a larger "
                   "value makes recv/small_reply write before the stage's allocation")
def test_stage_left_cannot_be_set_beyond_the_stage() -> None:
    stage = Stage(8, 1 << 16)
    with pytest.raises((AttributeError, ValueError)):
        stage.left = 1 << 20
    assert stage.left == 8


@pytest.mark.xfail(strict=True, reason="review3 F1: two threads reading one FrameReader at once both "
                   "recv into the same free space and both add what they got: the buffered count "
                   "passes the buffer size (the next _fill asks recv for a negative, i.e. huge, "
                   "length past the buffer). The reader should refuse a second concurrent reader.")
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


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
@pytest.mark.xfail(strict=True, reason="review3 F4: an Exception raised by a signal handler while a "
                   "pull waits in the compiled recv is caught by Channel._lead (only BaseExceptions "
                   "that are not Exceptions are re-raised), logged as a kvdd bug ('receiving "
                   "failed'), the link is killed and the pull returns LLM_TIMEOUT: the user's "
                   "exception (e.g. a SIGALRM timeout) is swallowed")
def test_a_signal_handlers_exception_comes_out_of_the_pull(caller: Caller) -> None:  # noqa: F811
    port = caller.dd.listen_port
    assert port
    s, _snap = rawpeer.link(port, 9100, caches=1)
    s.settimeout(None)

    reads = [0]

    def owner() -> None:
        with contextlib.suppress(OSError, AssertionError, struct.error):
            while True:
                ftype, req, _body = rawpeer.read_frame(s)
                if ftype == wire.F_LEASE_READ:
                    reads[0] += 1
                    if reads[0] > 1:
                        time.sleep(0.3)  # the caller waits in recv meanwhile
                    s.sendall(_data(req, b"\x01" * 64) + _done(req))

    class Alarm(Exception):
        pass

    def on_alarm(_sig: int, _frame: object) -> None:
        raise Alarm()

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        # a first pull, then at once the second: the caller leads the receive side (the receiver
        # thread only takes it after IDLE_S without callers), so it waits in the compiled recv
        assert caller.pull() == Status.LLM_SUCCESS
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            caller.pull()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
        t.join(10)


class MinimalOwner:
    """The least a Channel needs of its instance (it serves nothing here)."""

    cluster_id = 1
    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 2000
    initialized = True


@pytest.mark.xfail(strict=True, reason="review3 F5: frames for a request that already has its DONE are "
                   "still taken until its caller wakes (Channel._frame overwrites Pending.reply; "
                   "_recv_data writes the stage): an owner's refusal followed by DATA and "
                   "DONE(success) becomes LLM_SUCCESS with every byte staged (to land), depending "
                   "on thread timing. The first DONE should decide; more frames for it break the link")
def test_the_first_done_decides() -> None:
    """Two requests on one Channel (its contract: a caller whose reply another leader reads is
    woken by it): the first caller leads (a PING never answered); the owner refuses the second,
    a small READ, with DONE(LLM_PARAM_INVALID), then sends it 64 bytes and DONE(LLM_SUCCESS)
    anyway.  The leader reads the three frames in one go while the second caller wakes: it must
    get the refusal, and nothing may reach its stage after it."""
    mine, theirs = socket.socketpair()
    theirs.settimeout(5)
    chan = Channel(mine, MinimalOwner(), "review3")  # type: ignore[arg-type]
    chan.start()
    stage = Stage(64, 1 << 16)
    try:
        deadline = time.monotonic() + 2.0
        first = threading.Thread(target=chan.request, args=(wire.F_PING, b"", deadline), daemon=True)
        first.start()  # never answered: this caller reads the socket
        assert rawpeer.read_frame(theirs)[0] == wire.F_PING
        # the receiver thread leads an idle connection (waiting in recv); a frame it ignores makes
        # it hand the lead to the waiting caller
        time.sleep(0.02)
        theirs.sendall(rawpeer.frame(wire.F_PONG, b"", 0xFFFF))
        time.sleep(0.02)
        out: list[int | None] = []
        second = threading.Thread(target=lambda: out.append(
            chan.read_small(1, 0, 0, stage, deadline)), daemon=True)
        second.start()
        ftype, req, _ = rawpeer.read_frame(theirs)
        assert ftype == wire.F_LEASE_READ
        theirs.sendall(_done(req, PI) + _data(req, b"\xbb" * 64) + _done(req))
        second.join(5)
        assert out == [PI], [hex(x) if x is not None else x for x in out]
        assert stage.left == 64
    finally:
        chan.kill()
        theirs.close()
