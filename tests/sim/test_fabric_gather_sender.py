"""The compiled sender of a READ of long runs (:class:`kvdd._native._gather.GatherSender`).

It sends the DATA frames of runs straight from the tensors' memory without blocking and resumes
exactly where the socket stopped taking bytes, inside a header or a run; it refuses runs outside
its tensors before sending anything.  (That its lists are those of the piece-by-piece rule is
tested in test_fabric_blocks.py and test_fabric_gather.py, through ``as_lists``.)
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import textwrap
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvdd._native._gather import GatherSender
from kvdd.sim.fabric import wire

KiB = 1 << 10
HEADER = wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DATA, 7, 0)


def _wire(src: list[np.ndarray], off: list[int], length: list[int], max_data: int) -> bytes:
    """The DATA frames of the stream (tensor outer, run inner), written out plainly."""
    stream = b"".join(s[o:o + n].tobytes() for s in src for o, n in zip(off, length))
    out = []
    for pos in range(0, len(stream), max_data):
        part = stream[pos:pos + max_data]
        out.append(wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DATA, 7, len(part)) + part)
    return b"".join(out)


def _sender(src: list[np.ndarray], off: list[int], length: list[int], max_data: int,
            gather: int = 64 * KiB, buffers: int = 64, runs_as: str = "lists",
            trailer: bytes = b"") -> GatherSender:
    """A sender of the runs given as Python lists, or as int64 buffers (``array('q')``, as the
    server gives them: read without a Python object per run)."""
    o: Sequence[int] = off
    n: Sequence[int] = length
    if runs_as == "int64 buffers":
        o, n = array("q", off), array("q", length)
    return GatherSender([int(s.ctypes.data) for s in src], [s.nbytes for s in src], o, n,
                        HEADER, max_data, gather, buffers, src, None, trailer)


def _send_through_a_small_socket(gs: GatherSender, total: int,
                                 on_stop: Callable[[GatherSender], None]) -> bytes:
    """Send ``gs`` on a connection of a few KiB, drained each time the socket is full (each
    send's bytes checked against :attr:`~GatherSender.left`; ``on_stop`` sees the sender where
    each send stopped): the ``total`` bytes the peer received."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    got = bytearray()
    try:
        while not gs.done:
            before = gs.left
            sent = gs.send(a, 1 << 40)
            assert gs.left == before - sent
            if not gs.done:
                assert gs.blocked
                on_stop(gs)
                select.select([b], [], [], 0.01)
                while True:  # what has arrived
                    try:
                        got.extend(b.recv(1 << 20, socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        break
        while len(got) < total:
            got.extend(b.recv(1 << 20))
        assert gs.left == 0 and gs.send(a, 1 << 40) == 0  # (nothing more)
        return bytes(got)
    finally:
        a.close()
        b.close()


RUNS_AS = ["lists", "int64 buffers"]


@pytest.mark.parametrize("runs_as", RUNS_AS)
@pytest.mark.parametrize("max_data, buffers", [(21, 1024), (1_000, 64), (100_003, 64)])
def test_a_stream_resumes_exactly_where_the_socket_stopped(max_data: int, buffers: int,
                                                           runs_as: str) -> None:
    """A connection of a few KiB, drained each time the socket is full: sends stop at
    arbitrary bytes (inside headers, with frames of 21 bytes, and inside runs), each resumes
    there, and the peer receives the frames of the stream exactly."""
    rng = np.random.default_rng(max_data)
    src = [rng.integers(0, 256, 200 * KiB, dtype=np.uint8) for _ in range(2)]
    off = [0, 150 * KiB, 3, 100 * KiB, 77]
    length = [5 * KiB, 50 * KiB, 0, 1, 33 * KiB]
    expected = _wire([src[1], src[0], src[1]], off, length, max_data)
    gs = _sender([src[1], src[0], src[1]], off, length, max_data, buffers=buffers,
                 runs_as=runs_as)
    assert gs.total == 3 * sum(length) and gs.left == len(expected)
    frame = wire.HDR.size + max_data
    stops = {"header": 0, "run": 0}

    def at_stop(gs: GatherSender) -> None:
        at = (len(expected) - gs.left) % frame
        if at:
            stops["header" if at < wire.HDR.size else "run"] += 1

    assert _send_through_a_small_socket(gs, len(expected), at_stop) == expected
    assert stops["header" if max_data == 21 else "run"] > 0


def test_the_trailer_ends_the_list_of_the_last_bytes_or_a_list_of_its_own() -> None:
    """The trailer (a READ's DONE) is the last buffer of the list of the stream's last bytes
    when that list has room for one more buffer, else a list of its own; :attr:`left` counts it;
    :meth:`lists` gives a copy of it, valid after the sender is gone."""
    src = [np.arange(200 * KiB, dtype=np.uint8)]
    done = b"DONE-of-request7"

    def lists(runs: tuple[list[int], list[int]], buffers: int,
              gather: int = 1 << 20) -> list[list[bytes]]:
        gs = GatherSender([int(src[0].ctypes.data)], [src[0].nbytes], *runs, HEADER, 1 << 20,
                          gather, buffers, src, None, done)
        assert gs.left == wire.HDR.size + sum(runs[1]) + len(done)
        views = list(gs.lists())
        del gs
        return [[bytes(b) for b in bufs] for bufs in views]

    two = ([0, 100 * KiB], [64 * KiB, 64 * KiB])
    one = lists(two, 64)
    assert len(one) == 1 and len(one[0]) == 4 and one[0][3] == done  # header, 2 runs, trailer
    assert one[0][1] == src[0][:64 * KiB].tobytes()
    # a list ended by its buffers or its bytes, the last one with room: the trailer in it
    assert [len(bufs) for bufs in lists(two, 2)] == [2, 2]
    assert [len(bufs) for bufs in lists(two, 64, 64 * KiB)] == [2, 2]
    for n in (2, 64):
        assert [b for bufs in lists(two, n) for b in bufs] == one[0]
    alone = lists(([0], [64 * KiB]), 2)  # [header, run 0]: no room left, the trailer alone
    assert alone == [[one[0][0][:8] + (64 * KiB).to_bytes(4, "little"), one[0][1]], [done]]


def test_a_send_that_stops_inside_the_trailer_resumes_there() -> None:
    """A trailer longer than the socket takes at once: sends stop inside it and each resumes
    at the next byte; the peer receives the stream, then the trailer, exactly."""
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 256, 4 * KiB, dtype=np.uint8)]
    trailer = rng.integers(0, 256, 64 * KiB, dtype=np.uint8).tobytes()
    expected = _wire(src, [0], [100], 1 << 20) + trailer
    gs = _sender(src, [0], [100], 1 << 20, gather=1 << 20, trailer=trailer)
    inside = 0

    def at_stop(gs: GatherSender) -> None:
        nonlocal inside
        inside += 0 < gs.left < len(trailer)

    assert _send_through_a_small_socket(gs, len(expected), at_stop) == expected
    assert inside > 0


def test_a_budget_ends_a_send_between_system_calls() -> None:
    """A budget of one byte: one list (one system call) per send, the socket never full."""
    src = [np.arange(256 * KiB, dtype=np.uint8)]
    a, b = socket.socketpair()
    try:
        gs = _sender(src, [0, 100 * KiB], [64 * KiB, 64 * KiB], 1 << 20, gather=48 * KiB)
        assert gs.send(a, 1) == wire.HDR.size + 48 * KiB
        assert not gs.blocked and not gs.done
        assert gs.send(a, 1) == 48 * KiB  # the rest of run 0 and 32 KiB of run 1
        assert gs.send(a, 1) == 32 * KiB and gs.done
        data = b.recv(wire.HDR.size + 128 * KiB, socket.MSG_WAITALL)[wire.HDR.size:]
        assert data == src[0][:64 * KiB].tobytes() + src[0][100 * KiB:164 * KiB].tobytes()
    finally:
        a.close()
        b.close()


def test_a_socket_nobody_reads_leaves_the_stream_blocked() -> None:
    src = [np.zeros(8 << 20, dtype=np.uint8)]
    a, b = socket.socketpair()
    try:
        gs = _sender(src, [0], [8 << 20], 1 << 30)
        sent = gs.send(a, 1 << 40)
        assert gs.blocked and not gs.done and 0 < sent < 8 << 20
        assert gs.left == wire.HDR.size + (8 << 20) - sent
        assert gs.send(a, 1 << 40) == 0 and gs.blocked  # still full
    finally:
        a.close()
        b.close()


def test_a_closed_connection_raises() -> None:
    src = [np.zeros(64 * KiB, dtype=np.uint8)]
    a, b = socket.socketpair()
    b.close()
    try:
        with pytest.raises(BrokenPipeError):  # (EPIPE, not SIGPIPE: MSG_NOSIGNAL)
            _sender(src, [0], [64 * KiB], 1 << 20).send(a, 1 << 40)
    finally:
        a.close()
    with pytest.raises(OSError):  # a closed socket object: EBADF, before any system call
        _sender(src, [0], [64 * KiB], 1 << 20).send(a, 1 << 40)


def test_a_closed_connection_does_not_raise_sigpipe(tmp_path: Path) -> None:
    """In a process that does not ignore SIGPIPE (a C++ program embedding Python), a send to a
    connection the peer closed is an error, not the signal's default action (exit)."""
    code = textwrap.dedent("""
        import signal, socket
        import numpy as np
        from kvdd._native._gather import GatherSender
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        src = np.zeros(65536, dtype=np.uint8)
        a, b = socket.socketpair()
        b.close()
        try:
            GatherSender([src.ctypes.data], [src.nbytes], [0], [65536], bytes(12), 1 << 20,
                         1 << 20, 64, src).send(a, 1 << 40)
        except BrokenPipeError:
            print("refused")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "refused"), out.stderr


@pytest.mark.parametrize("runs_as", RUNS_AS)
def test_runs_outside_a_tensor_are_refused(runs_as: str) -> None:
    """A run ending exactly at a tensor's last byte is taken; one byte further, a negative
    offset or length, or an end past 2^63 is refused before anything is sent."""
    src = [np.zeros(64 * KiB, dtype=np.uint8), np.zeros(32 * KiB, dtype=np.uint8)]
    gs = _sender(src, [0, 16 * KiB], [32 * KiB, 16 * KiB], 1 << 20, runs_as=runs_as)
    assert gs.total == 2 * 48 * KiB  # (ends at the smaller one's end)
    for off, length in (([16 * KiB], [16 * KiB + 1]), ([-1], [10]), ([0], [-1]),
                        ([1], [(1 << 63) - 1])):
        with pytest.raises(ValueError):
            _sender(src, off, length, 1 << 20, runs_as=runs_as)
    with pytest.raises(ValueError):  # a frame longer than a header can say
        _sender(src, [0], [1], 1 << 32)
    with pytest.raises(ValueError):
        GatherSender([0], [1], [0], [1], HEADER[:11], 1 << 20, 1, 2)


class _LongerThanItsBuffer(array):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4


def test_runs_whose_buffer_is_not_their_length_are_read_as_sequences() -> None:
    """Runs are read from their int64 buffer only when it holds exactly the runs: a buffer
    shorter than its object's length is indexed as a sequence (IndexError, nothing read past
    it), and a strided one is read item by item (as before it was read from a buffer)."""
    src = [np.zeros(64 * KiB, dtype=np.uint8)]
    with pytest.raises(IndexError):
        GatherSender([int(src[0].ctypes.data)], [src[0].nbytes], _LongerThanItsBuffer("q", [0, 100]),
                     _LongerThanItsBuffer("q", [10, 20]), HEADER, 1 << 20, 64 * KiB, 64, src)
    every_other = memoryview(array("q", [0, -1, 100, -1]))[::2]
    lengths = memoryview(array("q", [10, -1, 20, -1]))[::2]
    gs = GatherSender([int(src[0].ctypes.data)], [src[0].nbytes], every_other, lengths, HEADER,
                      1 << 20, 64 * KiB, 64, src)
    assert gs.total == 30


def test_a_read_naming_one_tensor_a_million_times_costs_no_object_per_tensor() -> None:
    """A 4 MiB READ may name one tensor about a million times (two long runs each): the sender
    is made from the distinct tensors and compact indices, in one short step, without a
    Python object (or 8-byte address) per tensor named."""
    import tracemalloc

    from kvdd.sim.fabric.serving import RunPlan
    from kvdd.sim.memory import Region

    src = [np.arange(128 * KiB, dtype=np.uint8), np.full(128 * KiB, 7, dtype=np.uint8)]
    regions = [Region(int(a.ctypes.data), a.nbytes, a) for a in src]
    k = (wire.MAX_REQUEST - wire.REQ.size - 32) // 4
    tensors = np.ones(k, dtype=np.int64)
    tensors[1] = 0
    plan = RunPlan(regions, tensors, np.array([0, 64 * KiB], np.int64),
                   np.full(2, 64 * KiB, np.int64))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        steps = plan.send_steps(7)
        gs = next(steps)
        while isinstance(gs, list):
            gs = next(steps)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert isinstance(gs, GatherSender) and gs.total == k * 128 * KiB
    assert peak < 6 * k, f"{peak} bytes to make the sender of {k} tensors"  # (4-byte indices)
    first = bytes(b"".join(bytes(b) for b in next(gs.lists())))
    assert first[wire.HDR.size:wire.HDR.size + 256 * KiB] == \
        src[1].tobytes() + src[0].tobytes()  # tensors 1, 0, then 1 again


def test_a_sender_is_initialized_once() -> None:
    """Its arrays are made once: a second __init__ (refused runs, or any) is refused and the
    sender still sends its own stream exactly (not runs read through stale counts)."""
    src = [np.arange(64 * KiB, dtype=np.uint8)]
    off, length = [i * 256 for i in range(200)], [64] * 200
    gs = _sender(src, off, length, 1 << 20)
    with pytest.raises((RuntimeError, ValueError)):  # (ValueError: it was taken up to the runs)
        gs.__init__([int(src[0].ctypes.data)], [src[0].nbytes], [70_000], [64], HEADER,  # type: ignore[misc]
                    1 << 20, 64 * KiB, 64, src)
    a, b = socket.socketpair()
    try:
        assert gs.send(a, 1 << 40) == len(_wire(src, off, length, 1 << 20)) and gs.done
        expected = _wire(src, off, length, 1 << 20)
        assert b.recv(len(expected), socket.MSG_WAITALL) == expected
    finally:
        a.close()
        b.close()


def test_lists_are_refused_while_a_send_walks_the_stream() -> None:
    """lists() and send() walk one state and one set of buffers (send with the GIL released):
    a list asked for while a send is in progress is refused, and no byte of the stream is lost."""
    src = [np.arange(256 * KiB, dtype=np.uint8)]
    off, length = [0, 100 * KiB], [64 * KiB, 64 * KiB]
    gs = _sender(src, off, length, 1 << 20, gather=48 * KiB)
    a, b = socket.socketpair()

    class Meddling:  # send() has the stream when it asks for the file descriptor
        def fileno(self) -> int:
            next(gs.lists())
            return a.fileno()

    try:
        with pytest.raises(RuntimeError):
            gs.send(Meddling(), 1 << 40)  # type: ignore[arg-type]
        gs.send(a, 1 << 40)
        assert gs.done
        expected = _wire(src, off, length, 1 << 20)
        assert b.recv(len(expected), socket.MSG_WAITALL) == expected
    finally:
        a.close()
        b.close()


def test_an_uninitialized_or_huge_sender_counts_its_bytes(tmp_path: Path) -> None:
    """``left`` of a sender never initialized is 0 (not a division by zero that kills the
    process), and of a stream of 2^63 - 1 bytes it counts every header (no wrap-around)."""
    code = "from kvdd._native._gather import GatherSender as G; print(G.__new__(G).left)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "0"), out.stderr
    big = (1 << 63) - 1
    gs = GatherSender([4096], [big], [0], [big], HEADER, 0xFFFFFFFF, 1, 2)  # (nothing is sent)
    assert gs.left == big + -(-big // 0xFFFFFFFF) * wire.HDR.size
