"""The receiving side of a link's connection: one buffered reader of frames.

Every byte a link's socket delivers after the handshake goes through one :class:`Rx`, read by
whichever thread leads the connection's receive side at the time (see
:mod:`~kvdd.sim.fabric.channel`); it is compiled (:mod:`kvdd._native._small`, the socket read
with the GIL released).  One ``recv`` of up to :data:`RX_BUFFER` bytes usually holds a small request or a small answer whole (header, payload, the DATA and DONE frames), so a
small call costs one system call to receive.  Big DATA payloads go from the buffer's remainder
straight into their destination and the rest is received into it directly (zero-copy, in chunks
the socket likes; a READ's runs many at a time, :meth:`Rx.into_views`).  Memory per connection: the buffer, plus what a frame's checked length allows.
"""

from __future__ import annotations

import socket
from collections.abc import Generator
from typing import Protocol, TypeVar

from ..._native import _small
from .wire import (F_DATA, F_DONE, F_LEASE_READ, HDR, MAGIC, MAX_LEN, PROTOCOL_VERSION, RECV_CHUNK,
                   REQ, ProtocolError, check_header)

__all__ = ["Rx", "RX_BUFFER", "Sink", "Pending", "Goodbye", "Stage", "Steps", "drive", "ALL"]

RX_BUFFER = 64 << 10  # bytes buffered per connection
SCATTER_BUFFERS = 64  # destinations one recvmsg fills (Rx.into_views)
_WAITALL = socket.MSG_WAITALL
# the compiled reader's twins of the wire format (kvdd/_native/_small.pyx)
assert (_small.HEADER_SIZE, _small.F_DATA, _small.F_DONE, _small.F_LEASE_READ,
        _small.ONE_RUN_SIZE, _small.RECV_CHUNK) == (HDR.size, F_DATA, F_DONE, F_LEASE_READ,
                                                    REQ.size + 20, RECV_CHUNK)

#: A one-run small READ's staging buffer (``Stage(size, limit)``): a :class:`Sink`.
Stage = _small.Stage


T = TypeVar("T")

#: Reading that proceeds as far as the bytes have arrived: a generator that yields how many bytes
#: must be readable (buffered, or in the socket) before it reads on, and is sent how many are
#: (at least that many); it returns its result.  A blocking reader sends :data:`ALL` (its reads
#: then wait for the bytes: :func:`drive`); the fabric's pool (:mod:`~.reactor`) resumes it only
#: when the bytes are there, so its reads never wait.
Steps = Generator[int, int, T]
ALL = 1 << 62  # "every byte asked for": what a blocking reader sends


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end, reading blocking; its result."""
    try:
        next(steps)
        while True:
            steps.send(ALL)
    except StopIteration as stop:
        result: T = stop.value
        return result


def _bad_header(head: bytes) -> None:
    check_header(head)  # raises the precise ProtocolError


class Rx(_small.FrameReader):
    """Buffered frame reader of one socket (not thread-safe: one reader at a time): ``header()``
    (checked: :func:`~.wire.check_header`), ``exact(n)``, ``into(dst)``, ``discard(n)``,
    ``small_reply(req, stage)``, ``serve_lease_read(...)`` (see :mod:`kvdd._native._small`),
    and :meth:`into_views`."""

    __slots__ = ()

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock, MAX_LEN, MAGIC, PROTOCOL_VERSION, _bad_header, ProtocolError,
                         RX_BUFFER)

    def into_views(self, views: list[memoryview]) -> None:
        """The next ``sum(len(v) for v in views)`` bytes into the writable ``views`` in turn
        (``views`` is changed): what is buffered, then straight from the socket, up to
        :data:`SCATTER_BUFFERS` destinations per ``recvmsg`` (zero-copy), each waiting for all
        its bytes (``MSG_WAITALL``: a pool thread asks only for bytes that have arrived).
        ConnectionError when the peer closes first."""
        buffered = self.buffered
        i, n = 0, len(views)
        while buffered and i < n:
            head = views[i]
            take = min(len(head), buffered)
            self.into(head[:take])
            buffered -= take
            if take == len(head):
                i += 1
            else:
                views[i] = head[take:]
        recvmsg_into = self.sock.recvmsg_into
        while i < n:
            if not len(views[i]):  # (nothing to wait for)
                i += 1
                continue
            got = recvmsg_into(views[i:i + SCATTER_BUFFERS], 0, _WAITALL)[0]
            if got == 0:
                raise ConnectionError("connection closed by the peer")
            while got:  # skip what arrived
                head = views[i]
                if got >= len(head):
                    got -= len(head)
                    i += 1
                else:
                    views[i] = head[got:]
                    got = 0


class Sink(Protocol):
    """Where a READ's DATA goes (:class:`~.streams.Cursor`, :class:`~.small.SmallSink`)."""

    @property
    def left(self) -> int: ...  # bytes still expected

    def recv(self, rx: Rx, n: int) -> None: ...


class Goodbye(Exception):
    """The peer finalized (GOODBYE): it serves nothing more."""


class Pending:
    """A request of this end waiting for its reply."""

    __slots__ = ("req", "deadline", "reply", "sink", "cancelled", "failed", "done")

    def __init__(self, req: int, deadline: float, sink: Sink | None) -> None:
        self.req = req
        self.deadline = deadline
        self.reply: bytes | int | None = None  # DONE's payload, or its status (read_small)
        self.sink = sink
        self.cancelled = False
        self.failed = False
        self.done = False
