"""Shareable cache memory: :func:`empty` (docs/spec/API.md "Memory").

An array from :func:`empty` lives in a sealed ``memfd`` mapped ``MAP_SHARED``.  Registered as a
cache (``kvdd.tensor_addrs(...)``), it lets the simulator's same-host path between processes
copy with plain memory copies through a mapping of the same pages in the peer process, instead
of system calls on the owner's ``/proc/<pid>/mem`` (docs/security.md, "Same-host path").  Memory
from anywhere else works as before.

A process-wide registry maps each live allocation's address range to its memfd (kept open for the
allocation's life): :func:`lookup` finds the allocation behind a registered tensor.  In a process
that has the simulated CANN root's ``libascendcl.so`` loaded globally (a C++ program linked with
``-lascendcl``), :func:`lookup` also finds ``aclrtMalloc`` blocks, which are sealed memfds too
(``kvdd_acl_shared_memory``, kvdd/cann/src/ascendcl.cc).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np
import numpy.typing as npt

__all__ = ["empty", "lookup", "Allocation", "live_allocations", "PAGE"]

#: Alignment of every allocation (bytes): its first element is page-aligned.
PAGE = mmap.PAGESIZE
_SEALS = 0x0002 | 0x0004 | 0x0001  # F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL


@dataclass(frozen=True)
class Allocation:
    """One live allocation of :func:`empty`: ``[addr, addr + size)`` is file ``fd`` (inode
    ``ino``) from offset 0.  ``size`` is the file's size in bytes (the array's, rounded up to
    :data:`PAGE`)."""

    addr: int
    size: int
    fd: int
    ino: int


class _Mapping(mmap.mmap):
    """An mmap that can be weakly referenced (its finalizer drops the registry entry)."""


_lock = threading.Lock()
_starts: list[int] = []  # sorted addresses of live allocations
_by_start: dict[int, Allocation] = {}


def _register(alloc: Allocation) -> None:
    """Enter ``alloc``; it replaces an entry at the same address whose finalizer has not run yet
    (mmap unmaps before it calls the finalizer, without the GIL: the address can be reused)."""
    with _lock:
        if alloc.addr not in _by_start:
            bisect.insort(_starts, alloc.addr)
        _by_start[alloc.addr] = alloc


def _forget(alloc: Allocation) -> None:
    """The finalizer of ``alloc``'s mapping: drop its entry (unless replaced) and close its fd."""
    with _lock:
        if _by_start.get(alloc.addr) is alloc:
            del _by_start[alloc.addr]
            del _starts[bisect.bisect_left(_starts, alloc.addr)]
    os.close(alloc.fd)


def empty(shape: SupportsIndex | tuple[SupportsIndex, ...],
          dtype: npt.DTypeLike = float) -> np.ndarray[Any, np.dtype[Any]]:
    """A new writable C-contiguous array whose memory can be shared with a same-host peer.

    Same meaning as ``numpy.empty(shape, dtype)`` (``order="C"``), except for the memory: a file
    from ``memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)``, ``ftruncate``d to the array's size
    rounded up to :data:`PAGE` bytes, sealed ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` (its
    size never changes, so no mapping of it can fault past its end), mapped ``MAP_SHARED``.  The
    contents start as zeros (tmpfs pages).  The first element is page-aligned.

    Register it (``kvdd.tensor_addrs([a])`` or a view of it per tensor) as usual.  When a cache
    over such memory is served to a linked peer process on the same host (simulator backend),
    that peer maps the same pages and copies with memory copies (docs/security.md, "Same-host
    path"); nothing else changes.

    Parameters
    ----------
    shape : int or tuple of int
        Array shape (elements).
    dtype : numpy dtype-like, default float
        Element type (numpy's, ``ml_dtypes.bfloat16``, ...).

    Returns
    -------
    numpy.ndarray
        Writable, C-contiguous.  Its memory (and the memfd) is released when the last array or
        view using it is freed; the registry entry (:func:`lookup`) goes at the same time.

    Raises
    ------
    ValueError
        A negative dimension, or a dtype numpy cannot allocate (object, void of size 0).
    OSError
        ``memfd_create``, ``ftruncate`` or ``mmap`` failed (ENOMEM, EMFILE, ...).

    Notes
    -----
    ``fork()``: a child shares the pages with its parent (``MAP_SHARED``): a write in one is
    seen by the other, unlike numpy memory.  The child inherits the registry and the fds.
    Memory from this function counts as shared memory (``Shmem`` in ``/proc/meminfo``), within
    the memory cgroup of the process that first touches each page.  Each live allocation holds
    one file descriptor (``RLIMIT_NOFILE``): allocate a cache's tensors as views of one array
    when there are many.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError("kvdd.empty: object arrays cannot live in shared memory")
    dims = tuple(int(d) for d in (shape if isinstance(shape, tuple) else (shape,)))
    if any(d < 0 for d in dims):
        raise ValueError(f"kvdd.empty: negative dimensions are not allowed: {dims}")
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    fd = os.memfd_create("kvdd-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        m = _Mapping(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        raw = np.frombuffer(m, dtype=np.uint8)
        addr = int(raw.ctypes.data)
        alloc = Allocation(addr, size, fd, os.fstat(fd).st_ino)
    except BaseException:
        os.close(fd)
        raise
    _register(alloc)
    weakref.finalize(m, _forget, alloc)  # after the last view of the mapping is gone
    return raw[:nbytes].view(dt).reshape(dims)


_AclLookup = Any  # ctypes function: (addr, *base, *size, *fd, *ino) -> int
_acl_fn: _AclLookup = None
_acl_probed = -1.0  # time.monotonic() of the last probe that found no libascendcl


def _acl_lookup() -> _AclLookup:
    """``kvdd_acl_shared_memory`` of a globally loaded simulated ``libascendcl.so``, or None.  A
    miss is probed again at most once a second (the library may be loaded later)."""
    global _acl_fn, _acl_probed
    if _acl_fn is not None:
        return _acl_fn
    now = time.monotonic()
    if _acl_probed >= 0 and now - _acl_probed < 1.0:
        return None
    fn = getattr(ctypes.CDLL(None), "kvdd_acl_shared_memory", None)
    if fn is None:
        _acl_probed = now
        return None
    u64p = ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_uint64, u64p, u64p, ctypes.POINTER(ctypes.c_int), u64p]
    fn.restype = ctypes.c_int
    _acl_fn = fn
    return fn


def _acl_block(addr: int) -> Allocation | None:
    """The ``aclrtMalloc`` block (a memfd of the simulated ``libascendcl.so``) holding ``addr``."""
    fn = _acl_lookup()
    if fn is None or not 0 <= addr < 1 << 64:
        return None
    base, size, ino, fd = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
    if not fn(addr, ctypes.byref(base), ctypes.byref(size), ctypes.byref(fd), ctypes.byref(ino)):
        return None
    return Allocation(base.value, size.value, fd.value, ino.value)


def lookup(addr: int, nbytes: int) -> tuple[Allocation, int] | None:
    """The allocation of :func:`empty` (or the simulated ``aclrtMalloc`` block) that holds
    ``[addr, addr + nbytes)`` and the offset of ``addr`` in it, or None (other memory, or a
    range past its end)."""
    alloc: Allocation | None = None
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i >= 0:
            alloc = _by_start[_starts[i]]
    if alloc is None or addr - alloc.addr >= alloc.size:
        alloc = _acl_block(addr)
        if alloc is None:
            return None
    off = addr - alloc.addr
    if nbytes < 0 or off + nbytes > alloc.size:
        return None
    return alloc, off


def live_allocations() -> int:
    """How many allocations of :func:`empty` are alive in this process."""
    with _lock:
        return len(_starts)
