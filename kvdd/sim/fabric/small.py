"""Small transfers in one request: LEASE_READ / LEASE_WRITE (SEMANTICS.md §10 rules 1, 2, 5).

A transfer of at most ``SMALL_BYTES`` in at most ``SMALL_MAX_RUNS`` tensors x runs names the cache
instead of a lease.  The owner serves it on the connection's receiving thread with the checks and
statuses of LEASE then READ / WRITE (``grant`` = the lease checks, which acquire the cache entry),
and holds the cache only around the copy out of (into) it: that lease covers exactly this one
transfer.  A LEASE_WRITE's bytes are staged first, so a peer that stalls its DATA holds no cache.

The requests are parsed into plain integers (a few runs: no arrays), every run is checked against
the cache's tensor size *and* the registered region before the first byte is copied, and the bytes
move by ``ctypes`` copies of exactly the checked ranges.  :class:`SmallSink` is the reader's side:
the answer's DATA lands in a staging buffer and reaches the caller's memory only once DONE says
LLM_SUCCESS (a caller that gave up never has its memory written).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence

import numpy as np

from ..._native._small import read_answer
from ...status import PARAM_INVALID, S_OK
from .. import faults
from ..memory import Region
from .protocol import LinkOwner, ServedCache
from .rx import Rx, Steps, drive
from .wire import (F_DATA, F_DONE, HDR, MAGIC, PROTOCOL_VERSION, REQ, SMALL_BYTES, SMALL_MAX_RUNS,
                   ProtocolError)

__all__ = ["Grant", "SmallRequest", "decode_small", "encode_one_run", "encode_small", "serve_small_read",
           "serve_small_write", "serve_small_write_steps", "SmallSink", "is_small"]

#: The lease checks of a small request: ``(status, entry)``, the entry acquired when S_OK.
Grant = Callable[[int], tuple[int, ServedCache | None]]
_DONE = struct.Struct("<2sBBIII")  # a DONE frame: header + status
assert S_OK == 0  # read_answer's DONE carries status 0
_ONE_RUN = struct.Struct("<QIIIqq")  # a LEASE_READ payload of one tensor and one run
assert _ONE_RUN.size == REQ.size + 4 + 16
#: ctypes' own string_at without its Python wrapper frame (the wrapper when that is missing)
_string_at: Callable[[int, int], bytes] = getattr(ctypes, "_string_at", ctypes.string_at)
_memmove = ctypes.memmove
_RUNS: dict[tuple[int, int], struct.Struct] = {}  # the layouts seen, 0 < k x j <= SMALL_MAX_RUNS


def _runs(k: int, j: int) -> struct.Struct:
    """The layout of k tensors and j runs (kept when 0 < k x j <= SMALL_MAX_RUNS: bounded)."""
    layout = _RUNS.get((k, j))
    if layout is None:
        layout = struct.Struct(f"<{k}I{j}q{j}q")
        if 0 < k * j <= SMALL_MAX_RUNS:
            _RUNS[(k, j)] = layout
    return layout


def is_small(n_tensors: int, length: np.ndarray) -> bool:
    """Whether a transfer goes as one LEASE_READ / LEASE_WRITE (the lengths are read only when
    the runs are few enough: a block list of more is not small)."""
    return (n_tensors * len(length) <= SMALL_MAX_RUNS
            and sum(n for n in length.tolist() if n > 0) * n_tensors <= SMALL_BYTES)


def encode_one_run(cache_id: int, tensor: int, off: int, length: int) -> bytes:
    """The LEASE_READ / LEASE_WRITE payload of one tensor and one run."""
    return _ONE_RUN.pack(cache_id, 1, 1, tensor, off, length)


def encode_small(cache_id: int, tensors: Sequence[int], off: Sequence[int],
                 length: Sequence[int]) -> bytes:
    """A LEASE_READ / LEASE_WRITE payload (the layout of :func:`~.wire.encode_request`)."""
    k, j = len(tensors), len(length)
    if k == 1 and j == 1:  # most small transfers: one struct, no layout lookup
        return _ONE_RUN.pack(cache_id, 1, 1, tensors[0], off[0], length[0])
    if k * j > SMALL_MAX_RUNS:
        raise ValueError(f"not a small transfer: {k} x {j} runs")
    return REQ.pack(cache_id, k, j) + _runs(k, j).pack(*tensors, *off, *length)


class SmallRequest:
    """A parsed small request: the cache, its tensors, runs and total bytes."""

    __slots__ = ("cache_id", "tensors", "off", "length", "total")

    def __init__(self, cache_id: int, tensors: tuple[int, ...], off: tuple[int, ...],
                 length: tuple[int, ...], total: int) -> None:
        self.cache_id = cache_id
        self.tensors = tensors
        self.off = off
        self.length = length
        self.total = total

    def check(self, entry: ServedCache) -> int:
        """LLM_SUCCESS when every tensor exists and every run lies inside the tensor's size and
        its registered region (kvdd rule 1); LLM_PARAM_INVALID otherwise (nothing moves then)."""
        regions = entry.regions
        if self.tensors and max(self.tensors) >= min(entry.n, len(regions)):
            return PARAM_INVALID
        t = entry.T
        for k in set(self.tensors):
            t = min(t, regions[k].nbytes)
        for o, n in zip(self.off, self.length):
            if o < 0 or n < 0 or n > t or o > t - n:
                return PARAM_INVALID
        return S_OK


def decode_small(payload: bytes) -> SmallRequest:
    """A LEASE_READ / LEASE_WRITE payload; ProtocolError when malformed, beyond SMALL_MAX_RUNS
    tensors x runs or SMALL_BYTES (a correct peer sends those as LEASE + READ / WRITE)."""
    if len(payload) < REQ.size:
        raise ProtocolError("truncated payload")
    cache_id, k, j = REQ.unpack_from(payload)
    if len(payload) != REQ.size + 4 * k + 16 * j:
        raise ProtocolError("truncated payload" if len(payload) < REQ.size + 4 * k + 16 * j
                            else "trailing bytes in payload")
    if k * j > SMALL_MAX_RUNS:
        raise ProtocolError(f"a small request of {k} x {j} runs")
    values = _runs(k, j).unpack_from(payload, REQ.size)
    length = values[k + j:]
    total = sum(n for n in length if n > 0) * k
    if total > SMALL_BYTES:
        raise ProtocolError(f"a small request of {total} bytes")
    return SmallRequest(cache_id, values[:k], values[k:k + j], length, total)


def _done(req: int, status: int) -> bytes:
    return _DONE.pack(MAGIC, PROTOCOL_VERSION, F_DONE, req, 4, status)


def _serve_one_run(owner: LinkOwner, grant: Grant, req: int, cache_id: int, k: int, o: int,
                   n: int) -> bytes:
    """A LEASE_READ of one tensor and one run (most small reads): :func:`serve_small_read`'s
    checks and answer, in the same order, without the general parse.  Its compiled twin
    :func:`kvdd._native._small.serve_one_run` serves these on the connection's reader while no
    fault injection is armed (the same checks, statuses and order; keep the two in step)."""
    total = n if n > 0 else 0
    if total > SMALL_BYTES:
        raise ProtocolError(f"a small request of {total} bytes")
    faults.on_serve(owner, "lease")
    status, entry = grant(cache_id)
    if entry is None:
        return _done(req, status)
    try:
        regions = entry.regions
        if k >= min(entry.n, len(regions)):
            return _done(req, PARAM_INVALID)
        t = min(entry.T, regions[k].nbytes)
        if o < 0 or n < 0 or n > t or o > t - n:
            return _done(req, PARAM_INVALID)
        faults.on_serve(owner, "read", total)
        if not total:
            return _done(req, S_OK)
        return read_answer(req, regions[k].addr + o, total, MAGIC, PROTOCOL_VERSION)
    finally:
        entry.release()


def serve_small_read(owner: LinkOwner, grant: Grant, req: int, payload: bytes) -> bytes:
    """A LEASE_READ: the checks of LEASE and READ, then its DATA and DONE in one buffer copied
    out while the cache is held (the lease covers exactly this copy)."""
    if len(payload) == _ONE_RUN.size:
        cache_id, k, j, t, o, n = _ONE_RUN.unpack(payload)
        if k == 1 and j == 1:
            return _serve_one_run(owner, grant, req, cache_id, t, o, n)
    r = decode_small(payload)
    faults.on_serve(owner, "lease")
    status, entry = grant(r.cache_id)
    if entry is None:
        return _done(req, status)
    try:
        status = r.check(entry)
        if status != S_OK:
            return _done(req, status)
        faults.on_serve(owner, "read", r.total)
        if not r.total:
            return _done(req, S_OK)
        parts = [HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, r.total)]
        pairs = [(o, n) for o, n in zip(r.off, r.length) if n]
        regions = entry.regions
        for k in r.tensors:
            base = regions[k].addr
            parts.extend([_string_at(base + o, n) for o, n in pairs])
        parts.append(_done(req, S_OK))
        return b"".join(parts)
    finally:
        entry.release()


def serve_small_write(owner: LinkOwner, grant: Grant, rx: Rx, req: int, payload: bytes) -> bytes:
    """:func:`serve_small_write_steps`, blocking."""
    return drive(serve_small_write_steps(owner, grant, rx, req, payload))


def serve_small_write_steps(owner: LinkOwner, grant: Grant, rx: Rx, req: int,
                            payload: bytes) -> Steps[bytes]:
    """A LEASE_WRITE and its DATA (staged first, as far as it has arrived: a stalled peer holds
    no cache; :data:`~.rx.Steps`): the checks of LEASE and WRITE, the copy into the cache while
    it is held; the DONE frame.  Runs outside the cache end the connection, as for a WRITE."""
    r = decode_small(payload)
    if any(n < 0 for n in r.length):
        raise ProtocolError("refused LEASE_WRITE (negative length)")
    stage = bytearray(r.total)
    mv = memoryview(stage)
    pos = 0
    while pos < r.total:
        yield HDR.size
        ftype, freq, n = rx.header()
        if ftype != F_DATA or freq != req or n > r.total - pos or n == 0:  # (an empty DATA
            raise ProtocolError("WRITE data expected")  # only spins the reader)
        end = pos + n
        while pos < end:
            avail = yield 1
            take = min(end - pos, avail)
            rx.into(mv[pos:pos + take])
            pos += take
    faults.on_serve(owner, "lease")
    status, entry = grant(r.cache_id)
    if entry is not None:
        try:
            status = r.check(entry)
            if status != S_OK:
                raise ProtocolError(f"refused LEASE_WRITE (status {status:#x})")
            faults.on_serve(owner, "write", r.total)
            data = bytes(stage)
            pos = 0
            regions = entry.regions
            for k in r.tensors:
                base = regions[k].addr
                for o, n in zip(r.off, r.length):
                    if n:
                        _memmove(base + o, data[pos:pos + n], n)
                        pos += n
        finally:
            entry.release()
    return _done(req, status)


class SmallSink:
    """Where a small READ's answer lands: DATA staged (``recv``: the payloads as bytes, at most
    the transfer's total), then copied into the caller's runs (``scatter``) only after DONE said
    LLM_SUCCESS.  No ctypes object per call: ``memmove`` takes the staged bytes as its source."""

    __slots__ = ("regions", "off", "length", "parts", "left")

    def __init__(self, regions: Sequence[Region], off: Sequence[int],
                 length: Sequence[int]) -> None:
        self.regions = regions
        self.off = off
        self.length = length
        self.parts: list[bytes] = []
        self.left = sum(length) * len(regions)
        for region in regions:  # the caller's own checked runs; kept honest here too
            for o, n in zip(off, length):
                if o < 0 or n < 0 or o + n > region.nbytes:
                    raise ValueError("run outside its region")

    def recv(self, rx: Rx, n: int) -> None:
        if n > self.left:
            raise ProtocolError("more DATA than the transfer holds")
        self.parts.append(rx.exact(n))  # n <= the total <= SMALL_BYTES: one buffered copy
        self.left -= n

    def scatter(self) -> None:
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(self.regions) == 1 and len(self.length) == 1:  # one run: no slicing
            n = self.length[0]
            if n:
                _memmove(self.regions[0].addr + self.off[0], data, n)
            return
        pos = 0
        for region in self.regions:
            base = region.addr
            for o, n in zip(self.off, self.length):
                if n:
                    _memmove(base + o, data[pos:pos + n], n)
                    pos += n
