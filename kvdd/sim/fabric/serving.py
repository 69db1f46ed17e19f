"""The owner's side of a peer's READ or WRITE: checked runs streamed, never materialized.

A request names K tensors of one cache and J runs ``(off[j], length[j])``; its byte stream is
tensor k outer, run j inner.  The owner checks every run against the cache (SEMANTICS.md §10 rule
1) and the size of the request (at most ``MAX_RUNS`` tensors x runs, else LLM_PARAM_INVALID and no
byte moved), then walks the stream piece by piece: consecutive short runs are gathered into (or
scattered from) one staging buffer of at most ``STAGE_CHUNK`` bytes by the copy kernels; long runs
(>= ``STAGE_RUN_BYTES``) are sent from / received into the tensor's memory directly, many runs
gathered per system call (``GATHER_BYTES``) in DATA frames of up to ``MAX_DATA`` bytes; a READ
whose runs are all long (blocks) is sent by compiled code
(:class:`~kvdd._native._gather.GatherSender`).  Memory per request is O(STAGE_CHUNK + J) and CPU
per request is proportional to its bytes plus K x (pieces per tensor), whatever the peer asks.
"""

from __future__ import annotations

import socket
import struct
import time
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ..._native._gather import GatherSender
from ...status import S_OK, Status
from .. import faults
from ..memory import Region, copy_runs
from .protocol import LinkOwner, ServedCache
from .rx import Rx, Steps, drive
from .streams import region_view, runs_inside, sendmsg_all
from .wire import (CHAINED_LEASE, F_DATA, F_DONE, HDR, LEASE_GRACE_MS, MAGIC, MAX_DATA,
                   MAX_LEASE_MS, MAX_RUNS, PROTOCOL_VERSION, STAGE_CHUNK, STAGE_RUN_BYTES,
                   ProtocolError, decode_request, frame)

__all__ = ["check_request", "RunPlan", "SMALL_RUNS", "Step", "as_lists", "serve_read",
           "serve_read_steps", "serve_write", "serve_write_steps", "MAX_DISCARD"]

MAX_DISCARD = 1 << 40  # bytes of a refused WRITE read and dropped before the connection is closed

PLAN_SHARE = 64  # stretches of runs planned per step of a pool task (RunPlan._plan_steps)
T = TypeVar("T")
Step = list[memoryview] | GatherSender  # one step of a READ's answer (an empty list: nothing sent)
_Cut = list[Any]  # RunPlan._cut's state: [stream bytes not in a frame, frame bytes left, gathered, list]

GATHER_BYTES = 1 << 20  # bytes of the tensors one step of a READ's answer gathers (one sendmsg)
GATHER_BUFFERS = 64  # buffers one step gathers, headers included (one sendmsg each)
SMALL_RUNS = 256  # a request of at most this many tensors x runs (and STAGE_CHUNK bytes) is sent
#                   as one DATA frame gathered from the tensors (zero-copy, one system call)


def check_request(n_tensors: int, tensor_nbytes: int, tensors: np.ndarray, off: np.ndarray,
                  length: np.ndarray) -> int:
    """LLM_SUCCESS when every run lies inside a tensor of the cache and the request is within
    the bounds; LLM_PARAM_INVALID otherwise (nothing may move then).  ``off`` and ``length``
    are int64 (signed: :func:`~.streams.runs_inside` relies on it)."""
    if len(tensors) * len(length) > MAX_RUNS:
        return Status.LLM_PARAM_INVALID
    t = tensor_nbytes
    # the common small request: plain Python is faster than numpy here (both give the same answer)
    if len(length) <= 16:  # mutation: equivalent(skip, boundary, constant): picks one of two equal checks
        if len(tensors) and int(tensors.max()) >= n_tensors:
            return Status.LLM_PARAM_INVALID
        for o, n in zip(off.tolist(), length.tolist()):
            if o < 0 or n < 0 or n > t or o > t - n:
                return Status.LLM_PARAM_INVALID
        return Status.LLM_SUCCESS
    if (len(tensors) and int(tensors.max()) >= n_tensors) or not runs_inside(off, length, t):
        return Status.LLM_PARAM_INVALID
    return Status.LLM_SUCCESS


class RunPlan:
    """The pieces of one checked request: ``(j0, j1, staged)`` segments of the runs, the same
    for every tensor."""

    def __init__(self, regions: Sequence[Region], tensors: np.ndarray, off: np.ndarray,
                 length: np.ndarray) -> None:
        self.regions = regions  # every tensor of the cache; ``tensors`` index into it
        self.tensors = tensors
        self.off = np.ascontiguousarray(off, dtype=np.int64)
        self.length = np.ascontiguousarray(length, dtype=np.int64)
        self.per_k = int(self.length.sum())
        self.total = self.per_k * len(tensors)
        self.small = (0 < self.total <= STAGE_CHUNK
                      and len(tensors) * len(self.length) <= SMALL_RUNS)
        self._runs_off = array("q", self.off.tobytes())  # the runs again, read per piece (an
        self._runs_len = array("q", self.length.tobytes())  # array's item is a plain int)
        self._seg_a = array("q")  # the segments (RunPlan.segments), once planned
        self._seg_b = array("q")
        self._seg_staged = bytearray()
        self._each_run = False  # every run long: each one a segment (no arrays of them)
        self._stage = np.empty(0, dtype=np.uint8)
        self._stage_region = Region(int(self._stage.ctypes.data), 0, self._stage)

    @property
    def segments(self) -> list[tuple[int, int, bool]]:
        """``(j0, j1, staged)``: runs ``j0..j1-1`` staged together, or one long run alone."""
        if self._each_run:
            return [(j, j + 1, False) for j in range(len(self.length))]
        return [(a, b, bool(st)) for a, b, st in zip(self._seg_a, self._seg_b, self._seg_staged)]

    def _plan_steps(self, tick: T) -> Generator[T, object, None]:
        """The segments and the staging buffer (not needed by a small READ), built a share at a
        time: ``tick`` is yielded after every :data:`PLAN_SHARE` stretches of runs, so that a
        request of many runs is one pool task's step after another, not one long step (a
        blocking driver goes straight on).  Segments are kept in compact arrays (17 bytes each)."""
        length = self.length
        seg_a, seg_b, seg_staged = self._seg_a, self._seg_b, self._seg_staged
        biggest = 0
        if len(length) == 1:
            staged = int(length[0]) < STAGE_RUN_BYTES
            seg_a.append(0)
            seg_b.append(1)
            seg_staged.append(staged)
            biggest = int(length[0]) if staged else 0
        else:
            # consecutive short runs grouped up to STAGE_CHUNK bytes (staged); each long run alone
            j, n = 0, len(length)
            if not n or int(length.min()) >= STAGE_RUN_BYTES:  # every run long (blocks): each
                self._each_run = True  # its own segment, nothing to plan
                return
            csum = np.concatenate(([0], np.cumsum(length)))  # bytes before run j
            longs = np.flatnonzero(length >= STAGE_RUN_BYTES).tolist()
            for i, stop in enumerate((*longs, n)):
                if i % PLAN_SHARE == PLAN_SHARE - 1:
                    yield tick
                if j < stop:  # short runs j..stop-1, split where the staged bytes exceed STAGE_CHUNK
                    nbytes = int(csum[stop] - csum[j])
                    if nbytes <= STAGE_CHUNK:  # one segment (no numpy call per stretch)
                        cuts: list[int] = []
                    else:
                        cum = csum[j + 1:stop + 1] - csum[j]  # the stretch's running total
                        cuts = (np.searchsorted(cum, np.arange(STAGE_CHUNK, nbytes, STAGE_CHUNK),
                                                side="right") + j).tolist()
                    start = j
                    for cut in (*cuts, stop):
                        if cut > start:
                            seg_a.append(start)
                            seg_b.append(cut)
                            seg_staged.append(1)
                            biggest = max(biggest, int(csum[cut] - csum[start]))
                            start = cut
                if stop < n:
                    seg_a.append(stop)
                    seg_b.append(stop + 1)
                    seg_staged.append(0)
                j = stop + 1
        self._stage = np.empty(biggest, dtype=np.uint8)
        self._stage_region = Region(int(self._stage.ctypes.data), biggest, self._stage)

    def _pieces(self, region: Region) -> Iterator[tuple[memoryview, int, int, bool]]:
        mv = region_view(region)
        off, length = self._runs_off, self._runs_len
        if self._each_run:
            for a, (o, n) in enumerate(zip(off, length)):
                yield mv[o:o + n], a, a + 1, False  # (n >= STAGE_RUN_BYTES > 0)
            return
        for a, b, staged in zip(self._seg_a, self._seg_b, self._seg_staged):
            if staged:
                nbytes = int(self.length[a:b].sum())
                if nbytes:
                    yield self._stage.data.cast("B")[:nbytes], a, b, True
            else:
                o, n = off[a], length[a]
                if n:
                    yield mv[o:o + n], a, b, False

    def _stage_copy(self, region: Region, a: int, b: int, gather: bool) -> None:
        lengths = self.length[a:b]
        cum = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        if gather:
            copy_runs([region], [self._stage_region], self.off[a:b], cum, lengths)
        else:
            copy_runs([self._stage_region], [region], cum, self.off[a:b], lengths)

    def send(self, sock: socket.socket, req: int) -> None:
        """The stream as DATA frames, sent (blocking): :meth:`send_steps`."""
        for bufs in as_lists(self.send_steps(req)):
            sendmsg_all(sock, bufs)

    def send_steps(self, req: int, trailer: bytes = b"") -> Iterator[Step]:
        """The stream as DATA frames of MAX_DATA bytes (the last shorter), zero-copy for long
        runs: the buffers of each system call in turn, each gathering up to GATHER_BYTES of the
        tensors in at most GATHER_BUFFERS buffers (each list sent whole before the next is asked
        for: the staging buffer is reused, so a staged piece ends its list).  When every run is
        long (blocks), the whole stream is one :class:`~kvdd._native._gather.GatherSender`,
        which makes the same lists in C and sends them itself.  ``trailer`` (the READ's DONE)
        ends the last list, so the peer gets it in the system call of the last bytes."""
        tail = [memoryview(trailer)] if trailer else []
        if self.small:
            views = [memoryview(HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, self.total))]
            pairs = [(o, n) for o, n in zip(self.off.tolist(), self.length.tolist()) if n]
            for k in self.tensors.tolist():
                mv = region_view(self.regions[k])
                views.extend(mv[o:o + n] for o, n in pairs)
            yield views + tail
            return
        if not self.total:  # no byte to send: no tensor to walk (there may be a million)
            if tail:
                yield tail
            return
        yield from self._plan_steps([])
        if self._each_run:
            yield self.gather_sender(req, trailer)
            return
        st: _Cut = [self.total, 0, 0, []]
        for k in self.tensors.tolist():
            region = self.regions[k]
            for view, a, b, staged in self._pieces(region):
                if staged:
                    self._stage_copy(region, a, b, True)
                yield from self._cut(req, view, st)
                if staged and st[3]:  # sent before the staging buffer is filled again
                    yield st[3]
                    st[2], st[3] = 0, []
        if st[3] or tail:
            yield st[3] + tail

    def gather_sender(self, req: int, trailer: bytes = b"") -> GatherSender:
        """The stream when every run is long, as compiled lists of the rule of :meth:`_cut`:
        the distinct tensors named as Python objects, the stream's K as compact indices (a
        request naming one tensor a million times costs no million objects)."""
        tensors = self.tensors
        named = np.zeros(len(self.regions), dtype=bool)
        named[tensors] = True
        distinct = np.flatnonzero(named)
        which = (np.cumsum(named, dtype=np.int64) - 1).astype(np.uint32)[tensors]
        regions = [self.regions[k] for k in distinct.tolist()]
        return GatherSender([r.addr for r in regions], [r.nbytes for r in regions],
                            self._runs_off, self._runs_len,
                            HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, 0), MAX_DATA,
                            GATHER_BYTES, GATHER_BUFFERS, regions, which, trailer)

    def _cut(self, req: int, view: memoryview, st: _Cut) -> Iterator[list[memoryview]]:
        """One piece into the lists (``st``: the stream's bytes not yet in a frame, the current
        frame's bytes left, the tensors' bytes gathered in the open list, that list; updated): a
        DATA header where a frame begins (MAX_DATA bytes, the last shorter), the piece cut where
        a frame or a list ends, each list yielded once it holds GATHER_BYTES of the tensors or a
        header and a buffer more would make it longer than GATHER_BUFFERS."""
        stream, frame_left, gathered, bufs = st
        pos, n = 0, len(view)
        while pos < n:
            if not frame_left:
                frame_left = min(stream, MAX_DATA)
                stream -= frame_left
                bufs.append(memoryview(HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, frame_left)))
            take = min(n - pos, frame_left, GATHER_BYTES - gathered)
            bufs.append(view if take == n else view[pos:pos + take])
            pos += take
            frame_left -= take
            gathered += take
            if gathered >= GATHER_BYTES or len(bufs) >= GATHER_BUFFERS - 1:
                yield bufs
                bufs, gathered = [], 0
        st[:] = stream, frame_left, gathered, bufs

    def receive(self, rx: Rx, req: int) -> None:
        """The stream from the peer's DATA frames into the tensors (blocking): :meth:`receive_steps`."""
        drive(self.receive_steps(rx, req))

    def receive_steps(self, rx: Rx, req: int) -> Steps[None]:
        """The stream from the peer's DATA frames (any sizes) into the tensors, read as far as
        its bytes have arrived (:data:`~.rx.Steps`)."""
        left = 0  # bytes of the current DATA frame not yet received
        if not self.total:  # no byte to receive: no tensor to walk (there may be a million)
            return
        yield from self._plan_steps(0)
        for k in self.tensors.tolist():
            region = self.regions[k]
            for view, a, b, staged in self._pieces(region):
                pos = 0
                while pos < len(view):
                    if left == 0:
                        yield HDR.size
                        ftype, freq, left = rx.header()
                        if ftype != F_DATA or freq != req or left == 0:  # (an empty DATA
                            raise ProtocolError("WRITE data expected")  # only spins the reader)
                        continue
                    avail = yield 1
                    take = min(left, len(view) - pos, avail)
                    rx.into(view[pos:pos + take])
                    pos += take
                    left -= take
                if staged:
                    self._stage_copy(region, a, b, False)
        if left:
            raise ProtocolError("more DATA than the WRITE holds")


class RunChecker(Protocol):
    """The lease checks of a READ / WRITE (:class:`~.leases.LeaseTable`)."""

    def check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                   length: np.ndarray) -> tuple[int, UsedLease | None]: ...

    def chained(self, req: int) -> int: ...


class UsedLease(Protocol):
    """A lease in use by one server thread (:class:`~.leases.Lease`)."""

    on_served: Callable[[list[int]], None] | None

    @property
    def entry(self) -> ServedCache: ...

    def unuse(self) -> None: ...


def serve_write(leases: RunChecker, owner: LinkOwner, rx: Rx, req: int, payload: bytes) -> int:
    """:func:`serve_write_steps`, blocking."""
    return drive(serve_write_steps(leases, owner, rx, req, payload))


def serve_write_steps(leases: RunChecker, owner: LinkOwner, rx: Rx, req: int,
                      payload: bytes) -> Steps[int]:
    """A WRITE and its DATA frames, received straight into the owner's cache as far as they have
    arrived (:data:`~.rx.Steps`); the status for its DONE.

    A WRITE refused for its lease (revoked, expired) has its DATA discarded and is answered with
    the status; one refused for its runs or size ends the connection (ProtocolError: a correct
    peer never sends one, its engine ran the same checks)."""
    lease_id, tensors, off, length = decode_request(payload)
    status, lease = leases.check_runs(lease_id, tensors, off, length)
    if lease is None:
        if status == Status.LLM_PARAM_INVALID or (length < 0).any():
            raise ProtocolError(f"refused WRITE (status {status:#x})")
        total = int(length.sum()) * len(tensors)
        if total > MAX_DISCARD:
            raise ProtocolError("refused WRITE of too many bytes")
        # the peer sends the data anyway: read it into nothing, within the time a lease
        # would have had (the longest an owner honours, and its grace)
        deadline = time.monotonic() + (MAX_LEASE_MS + LEASE_GRACE_MS) / 1000
        while total > 0:
            yield HDR.size
            ftype, freq, n = rx.header()
            if ftype != F_DATA or freq != req or n > total or n == 0:
                raise ProtocolError("WRITE data expected")
            if time.monotonic() > deadline:
                raise ProtocolError("the data of a refused WRITE outlived a lease")
            total -= n
            while n > 0:
                avail = yield 1
                take = min(n, avail)
                rx.discard(take)
                n -= take
        return status
    try:
        plan = RunPlan(lease.entry.regions, tensors, off, length)
        faults.on_serve(owner, "write", plan.total)
        yield from plan.receive_steps(rx, req)
    finally:
        lease.unuse()
    return status


def serve_read(leases: RunChecker, owner: LinkOwner, sock: socket.socket, req: int,
               payload: bytes | bytearray) -> None:
    """:func:`serve_read_steps`, sent (blocking; call with the connection's send lock held)."""
    for bufs in as_lists(serve_read_steps(leases, owner, req, payload)):
        sendmsg_all(sock, bufs)


def as_lists(steps: Iterable[Step]) -> Iterator[list[memoryview]]:
    """The lists of buffers of a READ's steps, a :class:`GatherSender`'s made in Python, planning
    steps (empty lists) left out: for a blocking sender, and tests."""
    for step in steps:
        if isinstance(step, GatherSender):
            yield from step.lists()
        elif step:
            yield step


def serve_read_steps(leases: RunChecker, owner: LinkOwner, req: int,
                     payload: bytes | bytearray) -> Generator[Step, None, None]:
    """A READ: its DATA frames and DONE, or DONE with the refusal, as the buffers of each system
    call in turn (each list sent whole before the next is asked for; the lease is held until
    the last is).  The sender holds the connection's send lock meanwhile."""
    lease_id, tensors, off, length = decode_request(payload)
    if lease_id & CHAINED_LEASE:  # the lease its LEASE request got (none: refused, answered)
        named = lease_id >> 32 == CHAINED_LEASE >> 32
        lease_id = leases.chained(lease_id & 0xFFFFFFFF) if named else 0
    status, lease = leases.check_runs(lease_id, tensors, off, length)
    if lease is None:
        yield [memoryview(frame(F_DONE, req, struct.pack("<I", status)))]
        return
    try:
        plan = RunPlan(lease.entry.regions, tensors, off, length)
        faults.on_serve(owner, "read", plan.total)
        done = frame(F_DONE, req, struct.pack("<I", S_OK))
        served, lease.on_served = lease.on_served, None
        if served is None:  # DONE goes with the last DATA
            yield from plan.send_steps(req, done)
            return
        yield from plan.send_steps(req)
        served(tensors.tolist())  # the owner's action before DONE (a two-sided pull's key)
        yield [memoryview(done)]
    finally:
        lease.unuse()
