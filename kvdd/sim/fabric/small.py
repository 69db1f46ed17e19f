"""Small transfers in one request: the owner's side of LEASE_READ / LEASE_WRITE (SEMANTICS.md
§10 rules 1, 2, 5).

A transfer of at most ``SMALL_BYTES`` in at most ``SMALL_MAX_RUNS`` tensors x runs names the cache
instead of a lease; the connection's reader thread serves it inline with the checks and statuses
of LEASE then READ / WRITE (``grant`` = the lease checks, which acquire the cache entry), and holds
the cache only around the copy out of (into) it: that lease covers exactly this one transfer.  A
LEASE_WRITE's bytes are staged first, so a peer that stalls its DATA holds no cache.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Sequence

import numpy as np

from ...status import S_OK
from .. import faults
from ..memory import Region
from .protocol import LinkOwner, ServedCache
from .serving import HeaderReader, check_request
from .streams import region_view
from .wire import (F_DATA, F_DONE, HDR, MAGIC, PROTOCOL_VERSION, SMALL_BYTES, SMALL_MAX_RUNS,
                   ProtocolError, decode_request, frame, read_header, recv_into)

__all__ = ["Grant", "serve_small_read", "serve_small_write", "small_total", "gather_small",
           "receive_small", "scatter_small"]

#: The lease checks of a small request: ``(status, entry)``, the entry acquired when S_OK.
Grant = Callable[[int], tuple[int, ServedCache | None]]


def serve_small_read(owner: LinkOwner, grant: Grant, req: int,
                     payload: bytes | bytearray) -> bytes:
    """A LEASE_READ: the checks of LEASE and READ, then its DATA and DONE in one buffer
    copied out while the cache is held (the lease covers exactly this copy)."""
    cache_id, tensors, off, length = decode_request(payload)
    total = small_total(tensors, length)
    faults.on_serve(owner, "lease")
    status, entry = grant(cache_id)
    if entry is None:
        return frame(F_DONE, req, struct.pack("<I", status))
    try:
        status = check_request(entry.n, entry.T, tensors, off, length)
        if status != S_OK:
            return frame(F_DONE, req, struct.pack("<I", status))
        faults.on_serve(owner, "read", total)
        return gather_small(entry.regions, tensors, off, length, total, req,
                            frame(F_DONE, req, struct.pack("<I", S_OK)))
    finally:
        entry.release()


def serve_small_write(owner: LinkOwner, grant: Grant, sock: socket.socket, req: int,
                      payload: bytes | bytearray) -> bytes:
    """A LEASE_WRITE and its DATA (staged first, so a stalled peer holds no cache): the
    checks of LEASE and WRITE, the copy into the cache while it is held; the DONE frame.
    Runs outside the cache end the connection, as for a WRITE."""
    cache_id, tensors, off, length = decode_request(payload)
    total = small_total(tensors, length)
    if np.any(length < 0):
        raise ProtocolError("refused LEASE_WRITE (negative length)")
    stage = receive_small(sock, req, total, read_header)
    faults.on_serve(owner, "lease")
    status, entry = grant(cache_id)
    if entry is not None:
        try:
            status = check_request(entry.n, entry.T, tensors, off, length)
            if status != S_OK:
                raise ProtocolError(f"refused LEASE_WRITE (status {status:#x})")
            faults.on_serve(owner, "write", total)
            scatter_small(entry.regions, tensors, off, length, stage)
        finally:
            entry.release()
    return frame(F_DONE, req, struct.pack("<I", status))


def small_total(tensors: np.ndarray, length: np.ndarray) -> int:
    """The bytes of a LEASE_READ / LEASE_WRITE; ProtocolError beyond SMALL_MAX_RUNS tensors x runs
    or SMALL_BYTES (a correct peer sends those as LEASE + READ / WRITE instead)."""
    if len(tensors) * len(length) > SMALL_MAX_RUNS:
        raise ProtocolError(f"a small request of {len(tensors)} x {len(length)} runs")
    total = sum(n for n in length.tolist() if n > 0) * len(tensors)
    if total > SMALL_BYTES:
        raise ProtocolError(f"a small request of {total} bytes")
    return int(total)


def gather_small(regions: Sequence[Region], tensors: np.ndarray, off: np.ndarray,
                 length: np.ndarray, total: int, req: int, tail: bytes) -> bytes:
    """A checked small READ's answer in one buffer: its DATA frame (none for 0 bytes), then
    ``tail`` (the DONE frame).  Copies out of the cache: the caller holds the lease meanwhile."""
    parts: list[bytes | memoryview] = []
    if total:
        parts.append(HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, total))
        pairs = [(o, n) for o, n in zip(off.tolist(), length.tolist()) if n]
        for k in tensors.tolist():
            mv = region_view(regions[k])
            parts.extend(mv[o:o + n] for o, n in pairs)
    parts.append(tail)
    return b"".join(parts)


def receive_small(sock: socket.socket, req: int, total: int,
                  read_header: HeaderReader) -> bytearray:
    """A small WRITE's DATA frames (exactly ``total`` bytes) into a staging buffer."""
    stage = bytearray(total)
    mv = memoryview(stage)
    pos = 0
    while pos < total:
        ftype, freq, n = read_header(sock)
        if ftype != F_DATA or freq != req or n > total - pos:
            raise ProtocolError("WRITE data expected")
        recv_into(sock, mv[pos:pos + n])
        pos += n
    return stage


def scatter_small(regions: Sequence[Region], tensors: np.ndarray, off: np.ndarray,
                  length: np.ndarray, stage: bytearray) -> None:
    """A checked small WRITE's staged bytes into the cache (the caller holds the lease)."""
    src = memoryview(stage)
    pairs = [(o, n) for o, n in zip(off.tolist(), length.tolist()) if n]
    pos = 0
    for k in tensors.tolist():
        mv = region_view(regions[k])
        for o, n in pairs:
            mv[o:o + n] = src[pos:pos + n]
            pos += n
