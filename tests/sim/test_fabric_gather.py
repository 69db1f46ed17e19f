"""Big transfers over a link's TCP connection in few system calls (kvdd/sim/fabric).

The owner gathers a READ's long runs into lists of buffers of at most ``GATHER_BYTES`` of the
tensors and ``GATHER_BUFFERS`` buffers (one ``sendmsg`` each) in DATA frames of ``MAX_DATA``
bytes; the caller scatters a DATA payload into its destination runs with ``recvmsg``
(:meth:`~kvdd.sim.fabric.rx.Rx.into_views`); a pool task that queues itself again is taken by the
thread that ran it (:meth:`~kvdd.sim.fabric.reactor.Reactor.submit_after`); a frame with no reply
goes at once when nothing else is being sent.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd._native._gather import GatherSender
from kvdd.sim.fabric import serving, wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.reactor import REACTOR
from kvdd.sim.fabric.rx import Rx
from kvdd.sim.fabric.serving import GATHER_BUFFERS, GATHER_BYTES, RunPlan, as_lists
from kvdd.sim.fabric.streams import Cursor, Layout
from kvdd.sim.memory import Region

from hostile import rawpeer
from hostile.rawpeer import MinimalOwner

KiB = 1 << 10


def _region(a: np.ndarray) -> Region:
    return Region(int(a.ctypes.data), a.nbytes, a)


def _stream(src: list[np.ndarray], tensors: list[int], off: np.ndarray,
            length: np.ndarray) -> bytes:
    """The byte stream of a request (tensor k outer, run j inner)."""
    return b"".join(src[k][o:o + n].tobytes() for k in tensors
                    for o, n in zip(off.tolist(), length.tolist()))


def _walk(lists: Iterator[list[memoryview]]) -> tuple[list[list[bytes]], list[int], bytes]:
    """Each list's buffers copied as it comes (the sender sends a list whole before it asks for
    the next), the DATA frames' lengths, and the payload bytes in order."""
    got: list[list[bytes]] = []
    for bufs in lists:
        got.append([bytes(b) for b in bufs])
    wire_bytes = b"".join(b for bufs in got for b in bufs)
    frames, payload, pos = [], [], 0
    while pos < len(wire_bytes):
        _m, _v, ftype, req, n = wire.HDR.unpack_from(wire_bytes, pos)
        assert (ftype, req) == (wire.F_DATA, 7)
        frames.append(n)
        payload.append(wire_bytes[pos + wire.HDR.size:pos + wire.HDR.size + n])
        pos += wire.HDR.size + n
    assert pos == len(wire_bytes)
    return got, frames, b"".join(payload)


def test_a_reads_long_runs_are_gathered_into_few_system_calls() -> None:
    """300 runs of 64 KiB and one of 3 MiB in two tensors: every list but the last carries
    exactly GATHER_BYTES of the tensors in at most GATHER_BUFFERS buffers, the stream is one
    DATA frame, and it is the request's bytes in order."""
    rng = np.random.default_rng(3)
    t_bytes = 32 << 20
    src = [rng.integers(0, 256, t_bytes, dtype=np.uint8) for _ in range(2)]
    length = np.full(301, 64 * KiB, np.int64)
    length[150] = 3 << 20
    off = np.sort(rng.choice(np.arange(0, t_bytes - (4 << 20), 64 * KiB), 301, replace=False))
    tensors = [1, 0]
    plan = RunPlan([_region(a) for a in src], np.array(tensors, np.int64), off, length)
    got, frames, payload = _walk(as_lists(plan.send_steps(7)))
    assert payload == _stream(src, tensors, off, length)
    assert frames == [plan.total]  # below MAX_DATA: one frame
    sizes = [sum(len(b) for b in bufs) - (wire.HDR.size if i == 0 else 0)
             for i, bufs in enumerate(got)]
    assert sizes[:-1] == [GATHER_BYTES] * (len(got) - 1)  # a list is full at GATHER_BYTES
    assert 0 < sizes[-1] <= GATHER_BYTES
    assert len(got) == -(-plan.total // GATHER_BYTES)
    assert max(len(bufs) for bufs in got) <= GATHER_BUFFERS
    assert all(len(b) for bufs in got for b in bufs)  # no empty buffer


def test_gathered_lists_hold_at_most_gather_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of 1 KiB made long by a low STAGE_RUN_BYTES: the buffer count ends a list
    (GATHER_BUFFERS at most, DATA headers included) long before GATHER_BYTES would; frames
    split at MAX_DATA, inside runs."""
    monkeypatch.setattr(serving, "STAGE_RUN_BYTES", 1 * KiB)
    monkeypatch.setattr(serving, "MAX_DATA", 100_003)  # frames end inside runs
    rng = np.random.default_rng(4)
    src = [rng.integers(0, 256, 1 << 20, dtype=np.uint8)]
    length = np.full(700, 1 * KiB, np.int64)
    off = np.arange(700, dtype=np.int64) * KiB
    plan = RunPlan([_region(src[0])], np.zeros(1, np.int64), off, length)
    got, frames, payload = _walk(as_lists(plan.send_steps(7)))
    assert payload == _stream(src, [0], off, length)
    assert frames == [100_003] * 7 + [700 * KiB - 7 * 100_003]
    assert max(len(bufs) for bufs in got) <= GATHER_BUFFERS
    assert all(len(bufs) >= GATHER_BUFFERS - 1 for bufs in got[:-1])


def test_a_staged_piece_ends_its_list() -> None:
    """Short runs go through the staging buffer, which the next staged piece fills again: the
    list holding it is the last one asked for before that (the bytes stay those of the runs
    when each list is copied only as it comes)."""
    rng = np.random.default_rng(5)
    src = [rng.integers(0, 256, 4 << 20, dtype=np.uint8) for _ in range(3)]
    length = np.array([100, 70 * KiB, 3, 2 << 20, 5000], np.int64)
    off = np.array([0, 1 << 20, 300, 2 << 20, 9000], np.int64)  # (the 2 MiB run ends the tensor)
    tensors = [2, 0, 1, 2]
    plan = RunPlan([_region(a) for a in src], np.array(tensors, np.int64), off, length)
    assert not plan.small
    got, frames, payload = _walk(as_lists(plan.send_steps(7)))
    assert payload == _stream(src, tensors, off, length)
    assert frames == [plan.total]
    # per tensor: [100 staged] [70 KiB, 3 staged] [1 MiB] [1 MiB] [5000 staged]
    assert len(got) == 5 * len(tensors)
    assert [len(bufs) for bufs in got[:5]] == [2, 2, 1, 1, 1]  # (the first with the header)


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection (the second end times out after 5 s: a test never hangs)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    b.settimeout(5)
    return a, b


def test_into_views_fills_the_views_from_the_buffer_then_the_socket() -> None:
    """A frame's payload partly buffered by the header's read: into_views puts the buffered
    bytes, then the rest straight from the socket, into the views in order (an empty view
    included), and leaves the next frame's bytes where they were."""
    a, b = _socket_pair()
    rx = Rx(b)
    payload = bytes(np.random.default_rng(6).integers(0, 256, 300 * KiB, dtype=np.uint8))
    dst = np.full(400 * KiB, 0xEE, dtype=np.uint8)
    mv = memoryview(dst.data)
    cuts = [(0, 10), (20 * KiB, 70 * KiB), (90 * KiB, 90 * KiB)]
    cuts.append((100 * KiB, 100 * KiB + len(payload) - sum(e - s for s, e in cuts)))
    try:
        a.sendall(rawpeer.hdr(wire.F_DATA, len(payload), 1) + payload[:10_000])
        sender = threading.Thread(target=a.sendall, args=(
            payload[10_000:] + rawpeer.frame(wire.F_PING, req=2),))
        sender.start()
        assert rx.header() == (wire.F_DATA, 1, len(payload))
        assert 0 < rx.buffered < len(payload)
        rx.into_views([mv[s:e] for s, e in cuts])
        sender.join()
        expected = np.full(400 * KiB, 0xEE, dtype=np.uint8)
        pos = 0
        for s, e in cuts:
            expected[s:e] = np.frombuffer(payload[pos:pos + e - s], dtype=np.uint8)
            pos += e - s
        assert pos == len(payload)
        assert np.array_equal(dst, expected)
        assert rx.header() == (wire.F_PING, 2, 0)  # the next frame, whole
    finally:
        a.close()
        b.close()


def test_into_views_ends_when_the_peer_closes_first() -> None:
    a, b = _socket_pair()
    rx = Rx(b)
    dst = bytearray(64 * KiB)
    try:
        a.sendall(b"x" * 1000)
        a.close()
        with pytest.raises(ConnectionError):
            rx.into_views([memoryview(dst)[:32 * KiB], memoryview(dst)[32 * KiB:]])
        assert dst[:1000] == b"x" * 1000 and dst[1000:] == bytes(64 * KiB - 1000)
    finally:
        b.close()


def test_a_cursor_puts_frames_of_any_size_into_the_runs() -> None:
    """A READ's DATA in frames of 1 byte, 100 bytes, 70 KiB and the rest lands in the runs of
    two regions (k outer, j inner), nothing outside them; one byte more is refused."""
    rng = np.random.default_rng(7)
    dst = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(2)]
    off = np.array([0, 200 * KiB, 600 * KiB], np.int64)
    length = np.array([70 * KiB, 80 * KiB, 100 * KiB], np.int64)
    layout = Layout([_region(d) for d in dst], off, length)
    assert not layout.staged
    payload = bytes(rng.integers(0, 256, layout.total, dtype=np.uint8))
    a, b = _socket_pair()
    rx = Rx(b)
    cursor = Cursor(layout)
    try:
        pos = 0
        for n in (1, 100, 70 * KiB, layout.total - 1 - 100 - 70 * KiB):
            a.sendall(payload[pos:pos + n])
            cursor.recv(rx, n)
            pos += n
        assert cursor.left == 0
        with pytest.raises(wire.ProtocolError):
            cursor.recv(rx, 1)
    finally:
        a.close()
        b.close()
    expected = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(2)]
    pos = 0
    for e in expected:
        for o, n in zip(off.tolist(), length.tolist()):
            e[o:o + n] = np.frombuffer(payload[pos:pos + n], dtype=np.uint8)
            pos += n
    assert all(np.array_equal(d, e) for d, e in zip(dst, expected))


def test_a_layout_refuses_a_run_outside_its_region() -> None:
    """Runs received straight into a region (not staged) are checked against it at once."""
    half = 128 * KiB
    regions = [_region(np.zeros(2 * half, dtype=np.uint8)), _region(np.zeros(4 * half, np.uint8))]
    assert not Layout(regions, np.array([0, half]), np.array([half, half])).staged  # to the end
    with pytest.raises(ValueError):
        Layout(regions, np.array([0, half + 1]), np.array([half, half]))
    with pytest.raises(ValueError):
        Layout(regions, np.array([-1, half]), np.array([half, half]))
    Layout(regions, np.array([2 * half + 1, half]), np.array([0, half]))  # (an empty run)


def test_a_task_queued_after_its_own_runs_on_the_same_pool_thread() -> None:
    """A pool task that queues work with submit_after (its share spent) and then takes a while:
    no other thread is woken for that work, the same thread runs it once it returns.  From
    any other thread, submit_after wakes one (the work runs)."""
    started = threading.Event()
    REACTOR.submit(started.set)  # the pool is up, its threads polling or idle
    assert started.wait(5)
    time.sleep(0.1)
    ran: dict[str, int] = {}
    done = threading.Event()

    def second() -> None:
        ran["second"] = threading.get_ident()
        done.set()

    def first() -> None:
        ran["first"] = threading.get_ident()
        REACTOR.submit_after(second)
        time.sleep(0.2)  # (an idle thread woken for it would take it meanwhile)

    REACTOR.submit(first)
    assert done.wait(5)
    assert ran["second"] == ran["first"]
    outside = threading.Event()
    REACTOR.submit_after(outside.set)
    assert outside.wait(5)


def test_a_release_goes_at_once_when_nothing_else_is_sent() -> None:
    """A RELEASE with nothing queued before it is sent by the caller (no sending task), and a
    connection's TCP socket sends small frames at once (TCP_NODELAY)."""
    a, b = _socket_pair()
    chan = Channel(a, MinimalOwner(), "oneway")  # type: ignore[arg-type]
    chan.start()
    b.settimeout(5)
    queued: list[object] = []

    class Recording:  # the pool, with the tasks queued on it seen
        def __getattr__(self, name: str) -> object:
            return getattr(REACTOR, name)

        def submit(self, task: object) -> None:
            queued.append(task)
            REACTOR.submit(task)  # type: ignore[arg-type]

        def submit_after(self, task: object) -> None:
            queued.append(task)
            REACTOR.submit_after(task)  # type: ignore[arg-type]

    chan._reactor = Recording()  # type: ignore[assignment]
    try:
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        chan.send_oneway(wire.F_RELEASE, (42).to_bytes(8, "little"))
        assert rawpeer.read_frame(b) == (wire.F_RELEASE, 0, (42).to_bytes(8, "little"))
        assert chan._tx_run not in queued  # sent by the caller
    finally:
        chan.kill()
        a.close()
        b.close()


def test_a_cursor_receives_a_frame_of_many_runs_in_pieces() -> None:
    """One DATA payload over 150 runs (more than SCATTER_BUFFERS views): every run gets its
    bytes, in order, and the cursor counts them all."""
    from kvdd.sim.fabric.rx import SCATTER_BUFFERS

    runs = 150
    assert runs > 2 * SCATTER_BUFFERS
    dst = np.zeros(2 * runs * 64 * KiB, dtype=np.uint8)
    off = np.arange(runs, dtype=np.int64)[::-1] * 2 * 64 * KiB  # every other block, backwards
    length = np.full(runs, 64 * KiB, np.int64)
    layout = Layout([_region(dst)], off, length)
    payload = bytes(np.random.default_rng(8).integers(0, 256, layout.total, dtype=np.uint8))
    a, b = _socket_pair()
    sender = threading.Thread(target=a.sendall, args=(payload,))
    sender.start()
    try:
        cursor = Cursor(layout)
        cursor.recv(Rx(b), layout.total)
        assert cursor.left == 0
    finally:
        sender.join()
        a.close()
        b.close()
    expected = np.zeros_like(dst)
    for j, o in enumerate(off.tolist()):
        expected[o:o + 64 * KiB] = np.frombuffer(payload[j * 64 * KiB:(j + 1) * 64 * KiB], np.uint8)
    assert np.array_equal(dst, expected)


class _Lease:
    """A lease the stand-in checker grants: the cache's regions, the owner's action before DONE."""

    def __init__(self, regions: list[Region], on_served: object) -> None:
        self.entry = type("Entry", (), {"regions": regions})()
        self.on_served = on_served
        self.unused = 0

    def unuse(self) -> None:
        self.unused += 1


class _Checker:
    def __init__(self, lease: _Lease) -> None:
        self.lease = lease

    def check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                   length: np.ndarray) -> tuple[int, _Lease]:
        return 0, self.lease


@pytest.mark.parametrize("runs", ["blocks", "row", "no byte"])
def test_a_reads_done_goes_in_the_system_call_of_its_last_bytes(runs: str) -> None:
    """A READ's DONE is the last buffer of the list of its last DATA bytes (one system call: the
    caller gets both with one wake-up), for a READ of blocks (the compiled sender) and of one
    long row (a READ of no byte: DONE alone); when the owner acts before DONE (a two-sided pull's
    key), DONE follows that action in a list of its own.  The lease is let go once the last list
    was taken."""
    src = [np.arange(16 << 20, dtype=np.uint8)]
    off, length = {"blocks": (np.arange(0, 96) * 128 * KiB, np.full(96, 64 * KiB)),  # 6 MiB
                   "row": (np.array([5]), np.array([(6 << 20) + 3])),
                   "no byte": (np.array([5, 9]), np.array([0, 0]))}[runs]
    payload = wire.encode_request(9, [0], off, length)
    done = wire.frame(wire.F_DONE, 7, (0).to_bytes(4, "little"))
    acted: list[list[int]] = []
    for on_served in (None, acted.append):
        lease = _Lease([_region(src[0])], on_served)
        steps = serving.serve_read_steps(_Checker(lease), MinimalOwner(), 7, payload)  # type: ignore[arg-type]
        first = next(steps)
        if runs == "blocks":  # (6 MiB of long runs: the compiled sender)
            assert isinstance(first, GatherSender)
        got, acted_before_done = [], -1
        for bufs in as_lists(itertools.chain([first], steps)):
            got.append([bytes(b) for b in bufs])
            if done in got[-1]:
                acted_before_done = len(acted)
        assert lease.unused == 1
        wire_bytes = b"".join(b for bufs in got for b in bufs)
        assert wire_bytes.endswith(done) and wire_bytes.count(done) == 1
        if on_served is None:
            assert got[-1][-1] == done  # with the last DATA bytes (alone when there are none)
            assert len(got[-1]) == 1 if runs == "no byte" else len(got[-1]) > 1
            assert not acted
        else:
            assert got[-1] == [done] and acted == [[0]]  # alone, after the owner's action
            assert acted_before_done == 1
        data = [memoryview(b) for bufs in got for b in bufs][:-1]  # (DONE left out)
        _frames, _lengths, payload_bytes = _walk(iter([data]))
        assert payload_bytes == _stream(src, [0], off, length)
