"""The receiving side of a link's connection: one buffered reader of frames.

Every byte a link's socket delivers after the handshake goes through one :class:`Rx`, read by
whichever thread leads the connection's receive side at the time (see
:mod:`~kvdd.sim.fabric.channel`).  One ``recv_into`` of up to :data:`RX_BUFFER` bytes usually
holds a small request or a small answer whole (header, payload, the DATA and DONE frames), so a
small call costs one system call to receive.  Big DATA payloads go from the buffer's remainder
straight into their destination and the rest is received into it directly (zero-copy, in chunks
the socket likes).  Memory per connection: the buffer, plus what a frame's checked length allows.
"""

from __future__ import annotations

import socket
from typing import Protocol

from .wire import (HDR, MAGIC, MAX_LEN, PROTOCOL_VERSION, RECV_CHUNK, ProtocolError,
                   check_header)

_HSIZE = HDR.size
_unpack_hdr = HDR.unpack_from
_MAX_LEN = MAX_LEN

__all__ = ["Rx", "RX_BUFFER", "Sink", "Pending", "Goodbye"]

RX_BUFFER = 64 << 10  # bytes buffered per connection


class Rx:
    """Buffered frame reader of one socket (not thread-safe: one reader at a time)."""

    __slots__ = ("sock", "buf", "mv", "pos", "end")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(RX_BUFFER)
        self.mv = memoryview(self.buf)
        self.pos = 0
        self.end = 0

    def _recv(self, dst: memoryview) -> int:
        got = self.sock.recv_into(dst)
        if got == 0:
            raise ConnectionError("connection closed by the peer")
        return got

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return self.end - self.pos

    def _fill(self, need: int) -> None:
        """At least ``need`` (<= RX_BUFFER) bytes buffered, blocking until they arrive."""
        if self.end - self.pos >= need:
            return
        if self.pos:  # keep the unread rest at the start
            n = self.end - self.pos
            self.mv[:n] = self.mv[self.pos:self.end]
            self.pos, self.end = 0, n
        while self.end < need:
            self.end += self._recv(self.mv[self.end:])

    def header(self) -> tuple[int, int, int]:
        """The next frame's ``(type, request id, length)``, checked (:func:`~.wire.check_header`)."""
        if self.end - self.pos < _HSIZE:
            self._fill(_HSIZE)
        pos = self.pos
        magic, version, ftype, req, length = _unpack_hdr(self.buf, pos)
        limit = _MAX_LEN.get(ftype)
        if magic != MAGIC or version != PROTOCOL_VERSION or limit is None or length > limit:
            check_header(self.mv[pos:pos + _HSIZE])  # raises the precise error
            raise ProtocolError("bad frame header")
        self.pos = pos + _HSIZE
        return ftype, req, length

    def exact(self, n: int) -> bytes:
        """The next ``n`` bytes (a payload of a checked length); memory grows with what arrives."""
        if n <= RX_BUFFER:
            if self.end - self.pos < n:
                self._fill(n)
            pos = self.pos
            self.pos = pos + n
            return bytes(self.mv[pos:pos + n])
        out = bytearray(self.mv[self.pos:self.end])
        self.pos = self.end = 0
        while len(out) < n:
            chunk = bytearray(min(n - len(out), 1 << 20))
            self.into(memoryview(chunk))
            out += chunk
        return bytes(out)

    def into(self, dst: memoryview) -> None:
        """The next ``len(dst)`` bytes into ``dst``: what is buffered, then straight from the socket."""
        have = self.end - self.pos
        if have:
            take = min(have, len(dst))
            dst[:take] = self.mv[self.pos:self.pos + take]
            self.pos += take
            dst = dst[take:]
        while len(dst):
            dst = dst[self._recv(dst[:RECV_CHUNK] if len(dst) > RECV_CHUNK else dst):]

    def discard(self, n: int) -> None:
        """Skip the next ``n`` bytes (at most 1 MiB of scratch memory)."""
        have = min(self.end - self.pos, n)
        self.pos += have
        n -= have
        if n:
            scratch = memoryview(bytearray(min(n, 1 << 20)))
            while n > 0:
                take = min(n, len(scratch))
                self.into(scratch[:take])
                n -= take


class Sink(Protocol):
    """Where a READ's DATA goes (:class:`~.streams.Cursor`, :class:`~.small.SmallSink`)."""

    left: int

    def recv(self, rx: Rx, n: int) -> None: ...


class Goodbye(Exception):
    """The peer finalized (GOODBYE): it serves nothing more."""


class Pending:
    """A request of this end waiting for its reply."""

    __slots__ = ("req", "deadline", "reply", "sink", "cancelled", "failed", "done")

    def __init__(self, req: int, deadline: float, sink: Sink | None) -> None:
        self.req = req
        self.deadline = deadline
        self.reply: bytes | None = None
        self.sink = sink
        self.cancelled = False
        self.failed = False
        self.done = False
