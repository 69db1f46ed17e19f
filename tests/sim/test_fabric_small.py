"""The compiled small path of the TCP fabric (kvdd/_native/_small.pyx).

* :class:`kvdd.sim.fabric.rx.Rx` (a compiled ``FrameReader``) refuses every header
  :func:`~kvdd.sim.fabric.wire.check_header` refuses, with the same error, and delivers payloads
  exactly however the bytes are split on the wire;
* ``small_reply`` takes only its own request's DATA and DONE and leaves anything else unread;
* ``serve_one_run`` (and ``FrameReader.serve_lease_read``, the same from a connection) answers
  every one-run LEASE_READ byte for byte as the Python
  :func:`~kvdd.sim.fabric.small.serve_small_read` does (statuses, order, the bytes, the entry
  released), and leaves any other payload (or frame, unread) to it.
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from kvdd._native._copy import Region
from kvdd._native._small import serve_one_run
from kvdd.status import PARAM_INVALID, Status
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.rx import Rx, Stage
from kvdd.sim.fabric.small import serve_small_read

NOT_EXIST = Status.LLM_KV_CACHE_NOT_EXIST


def _hdr(ftype: int, req: int, n: int, magic: bytes = wire.MAGIC,
         version: int = wire.PROTOCOL_VERSION) -> bytes:
    return wire.HDR.pack(magic, version, ftype, req, n)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Rx]]:
    """A reader on one end of a socket pair; the test writes to the other end."""
    a, b = socket.socketpair()
    try:
        yield a, Rx(b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("head", [
    _hdr(wire.F_DONE, 1, 4, magic=b"XX"),
    _hdr(wire.F_DONE, 1, 4, version=wire.PROTOCOL_VERSION + 1),
    _hdr(250, 1, 0),
    _hdr(wire.F_DONE, 1, wire.MAX_LEN[wire.F_DONE] + 1),
    _hdr(wire.F_DATA, 1, wire.MAX_LEN[wire.F_DATA] + 1),
])
def test_refused_headers_raise_what_check_header_raises(pair: tuple[socket.socket, Rx],
                                                        head: bytes) -> None:
    a, rx = pair
    with pytest.raises(wire.ProtocolError) as want:
        wire.check_header(head)
    a.sendall(head)
    with pytest.raises(wire.ProtocolError) as got:
        rx.header()
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    # small_reply leaves a refused header unread (the generic path then raises)
    assert rx.small_reply(1, Stage(4, wire.SMALL_BYTES)) == -1
    assert rx.buffered == wire.HDR.size


def test_payloads_arrive_exactly_however_they_are_split(pair: tuple[socket.socket, Rx]) -> None:
    a, rx = pair
    big = bytes(range(256)) * 1024  # 256 KiB: more than the reader's buffer
    stream = (_hdr(wire.F_PONG, 7, 3) + b"abc" + _hdr(wire.F_DATA, 8, len(big)) + big
              + _hdr(wire.F_DONE, 9, 4) + b"\x01\x00\x00\x00" + b"skip-me!" + b"tail")

    def send() -> None:  # in pieces of 1..13 bytes, then the rest
        pos = 0
        for size in itertools.cycle(range(1, 14)):
            if pos >= 4096:
                break
            a.sendall(stream[pos:pos + size])
            pos += size
        a.sendall(stream[pos:])

    t = threading.Thread(target=send)
    t.start()
    assert rx.header() == (wire.F_PONG, 7, 3)
    assert rx.exact(3) == b"abc"
    assert rx.header() == (wire.F_DATA, 8, len(big))
    dst = bytearray(len(big))
    rx.into(memoryview(dst))
    assert dst == big
    assert rx.header() == (wire.F_DONE, 9, 4)
    assert rx.exact(4) == b"\x01\x00\x00\x00"
    rx.discard(8)
    assert rx.exact(4) == b"tail"
    t.join()
    a.close()
    with pytest.raises(ConnectionError):
        rx.header()


def test_a_payload_longer_than_the_buffer_grows_with_what_arrives(
        pair: tuple[socket.socket, Rx]) -> None:
    a, rx = pair
    big = bytes(range(251)) * 700  # ~172 KiB through exact()
    t = threading.Thread(target=a.sendall, args=(big,))
    t.start()
    assert rx.exact(len(big)) == big
    t.join()


def test_small_reply_takes_only_its_own_answer(pair: tuple[socket.socket, Rx]) -> None:
    a, rx = pair
    data = bytes(range(64))
    # DATA in two frames, then DONE: staged, status returned
    a.sendall(_hdr(wire.F_DATA, 5, 40) + data[:40] + _hdr(wire.F_DATA, 5, 24) + data[40:]
              + _hdr(wire.F_DONE, 5, 4) + struct.pack("<I", 0))
    stage = Stage(64, wire.SMALL_BYTES)
    assert rx.small_reply(5, stage) == 0 and stage.left == 0
    dst = (ctypes.c_char * 80)()
    stage.land(ctypes.addressof(dst) + 8)
    assert dst.raw == bytes(8) + data + bytes(8)
    # another request's frame, a refusal status, too much DATA, a long DONE: left unread
    for frames in (_hdr(wire.F_DONE, 6, 4) + bytes(4),
                   _hdr(wire.F_PING, 5, 0),
                   _hdr(wire.F_DATA, 5, 65) + bytes(65),
                   _hdr(wire.F_DONE, 5, 8) + bytes(8)):
        a.sendall(frames)
        stage = Stage(64, wire.SMALL_BYTES)
        assert rx.small_reply(5, stage) == -1
        assert stage.left == 64 and rx.buffered == len(frames)
        rx.discard(len(frames))
    a.sendall(_hdr(wire.F_DONE, 5, 4) + struct.pack("<I", PARAM_INVALID))
    stage = Stage(64, wire.SMALL_BYTES)
    assert rx.small_reply(5, stage) == PARAM_INVALID and stage.left == 64
    with pytest.raises(ValueError):  # an incomplete answer never lands
        stage.land(ctypes.addressof(dst))
    with pytest.raises(ValueError):
        Stage(wire.SMALL_BYTES + 1, wire.SMALL_BYTES)


def test_stage_refuses_more_data_than_it_lacks(pair: tuple[socket.socket, Rx]) -> None:
    a, rx = pair
    a.sendall(bytes(10))
    stage = Stage(8, wire.SMALL_BYTES)
    with pytest.raises(wire.ProtocolError):
        stage.recv(rx, 9)
    stage.recv(rx, 8)
    assert stage.left == 0 and rx.exact(2) == bytes(2)


class _Entry:
    """A served cache: ``n`` tensors of ``T`` bytes (the regions may be shorter)."""

    def __init__(self, n: int, T: int, sizes: list[int]) -> None:
        self.bufs = [ctypes.create_string_buffer(bytes((i * 37 + k) & 0xFF for i in range(s)), s)
                     for k, s in enumerate(sizes)]
        self.n = n
        self.T = T
        self.regions = [Region(ctypes.addressof(b), s, b) for b, s in zip(self.bufs, sizes)]
        self.registered = True
        self.held = 0

    def acquire(self) -> bool:
        if self.registered:
            self.held += 1
        return self.registered

    def release(self) -> None:
        self.held -= 1


class _Owner:
    cluster_id = 1
    initialized = True


def test_serve_one_run_answers_as_serve_small_read(pair: tuple[socket.socket, Rx]) -> None:
    a, rx = pair
    owner = _Owner()
    served = {3: _Entry(2, 100, [100, 60]), 4: _Entry(3, 100, [100, 100]),
              5: _Entry(1, 64, [64])}
    served[5].registered = False

    def grant3(o: object, s: dict[int, _Entry], cache_id: int) -> tuple[int, object]:
        entry = s.get(cache_id)
        if entry is None or not entry.acquire():
            return NOT_EXIST, None
        return Status.LLM_SUCCESS, entry

    def grant1(cache_id: int) -> tuple[int, object]:
        return grant3(owner, served, cache_id)

    cases = 0
    for cache_id, k, o, n in itertools.product(
            (3, 4, 5, 9), (0, 1, 2, 3, (1 << 32) - 1), (-1, 0, 1, 40, 59, 60, 99, 100, 1 << 62),
            (-1, 0, 1, 20, 40, 41, 100, wire.SMALL_BYTES + 1)):
        payload = struct.pack("<QIIIqq", cache_id, 1, 1, k, o, n)
        try:
            want: bytes | type[Exception] = serve_small_read(owner, grant1, 77, payload)  # type: ignore[arg-type]
        except wire.ProtocolError:
            want = wire.ProtocolError
        got = serve_one_run(payload, 77, grant3, owner, served, wire.SMALL_BYTES, PARAM_INVALID,
                            wire.MAGIC, wire.PROTOCOL_VERSION)
        # the same request as a frame, served straight from a connection's reader
        a.sendall(wire.frame(wire.F_LEASE_READ, 77, payload))
        framed = rx.serve_lease_read(grant3, owner, served, wire.SMALL_BYTES, PARAM_INVALID)
        if want is wire.ProtocolError:
            assert got is None and framed is None  # left to the generic path, which refuses it
            rx.discard(wire.HDR.size + len(payload))
        else:
            assert got == want, (cache_id, k, o, n)
            assert framed == (77, want)
        assert rx.buffered == 0
        assert all(e.held == 0 for e in served.values())
        cases += 1
    assert cases == 4 * 5 * 9 * 8
    # anything but one tensor x one run is the generic path's
    for payload in (struct.pack("<QIIIqq", 3, 2, 1, 0, 0, 8)[:-4],
                    struct.pack("<QII", 3, 1, 2) + struct.pack("<Iqqqq", 0, 0, 0, 8, 8),
                    struct.pack("<QIIIqq", 3, 1, 1, 0, 0, 8) + b"\0"):
        assert serve_one_run(payload, 1, grant3, owner, served, wire.SMALL_BYTES, PARAM_INVALID,
                             wire.MAGIC, wire.PROTOCOL_VERSION) is None
        a.sendall(wire.frame(wire.F_LEASE_READ, 1, payload))
        assert rx.serve_lease_read(grant3, owner, served, wire.SMALL_BYTES, PARAM_INVALID) is None
        assert rx.buffered == wire.HDR.size + len(payload)  # left unread
        rx.discard(rx.buffered)
    a.sendall(wire.frame(wire.F_PING, 3))  # not a LEASE_READ: left unread
    assert rx.serve_lease_read(grant3, owner, served, wire.SMALL_BYTES, PARAM_INVALID) is None
    assert rx.header() == (wire.F_PING, 3, 0)


def test_a_socket_in_timeout_mode_waits_with_its_timeout() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.2)  # non-blocking underneath: the reader waits through the socket
        rx = Rx(b)
        timer = threading.Timer(0.05, a.sendall, args=(_hdr(wire.F_PONG, 4, 0),))
        timer.start()
        assert rx.header() == (wire.F_PONG, 4, 0)
        timer.join()
        with pytest.raises(TimeoutError):
            rx.header()
