"""A READ of long runs sent by the compiled sender while the owner tears its cache down.

The peer asks for far more than its socket holds and stops reading (the sender blocked on a full
socket, stopped inside a frame), then the owner unregisters the cache or finalizes, or the peer
resets its connection: the teardown waits for the lease (at most its lifetime: 1 s here), the
process survives, and every byte the peer received is the stream it asked for.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvdd import DataType, LlmRole
from kvdd.sim.fabric import wire

from conformance.harness import CacheHandle, Node
from hostile import rawpeer

KiB = 1 << 10
T = 1 << 20  # bytes per tensor (4 tensors)


def _owner() -> tuple[Node, int, CacheHandle]:
    p = Node(1, LlmRole.PROMPT)
    p.initialize(listen=True)
    h = p.register(4, DataType.DT_INT32, (4, 1 << 16))
    return p, p.listen_port or 0, h


def _expected(p: Node, h: CacheHandle, tensors: list[int], off: list[int], length: list[int]) -> bytes:
    return b"".join(p.tensor_bytes(h, k)[o:o + n] for k in tensors for o, n in zip(off, length))


def _frames(data: bytes, req: int) -> bytes:
    """The payload of the DATA frames of ``data`` (every header checked), up to a cut."""
    out, pos = bytearray(), 0
    while pos + wire.HDR.size <= len(data):
        _m, _v, ftype, rreq, n = wire.HDR.unpack_from(data, pos)
        if ftype != wire.F_DATA:
            break
        assert rreq == req and 0 < n <= wire.MAX_DATA
        out += data[pos + wire.HDR.size:pos + wire.HDR.size + n]
        pos += wire.HDR.size + n
    return bytes(out)


@pytest.mark.parametrize("how", ["unregister", "finalize", "reset"])
def test_a_stalled_block_read_survives_teardown(how: str) -> None:
    p, port, h = _owner()
    cache_id = h.cache_id
    try:
        assert port
        s, _snap = rawpeer.link(port, 4343, wait_ms=1000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        status, lease_id = rawpeer.lease(s, cache_id)
        assert status == 0
        tensors = [0, 1, 2, 3, 3, 2, 1, 0] * 8
        off, length = [0, 512 * KiB, 64 * KiB], [256 * KiB, 512 * KiB, 64 * KiB]
        expected = _expected(p, h, tensors, off, length)
        req = wire.encode_request(lease_id, tensors, np.array(off, np.int64), np.array(length, np.int64))
        s.sendall(rawpeer.frame(wire.F_READ, req, 9))
        time.sleep(0.5)  # the owner's socket is full: its sender is blocked mid-stream
        got = bytearray(s.recv(100_000))  # a little, cut somewhere inside a frame
        time.sleep(0.2)
        t0 = time.monotonic()
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            time.sleep(0.3)
            p.unregister(cache_id)
        else:
            done = threading.Event()

            def tear() -> None:
                if how == "unregister":
                    p.unregister(cache_id)
                else:
                    p.finalize()
                done.set()

            th = threading.Thread(target=tear)
            th.start()
            s.settimeout(1)
            try:
                while not done.is_set() and time.monotonic() - t0 < 20:
                    d = s.recv(1 << 16)
                    if not d:
                        break
                    got += d
            except OSError:
                pass
            th.join(30)
            assert done.is_set()
            took = time.monotonic() - t0
            s.close()
            payload = _frames(bytes(got), 9)
            assert len(payload) > 50_000 and payload == expected[:len(payload)]
            assert took < 5  # the lease's lifetime (1 s) and its grace, not the stream's
        assert time.monotonic() - t0 < 10
    finally:
        p.close()
