"""The cross-process bench's raw loopback socket (kvdd.bench.xproc_peer): both receivers move the
exact bytes asked for, the gathered one leaves SO_RCVLOWAT at 1, and the bench takes the faster."""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvdd.bench.xproc import _best_socket
from kvdd.bench.xproc_peer import XP_RAW_GATHER, XP_RAW_LOWAT, RawSocket, serve_raw

KiB = 1 << 10


def _within(seconds: float, fn: Callable[[], object], sock: socket.socket) -> None:
    """``fn()`` on a thread: it must return within ``seconds`` (a receiver waiting for bytes that
    never come is failed, and unblocked by shutting its socket down), its exception raised here."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # (re-raised below)
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        sock.shutdown(socket.SHUT_RDWR)
        t.join(5)
        pytest.fail("the receiver waited for bytes that never come")
    if err:
        raise err[0]


def test_the_raw_receivers_move_the_exact_bytes() -> None:
    src = np.random.default_rng(4).integers(0, 256, 11 << 20, dtype=np.uint8)
    assert len(src) > XP_RAW_GATHER + XP_RAW_LOWAT  # (some receives gathered, the last ones not)
    server = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=serve_raw, args=(server, src.data.cast("B")), daemon=True)
    t.start()
    raw = RawSocket(server.getsockname()[1])
    try:
        dst = np.full(len(src) + 4 * KiB, 0xEE, np.uint8)
        mv = dst.data.cast("B")
        for n in (len(src), len(src) - 3 * KiB - 1, XP_RAW_LOWAT + 5, XP_RAW_GATHER + XP_RAW_LOWAT // 2):
            dst[:] = 0xEE
            _within(10, functools.partial(raw.pull_gathered, mv, n), raw.sock)
            assert np.array_equal(dst[:n], src[:n]) and (dst[n:] == 0xEE).all(), n
            assert raw.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
            dst[:] = 0xEE
            raw.pull(mv, n)
            assert np.array_equal(dst[:n], src[:n]) and (dst[n:] == 0xEE).all(), n
        raw.pull(mv, 64)  # a small request after them: every arrival wakes the receiver again
        assert np.array_equal(dst[:64], src[:64])
    finally:
        raw.close()
        t.join(5)
        server.close()


def test_the_gathered_receiver_leaves_the_wakeups_plain_when_the_peer_closes() -> None:
    """The raw peer sends 3 MiB of the 9 MiB asked for and closes: the pull fails, and
    SO_RCVLOWAT is 1 again."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(8)
            conn.sendall(bytes(3 << 20))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    raw = RawSocket(server.getsockname()[1])
    try:
        dst = bytearray(9 << 20)
        with pytest.raises(RuntimeError):
            _within(10, functools.partial(raw.pull_gathered, memoryview(dst), len(dst)), raw.sock)
        assert raw.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        raw.sock.close()
        t.join(5)
        server.close()


def test_the_bench_takes_the_faster_raw_receiver() -> None:
    def timing(best: float) -> dict[str, float]:
        return {"min_s": best, "median_s": 2 * best, "samples": 3}

    both = {"transfer", "socket", "socket_chunks", "socket_gathered"}
    res = _best_socket({"transfer": timing(1.0), "socket": timing(0.5), "socket_gathered": timing(0.4)})
    assert set(res) == both and res["socket"]["min_s"] == 0.4 and res["socket_chunks"]["min_s"] == 0.5
    res = _best_socket({"transfer": timing(1.0), "socket": timing(0.5), "socket_gathered": timing(0.6)})
    assert set(res) == both and res["socket"]["min_s"] == 0.5 and res["socket_gathered"]["min_s"] == 0.6
    # the tied case keeps the 64 KiB-chunk receiver (the gathered one must be faster)
    res = _best_socket({"transfer": timing(1.0), "socket": timing(0.5), "socket_gathered": timing(0.5)})
    assert res["socket"] is res["socket_chunks"]
    assert _best_socket({"transfer": timing(1.0)}) == {"transfer": timing(1.0)}  # no raw socket: none
