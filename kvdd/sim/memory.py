"""Host memory of the simulator: registered regions and the checks every copy relies on.

A registered cache tensor becomes a :class:`kvdd._native._copy.Region` (address, size, keep-alive
owner).  Copies only ever run between Regions, and the copy kernels re-check every run against
the Regions' bounds, so no byte outside a registered tensor is touched (SEMANTICS.md §10 rule 1).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import struct
import threading
from collections.abc import Sequence

try:
    from .._native._copy import Region, RegionTable, copy_runs
except ImportError as _exc:  # pragma: no cover - depends on how kvdd was started
    import os as _os

    raise ImportError(
        f"kvdd's compiled copy kernels are missing ({_exc}). kvdd is being imported from "
        f"{_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))}: if that is a source "
        "checkout, Python found it before the installed package (the current directory comes "
        "first on sys.path for `python script.py` and `python -m`); run from another directory, "
        "use the `kvdd` command, or install in editable mode (docs/development.md: pip install "
        "meson-python meson ninja cython numpy ml_dtypes, then pip install --no-build-isolation -e .)."
    ) from _exc

__all__ = ["Region", "RegionTable", "copy_runs", "first_inaccessible"]

def _read_rw_spans() -> tuple[list[int], list[int]]:
    # /proc/self/maps as sorted, merged [start, end) spans of readable+writable memory.
    starts: list[int] = []
    ends: list[int] = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(None, 2)
            if len(fields) < 2 or not fields[1].startswith(b"rw"):
                continue
            lo_s, hi_s = fields[0].split(b"-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if ends and ends[-1] == lo:
                ends[-1] = hi
            else:
                starts.append(lo)
                ends.append(hi)
    return starts, ends


# PROCMAP_QUERY (Linux >= 6.11): ioctl on /proc/<pid>/maps answering for the VMA that covers an
# address; struct procmap_query is 104 bytes (include/uapi/linux/fs.h).
_PROCMAP_QUERY = 0xC0686611  # _IOWR('f', 17, struct procmap_query)
_QUERY = struct.Struct("<QQQQQQQQQIIIIQQ")
_RW = 0x3  # PROCMAP_QUERY_VMA_READABLE | PROCMAP_QUERY_VMA_WRITABLE
_maps_fd: tuple[int, int] | None = None  # (pid, fd of /proc/self/maps): reopened after fork
_maps_lock = threading.Lock()


def _maps() -> int | None:
    """This process's ``/proc/self/maps`` fd, when it answers PROCMAP_QUERY (else None)."""
    global _maps_fd
    with _maps_lock:
        pid = os.getpid()
        if _maps_fd is not None and _maps_fd[0] == pid:
            return _maps_fd[1] if _maps_fd[1] >= 0 else None
        fd = -1
        try:
            fd = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
            _vma(fd, id(_maps_lock))  # a live object's address: answered on kernels that can
        except OSError:
            if fd >= 0:
                os.close(fd)
            fd = -1
        _maps_fd = (pid, fd)
        return fd if fd >= 0 else None


def _vma(fd: int, addr: int) -> tuple[int, int, int] | None:
    """``(start, end, flags)`` of the VMA covering ``addr`` (None: not mapped).  OSError when the
    kernel does not answer PROCMAP_QUERY."""
    buf = bytearray(_QUERY.pack(_QUERY.size, 0, addr, *([0] * 12)))
    try:
        fcntl.ioctl(fd, _PROCMAP_QUERY, buf)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    f = _QUERY.unpack(buf)
    return f[3], f[4], f[5]


def _covered_rw(fd: int, addr: int, end: int, known: list[tuple[int, int]]) -> bool:
    """``[addr, end)`` lies in readable+writable VMAs (asked afresh; ``known`` collects the
    spans this call found, so tensors in one arena cost one query)."""
    for lo, hi in known:
        if lo <= addr and end <= hi:
            return True
    at = addr
    while at < end:
        vma = _vma(fd, at)
        if vma is None or vma[2] & _RW != _RW or not vma[0] <= at < vma[1]:
            return False
        known.append((vma[0], vma[1]))
        at = vma[1]
    return True


def first_inaccessible(addrs: Sequence[int], nbytes: int) -> int:
    """Index of the first ``[addr, addr + nbytes)`` in ``addrs`` that is not readable and writable
    memory of this process, or -1 when all are.

    Used at registration (SEMANTICS.md §10 rule 4).  The kernel is asked afresh on every call,
    so memory unmapped since an earlier check is never accepted: with ``PROCMAP_QUERY`` (Linux >=
    6.11; a few microseconds per VMA: tensors in one arena cost one query), else by reading
    ``/proc/self/maps`` whole (hundreds of microseconds).  Each distinct address is checked once.
    On systems without ``/proc`` every non-null range is accepted.
    """
    fd = _maps()
    if fd is not None:
        known: list[tuple[int, int]] = []
        lo = hi = 0  # the last readable+writable span found: most tensors lie in it
        try:
            for i, addr in enumerate(addrs):
                end = addr + nbytes
                if lo <= addr and end <= hi and addr > 0 and nbytes > 0:
                    continue
                if nbytes <= 0 or addr <= 0 or end > 2**64:
                    return i
                if not _covered_rw(fd, addr, end, known):
                    return i
                if known:
                    lo, hi = known[-1]
                    if not lo <= addr:  # the range spans several VMAs: keep checking each
                        lo = hi = 0
            return -1
        except OSError:
            pass  # fall back to the whole map
    spans: tuple[list[int], list[int]] | None
    try:
        spans = _read_rw_spans()
    except OSError:
        spans = None
    seen = set()
    for i, addr in enumerate(addrs):
        if addr in seen:
            continue
        if nbytes <= 0 or addr <= 0 or addr + nbytes > 2**64:
            return i
        if spans is not None:
            j = bisect.bisect_right(spans[0], addr) - 1
            if j < 0 or spans[1][j] < addr + nbytes:
                return i
        seen.add(addr)
    return -1
