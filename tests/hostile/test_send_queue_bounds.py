"""A connection's send queue bounds (kvdd.sim.fabric.tx, docs/security.md *Bounds*), exactly.

A peer that never reads its answers makes them wait in its connection's queue: at most
``MAX_JOBS`` of its requests and ``MAX_QUEUED_BYTES`` of answers wait; the frame that would go
past either bound cuts the connection off.  A prepared answer counts as at least
``ANSWER_CHARGE`` bytes, so a flood of tiny refusals is cut off after
``MAX_QUEUED_BYTES // ANSWER_CHARGE`` of them, not after millions.

The connection here is never started: its sending task never runs, as for a peer whose socket
never takes a byte, and the test reads each frame as the connection's reader does.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from kvdd import Status
from kvdd.sim.fabric import tx, wire
from kvdd.sim.fabric.channel import Channel

from hostile import rawpeer
from hostile.rawpeer import MinimalOwner


@pytest.fixture
def conn() -> Iterator[tuple[Channel, socket.socket]]:
    """A connection (ours) and the raw peer's end of it."""
    ours, peer = socket.socketpair()
    # blocking, as a started connection's socket (its sends never wait: MSG_DONTWAIT); it is
    # read only once the peer sent a whole frame
    ours.settimeout(None)
    peer.settimeout(5.0)
    owner = MinimalOwner()
    chan = Channel(ours, owner, "queue")  # type: ignore[arg-type]
    try:
        yield chan, peer
    finally:
        chan.kill()
        peer.close()
        del owner


def _receive(chan: Channel, peer: socket.socket, data: bytes) -> bool:
    """The peer sends one frame; the connection reads and handles it as its reader does (a
    broken bound ends the connection).  Whether the connection is still up."""
    peer.sendall(data)
    try:
        chan._frame()
    except wire.ProtocolError as exc:
        chan._fail(exc)
    return not chan.dead.is_set()


def _fill(chan: Channel) -> None:
    """The peer reads nothing: our side's socket buffer is full, no answer goes out at once."""
    chan.sock.setblocking(False)
    try:
        while True:
            chan.sock.send(bytes(1 << 16))
    except BlockingIOError:
        pass
    finally:
        chan.sock.settimeout(None)


def test_exactly_max_jobs_queued_requests_keep_the_connection(
        conn: tuple[Channel, socket.socket]) -> None:
    chan, peer = conn
    for req in range(1, wire.MAX_JOBS + 1):
        assert _receive(chan, peer, rawpeer.frame(wire.F_PING, b"", req)), req
    assert chan._queued_jobs == wire.MAX_JOBS
    assert not _receive(chan, peer, rawpeer.frame(wire.F_PING, b"", wire.MAX_JOBS + 1))


def test_small_queued_answers_count_as_answer_charge_bytes(
        conn: tuple[Channel, socket.socket]) -> None:
    """LEASE requests on a cache the link does not show, each refused with a 12-byte answer the
    peer never reads: 2,048 answers (MAX_QUEUED_BYTES of them at ANSWER_CHARGE each) wait, the
    next cuts the connection off."""
    chan, peer = conn
    _fill(chan)
    fit = wire.MAX_QUEUED_BYTES // tx.ANSWER_CHARGE
    assert fit == 2048
    lease = rawpeer.frame(wire.F_LEASE, struct.pack("<Q", 99), 1)
    for i in range(fit):
        assert _receive(chan, peer, lease), i
    assert chan._queued_bytes == wire.MAX_QUEUED_BYTES and chan._queued_jobs == 0
    first = chan._jobs[0]
    assert first is not None
    assert struct.unpack_from("<I", bytes(first[2]), wire.HDR.size)[0] == \
        Status.LLM_KV_CACHE_NOT_EXIST
    assert not _receive(chan, peer, lease)
