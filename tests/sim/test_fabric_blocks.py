"""TCP block pulls (kvdd/sim/fabric): the caller's wake-ups gathered, the owner's block lists.

* A long DATA payload is received with ``SO_RCVLOWAT`` raised (:meth:`~kvdd.sim.fabric.streams.
  Cursor.recv`): the socket wakes the receiving thread once that many bytes are queued, so it is
  raised only while at least that many bytes of the payload follow the views being filled (a
  receiver waiting for bytes that never come would hang), and it is 1 again afterwards (the
  fabric's pool is notified of every arrival), also when the peer closes mid-frame.
* A READ whose every run is long (blocks) is cut into lists by
  :meth:`~kvdd.sim.fabric.serving.RunPlan._block_steps`, many whole runs at a time: the lists are
  exactly those of the piece-by-piece rule (a header where a DATA frame begins, a run cut where a
  frame or a list ends, a list ended at GATHER_BYTES of the tensors or GATHER_BUFFERS - 1
  buffers), checked here, bytes and all, against that rule written out plainly.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvdd.sim.fabric import serving, streams, wire
from kvdd.sim.fabric.rx import Rx
from kvdd.sim.fabric.serving import GATHER_BUFFERS, RunPlan, as_lists
from kvdd.sim.fabric.streams import Cursor, Layout
from kvdd.sim.memory import Region

KiB = 1 << 10


def _region(a: np.ndarray) -> Region:
    return Region(int(a.ctypes.data), a.nbytes, a)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection (the receiving end times out after 5 s: a receiver waiting for
    bytes that never come fails the test instead of hanging it)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    b.settimeout(5)
    return a, b


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def _blocks_layout(runs: int, seed: int) -> tuple[np.ndarray, np.ndarray, Layout, bytes]:
    dst = np.full(2 * runs * 64 * KiB, 0xEE, dtype=np.uint8)
    off = np.random.default_rng(seed).permutation(2 * runs)[:runs].astype(np.int64) * 64 * KiB
    layout = Layout([_region(dst)], off, np.full(runs, 64 * KiB, np.int64))
    payload = bytes(np.random.default_rng(seed + 1).integers(0, 256, layout.total, dtype=np.uint8))
    return dst, off, layout, payload


def _expected(dst: np.ndarray, off: np.ndarray, payload: bytes) -> np.ndarray:
    out = np.full_like(dst, 0xEE)
    for j, o in enumerate(off.tolist()):
        out[o:o + 64 * KiB] = np.frombuffer(payload[j * 64 * KiB:(j + 1) * 64 * KiB], np.uint8)
    return out


def test_a_long_payload_is_received_with_gathered_wakeups(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 runs of 64 KiB (12.5 MiB) sent in uneven pieces with pauses, then nothing more (the
    connection stays open): every run gets its bytes, nothing else is touched, SO_RCVLOWAT is
    raised for the first views only while RCV_LOWAT bytes or more follow them, and is 1 again
    at the end."""
    lowat = 512 * KiB
    monkeypatch.setattr(streams, "RCV_LOWAT", lowat)
    dst, off, layout, payload = _blocks_layout(200, 11)
    a, b = _tcp_pair()
    seen: list[tuple[int, int]] = []  # (SO_RCVLOWAT, bytes of the payload after these views)
    left = [layout.total]

    class Spy(Rx):
        __slots__ = ()

        def into_views(self, views: list[memoryview]) -> None:
            n = sum(len(v) for v in views)
            left[0] -= n
            seen.append((_lowat(b), left[0]))
            Rx.into_views(self, views)

    spy = Spy(b)

    def send() -> None:
        pos = 0
        for cut in (3 * KiB, 700 * KiB, 1 << 20, 5 << 20, len(payload)):
            a.sendall(payload[pos:cut])
            pos = cut
            time.sleep(0.02)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        cursor = Cursor(layout)
        cursor.recv(spy, layout.total)
        assert cursor.left == 0
        assert _lowat(b) == 1
    finally:
        sender.join()
        a.close()
        b.close()
    assert np.array_equal(dst, _expected(dst, off, payload))
    raised = [after for value, after in seen if value > 1]
    assert raised and all(value in (1, lowat) for value, _ in seen)
    assert min(raised) >= lowat  # never waiting for bytes the payload does not hold
    assert seen[-1] == (1, 0)  # the last views with every arrival waking the receiver


def test_one_long_run_is_received_in_pieces_with_gathered_wakeups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A row (one 12 MiB run + 5 bytes): received RECV_BYTES at a time at most, SO_RCVLOWAT
    raised while RCV_LOWAT bytes or more follow, every byte in place, nothing else touched."""
    monkeypatch.setattr(streams, "RCV_LOWAT", 512 * KiB)
    n = (12 << 20) + 5
    dst = np.full(n + 8 * KiB, 0xEE, dtype=np.uint8)
    layout = Layout([_region(dst)], np.array([4 * KiB], np.int64), np.array([n], np.int64))
    payload = bytes(np.random.default_rng(13).integers(0, 256, n, dtype=np.uint8))
    a, b = _tcp_pair()
    asked: list[tuple[int, int]] = []  # (bytes asked for, SO_RCVLOWAT)

    class Spy(Rx):
        __slots__ = ()

        def into_views(self, views: list[memoryview]) -> None:
            asked.append((sum(len(v) for v in views), _lowat(b)))
            Rx.into_views(self, views)

    sender = threading.Thread(target=a.sendall, args=(payload,))
    sender.start()
    try:
        Cursor(layout).recv(Spy(b), n)
    finally:
        sender.join()
        a.close()
        b.close()
    expected = np.full_like(dst, 0xEE)
    expected[4 * KiB:4 * KiB + n] = np.frombuffer(payload, np.uint8)
    assert np.array_equal(dst, expected)
    assert [size for size, _ in asked] == [streams.RECV_BYTES] * 3 + [5]
    assert [lowat for _, lowat in asked] == [512 * KiB] * 2 + [1, 1]  # (5 bytes follow the third)


def test_the_wakeups_are_plain_again_when_the_peer_closes_mid_payload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "RCV_LOWAT", 256 * KiB)
    dst, _off, layout, payload = _blocks_layout(200, 12)
    a, b = _tcp_pair()
    rx = Rx(b)
    try:
        a.sendall(payload[:1 << 20])
        a.close()
        with pytest.raises(ConnectionError):
            Cursor(layout).recv(rx, layout.total)
        assert _lowat(b) == 1
    finally:
        b.close()


def _rule_lists(src: list[np.ndarray], tensors: list[int], off: np.ndarray, length: np.ndarray,
                req: int) -> list[list[bytes]]:
    """The lists of a READ of long runs, piece by piece (the rule, written out plainly)."""
    total = int(length.sum()) * len(tensors)
    stream, frame_left, gathered = total, 0, 0
    bufs: list[bytes] = []
    out: list[list[bytes]] = []
    for k in tensors:
        for o, n in zip(off.tolist(), length.tolist()):
            pos = 0
            while pos < n:
                if not frame_left:
                    frame_left = min(stream, wire.MAX_DATA)
                    stream -= frame_left
                    bufs.append(wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DATA, req,
                                              frame_left))
                take = min(n - pos, frame_left, serving.GATHER_BYTES - gathered)
                bufs.append(src[k][o + pos:o + pos + take].tobytes())
                pos += take
                frame_left -= take
                gathered += take
                if gathered >= serving.GATHER_BYTES or len(bufs) >= GATHER_BUFFERS - 1:
                    out.append(bufs)
                    bufs, gathered = [], 0
    if bufs:
        out.append(bufs)
    return out


@pytest.mark.parametrize("lengths, max_data, gather", [
    ((64 * KiB,) * 300, None, None),  # blocks: 16 a list
    ((64 * KiB,) * 300, 1_000_003, None),  # frames that end inside a run
    ((100 * KiB,) * 50, 700 * KiB, None),  # runs that straddle lists (GATHER_BYTES is no multiple)
    ((64 * KiB, 3 << 20, 80 * KiB, 64 * KiB, 2 << 20) * 6, 5 << 20, None),  # many lengths
    ((64 * KiB,) * 300, 9 << 20, 8 << 20),  # lists ended by GATHER_BUFFERS
])
def test_block_lists_are_those_of_the_piece_by_piece_rule(
        monkeypatch: pytest.MonkeyPatch, lengths: tuple[int, ...], max_data: int | None,
        gather: int | None) -> None:
    if max_data is not None:
        monkeypatch.setattr(serving, "MAX_DATA", max_data)
        monkeypatch.setattr(wire, "MAX_DATA", max_data)
    if gather is not None:
        monkeypatch.setattr(serving, "GATHER_BYTES", gather)
    rng = np.random.default_rng(len(lengths))
    t_bytes = 48 << 20
    src = [rng.integers(0, 256, t_bytes, dtype=np.uint8) for _ in range(2)]
    length = np.array(lengths, np.int64)
    # (runs may overlap: the bytes are read, never written)
    off = rng.integers(0, t_bytes - (3 << 20), len(lengths)).astype(np.int64)
    tensors = [1, 0]
    plan = RunPlan([_region(a) for a in src], np.array(tensors, np.int64), off, length)
    got = [[bytes(b) for b in bufs] for bufs in as_lists(plan.send_steps(9))]
    assert plan._each_run
    assert [[len(b) for b in bufs] for bufs in got] == \
        [[len(b) for b in bufs] for bufs in _rule_lists(src, tensors, off, length, 9)]
    assert got == _rule_lists(src, tensors, off, length, 9)
