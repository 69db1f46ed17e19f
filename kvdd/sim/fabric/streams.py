"""Byte streams of a transfer: the runs of a READ/WRITE as socket buffers, and their sending."""

from __future__ import annotations

import ctypes
import socket
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from ..memory import Region, copy_runs
from .rx import SCATTER_BUFFERS, Rx
from .wire import F_DATA, HDR, MAGIC, MAX_DATA, PROTOCOL_VERSION, STAGE_RUN_BYTES, ProtocolError

__all__ = ["region_view", "runs_inside", "Layout", "Cursor", "advance", "gathered_wakeups",
           "sendmsg_all", "send_stream", "RCV_LOWAT", "RECV_BYTES"]

#: Bytes a long DATA payload gathers in the socket before the thread receiving it is woken
#: (``SO_RCVLOWAT``; :meth:`Cursor.recv`).  Without it, every 64 KiB segment that arrives wakes
#: the receiver, which then copies it and sleeps again: the sending process pays each wake-up
#: (on a virtual machine an interrupt to the other CPU) and the receiver a context switch.
RCV_LOWAT = 1 << 20
#: Bytes one ``recvmsg`` of a DATA payload asks for, at most (a 64 MiB run too is received in
#: pieces of this, so that SO_RCVLOWAT is raised for all of it but the last RCV_LOWAT bytes).
RECV_BYTES = 4 << 20

#: ``PyMemoryView_FromMemory``: a writable byte view of memory, made in ~2 us.  (A ctypes array
#: of the region's size made one too, but its type is cached only while a view is alive, so a
#: transfer paid 60-250 us to make the type again.)
_view_of = ctypes.pythonapi.PyMemoryView_FromMemory
_view_of.restype = ctypes.py_object
_view_of.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def region_view(region: Region) -> memoryview:
    """A writable byte view of ``region``'s memory (it does not keep that memory alive: the
    region's registration does)."""
    n = region.nbytes
    if n == 0:
        return memoryview(bytearray(0))
    view: memoryview = _view_of(region.addr, n, _PYBUF_WRITE)
    return view


def runs_inside(off: np.ndarray, length: np.ndarray, size: int) -> bool:
    """Whether every run ``(off[j], length[j])`` (int64, at least one run) lies inside
    ``[0, size)``: reductions, one temporary array (``size - length`` cannot wrap once no
    length is negative, and a length past ``size`` makes it negative, below every offset)."""
    return (int(off.min()) >= 0 and int(length.min()) >= 0
            and not bool((off > size - length).any()))


class Layout:
    """The byte stream of runs ``(off[j], length[j])`` of regions ``k`` (k outer, j inner).

    Long runs are sent from / received into the regions directly (memoryviews); many short runs
    go through one staging buffer and one ``copy_runs`` call (gather before sending, scatter after
    receiving)."""

    def __init__(self, regions: Sequence[Region], off: np.ndarray, length: np.ndarray) -> None:
        self.regions = list(regions)
        self.off = np.ascontiguousarray(off, dtype=np.int64)
        self.length = np.ascontiguousarray(length, dtype=np.int64)
        per_k = int(self.length.sum())
        self.per_k = per_k
        self.total = per_k * len(self.regions)
        runs = len(self.regions) * int(np.count_nonzero(self.length))
        self.staged = 0 < self.total <= MAX_DATA and self.total < STAGE_RUN_BYTES * runs
        self._stage: np.ndarray | None = None
        self._stage_regions: list[Region] = []
        self._runs_off = self._runs_len = array("q")  # the runs, for iter_views (plain ints)
        if self.total and not self.staged:
            off, length = self.off, self.length
            size = min(region.nbytes for region in self.regions)  # (the same runs in each)
            # runs of length 0 are not checked: the exact rule only when the plain one fails
            if not runs_inside(off, length, size) and np.any(
                    (length != 0) & ((off < 0) | (length < 0) | (off > size - length))):
                raise ValueError("run outside its region")
            self._runs_off = array("q", off.tobytes())
            self._runs_len = array("q", length.tobytes())
        if self.staged:
            stage = np.empty(self.total, dtype=np.uint8)
            base = int(stage.ctypes.data)
            self._stage = stage
            self._stage_regions = [Region(base + k * per_k, per_k, stage)
                                   for k in range(len(self.regions))]
            self._cum = np.concatenate(([0], np.cumsum(self.length)[:-1])).astype(np.int64)

    def iter_views(self) -> Iterator[memoryview]:
        """The stream's buffers in order, made as they are asked for (a READ's cursor asks as
        its bytes arrive): the staging buffer, or each run of each region."""
        if self._stage is not None:
            yield self._stage.data.cast("B")
            return
        for region in self.regions:
            mv = region_view(region)
            for o, n in zip(self._runs_off, self._runs_len):
                if n:
                    yield mv[o:o + n]

    @property
    def views(self) -> list[memoryview]:
        """:meth:`iter_views`, all of them."""
        return list(self.iter_views())

    def gather(self) -> None:
        if self.staged:
            copy_runs(self.regions, self._stage_regions, self.off, self._cum, self.length)

    def scatter(self) -> None:
        if self.staged:
            copy_runs(self._stage_regions, self.regions, self._cum, self.off, self.length)


class Cursor:
    """Fills a layout's views from the socket, frame by frame."""

    def __init__(self, layout: Layout) -> None:
        self._views = layout.iter_views()
        self._view = memoryview(b"")  # the rest of the view being filled
        self.left = layout.total

    def recv(self, rx: Rx, n: int) -> None:
        """The next ``n`` bytes of the stream from ``rx``, into the views they belong to
        (:meth:`~.rx.Rx.into_views`, SCATTER_BUFFERS views or RECV_BYTES at a time: receiving
        begins before the views of a long frame are all made).  While at least :data:`RCV_LOWAT` bytes of
        these ``n`` follow the views being filled, the socket wakes the receiving thread only
        once that many have arrived (``SO_RCVLOWAT``, :func:`gathered_wakeups`)."""
        if n > self.left:
            raise ProtocolError("more DATA than the transfer holds")
        view, want = self._view, n
        lowat = RCV_LOWAT
        raised = False
        try:
            while want > 0:
                dst: list[memoryview] = []
                chunk = 0
                while chunk < want and len(dst) < SCATTER_BUFFERS and chunk < RECV_BYTES:
                    if not len(view):
                        view = next(self._views)
                    take = min(want - chunk, len(view), RECV_BYTES - chunk)
                    dst.append(view if take == len(view) else view[:take])
                    view = view[take:]
                    chunk += take
                self._view = view
                # a thread waiting inside recvmsg is woken once SO_RCVLOWAT bytes are queued:
                # only while that many more of this DATA are still to come after these views
                follow = want - chunk >= lowat > 1
                if follow != raised:
                    raised = gathered_wakeups(rx.sock, lowat if follow else 1)
                rx.into_views(dst)
                self.left -= chunk  # counted once received (0 means every byte is in)
                want -= chunk
        finally:
            if raised:
                gathered_wakeups(rx.sock, 1)


def gathered_wakeups(sock: socket.socket, lowat: int) -> bool:
    """``SO_RCVLOWAT`` of ``sock`` set to ``lowat`` bytes (1: every arrival wakes a reader, the
    default, as the fabric's pool expects); whether it is now above 1."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
    except OSError:  # (a socket type without it: every arrival wakes the reader)
        return False
    return lowat > 1


def advance(bufs: list[memoryview], sent: int) -> None:
    """Drop the ``sent`` bytes a gathering send took from the front of ``bufs`` (in place)."""
    while sent and bufs:
        if sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][sent:]
            sent = 0


def sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """sendmsg (gather, zero-copy) until every buffer is sent."""
    while bufs:
        advance(bufs, sock.sendmsg(bufs))


def send_stream(sock: socket.socket, req: int, layout: Layout) -> None:
    """The layout's bytes as DATA frames of at most MAX_DATA bytes, each sent by gathering
    the header and up to 64 views per system call (zero-copy)."""
    left = layout.total
    views = iter(layout.views)
    cur: memoryview | None = None
    while left > 0:
        n = min(left, MAX_DATA)
        batch = [memoryview(HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, n))]
        left -= n
        while n > 0:
            if cur is None or len(cur) == 0:
                cur = next(views)
            take = min(n, len(cur))
            batch.append(cur[:take])
            cur = cur[take:]
            n -= take
            if len(batch) == 64:
                sendmsg_all(sock, batch)
                batch = []
        sendmsg_all(sock, batch)

