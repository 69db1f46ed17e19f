"""Mapped copies for the same-host path: the owner's cache memory, mapped by the proven reader.

Caches registered over memory from :func:`kvdd.empty` (sealed memfds, :mod:`kvdd.shm`) are
copied with kvdd's copy kernels through a mapping of the same pages in the reader, instead of
``pread`` / ``pwrite`` on the owner's ``/proc/<pid>/mem`` (which the kernel copies through a
bounce page, at about half the speed of ``process_vm_readv``).  Identity, leases and deadlines
keep their meaning (:mod:`.samehost_path`).

How the memory is passed
------------------------
The owner, before it hands a link's lease table (:class:`.samehost_path.ServedTable`) to the
proof (``take_fd``), writes one record per served tensor that lives in a :func:`kvdd.empty`
allocation — ``(slot, tensor, fd, offset, inode)``: the owner's fd number of the allocation's
memfd and the tensor's offset in it — into a new memfd, sealed against every change (``F_SEAL_WRITE | SHRINK | GROW | SEAL``), and
announces that file in the table's header (word 3: its fd number + 1, word 4: its inode).

The reader, once the owner is proven (it holds the owner's pidfd from the kernel's ``SCM_PIDFD``),
takes the files it needs out of that very process with ``pidfd_getfd`` (:func:`map_owner`): the
same kernel permission as opening its ``/proc/<pid>/mem``, and the same binding to the attested
process (a pidfd never names a later process that reused the pid).  No message of the proof
changes.  Every value read is untrusted: each file is checked before it is mapped
(:func:`kvdd._native._xproc.shm_check`: tmpfs, a regular file, the announced inode, sealed against
shrinking, so a mapping never faults past the file's end), mapped ``MAP_SHARED`` read-write with
``MADV_DONTFORK``, and its fd closed at once.  A file refused leaves the tensors in it on
``/proc/<pid>/mem``; so does a tensor whose registered bytes do not fit in its file from its
offset (checked at every copy, after the usual checks of every run).  A refused file is closed
on the closer thread (:mod:`.samehost_close`: a FUSE file's close waits for its server; a
memfd holding more than 64 MiB on the unmapper thread), and no file is taken while
``samehost_close.MAX_PENDING`` closes are pending on either; a mapped file's fd is closed at once
(the mapping holds the file: that close frees nothing).

Bounds: the reader takes at most :data:`MAX_RECORDS` records and maps at most
``min(records, MAX_LINK_MAPS)`` distinct files per link (beyond that: none, the link copies
through ``/proc/<pid>/mem``), of at most :data:`MAX_LINK_MAP_BYTES` bytes together (a file that
would pass it is not mapped); and, over all links of the process (a peer can hold up to
``MAX_LINKS`` links to a listener), at most :data:`MAX_PROCESS_MAPS` mappings of
:data:`MAX_PROCESS_MAP_BYTES` bytes together (``vm.max_map_count`` and the address space are the
whole process's: past these a link maps no more and copies through ``/proc/<pid>/mem``), and
:data:`MAX_PROCESS_PLACES` tensor places (a tensor not placed is copied through
``/proc/<pid>/mem``).  The
owner keeps every announced fd open while the table lives.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ... import shm
from . import samehost_close

if TYPE_CHECKING:
    from .protocol import ServedCache

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = ["MAX_LINK_MAPS", "MAX_LINK_MAP_BYTES", "MAX_PROCESS_MAPS", "MAX_PROCESS_MAP_BYTES",
           "MAX_PROCESS_PLACES",
           "MAX_RECORDS", "RECORD", "announce", "map_owner", "ENV_MAPPED"]

#: Distinct files (memfds) a reader maps from one owner per link.
MAX_LINK_MAPS = 1024
#: Bytes a reader maps from one owner per link (address space, not memory: the pages are the
#: owner's; a same-uid peer could exhaust ours by ptrace anyway, but it is bounded all the same).
MAX_LINK_MAP_BYTES = 1 << 40
#: Mappings of peers' memory held by this process over all its links (an eighth of the default
#: ``vm.max_map_count``, 65530: the process's own mmaps must still succeed).
MAX_PROCESS_MAPS = 8192
#: Bytes of peers' memory mapped by this process over all its links (an eighth of a 47-bit
#: address space).
MAX_PROCESS_MAP_BYTES = 16 << 40
#: Tensor places (about 130 bytes each) held by this process over all its links: 2**18 records
#: per link would otherwise hold 40 MiB per link, 10 GiB for MAX_LINKS links.
MAX_PROCESS_PLACES = 1 << 19
#: Records (tensors) a reader reads from one owner's announcement per link.
MAX_RECORDS = 1 << 18
#: One record: slot, tensor, fd, offset, inode (uint64 little-endian each).
RECORD = 5 * 8
#: Environment variable: ``0`` turns the mapped copies off (every copy through /proc/<pid>/mem).
ENV_MAPPED = "KVDD_SIM_XPROC_MAPPED"

_H_ANNOUNCE, _H_INODE = 3, 4  # lease table header words
_IMMUTABLE = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _enabled() -> bool:
    return os.environ.get(ENV_MAPPED, "1").strip() != "0"


def records_of(entries: Sequence[ServedCache]) -> np.ndarray:
    """The owner's records for ``entries`` (slot ``i`` = ``entries[i]``): one row per tensor
    that lies whole in a :func:`kvdd.empty` allocation (an entry that shows no tensor addresses,
    such as a test's stand-in, has none)."""
    rows: list[tuple[int, int, int, int, int]] = []
    for slot, entry in enumerate(entries):
        for t, addr in enumerate(getattr(entry, "addrs", ())):
            found = shm.lookup(addr, entry.T)
            if found is not None:
                alloc, off = found
                rows.append((slot, t, alloc.fd, off, alloc.ino))
    return np.array(rows, dtype="<u8").reshape(-1, 5)


def announce(table: _xproc.LeaseTable, entries: Sequence[ServedCache]) -> int:
    """Owner: write the records of ``entries`` into a sealed memfd announced in ``table``'s
    header; returns its fd (the caller keeps it open while the table lives, then closes it), or
    -1 when no served tensor lives in shareable memory (nothing announced)."""
    if not _enabled():
        return -1
    rows = records_of(entries)
    if rows.shape[0] == 0:
        return -1
    fd = os.memfd_create("kvdd-shm-records", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        data = rows.tobytes()
        os.ftruncate(fd, len(data))
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError("short write of the shared-memory records")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _IMMUTABLE)
        table.store_header(_H_INODE, os.fstat(fd).st_ino)
        table.store_header(_H_ANNOUNCE, fd + 1)
    except OSError:
        os.close(fd)
        raise
    return fd


def _close_taken(fd: int) -> None:
    """Close a file taken from the owner, never waiting for it: a memfd at once, anything else
    (a FUSE file, whose FLUSH the owner need not answer) on the closer thread
    (:mod:`.samehost_close`); the fd is gone whatever ``close`` says, never an exception."""
    samehost_close.close_file(fd)


def _may_take() -> bool:
    """Room to close one more of the owner's files without waiting (:func:`.samehost_close.room`);
    logged when there is none."""
    if samehost_close.room():
        return True
    logger.info("kvdd same-host: %d closes of peers' files are pending (MAX_PENDING): the "
                "owner's files are not taken", samehost_close.pending())
    return False


def _read_records(pidfd: int, table: _xproc.LeaseTable) -> np.ndarray | None:
    """The owner's announcement, checked: a sealed, immutable tmpfs memfd of whole records."""
    assert _xproc is not None
    word, ino = table.load_header(_H_ANNOUNCE), table.load_header(_H_INODE)
    # word 0 names fd -1, which pidfd_getfd refuses (ValueError: None as well, with a log
    # line); word 1 names fd 0, the owner's stdin, never a memfd of kvdd's
    if word == 0:  # mutation: equivalent(skip, 0 -> 1, 0 -> -1): see above
        return None
    if not _may_take():
        return None
    fd = _xproc.pidfd_getfd(pidfd, word - 1)  # (ValueError past the largest fd number)
    try:
        size = _xproc.shm_check(fd, ino)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _IMMUTABLE != _IMMUTABLE:
            raise ValueError(f"the records' file is not sealed against writes (seals {seals:#x})")
        if size % RECORD or size // RECORD > MAX_RECORDS:
            raise ValueError(f"the records' file has {size} bytes (whole records of {RECORD} "
                             f"bytes, at most {MAX_RECORDS})")
        data = os.pread(fd, size, 0)  # all of it: the file cannot shrink (F_SEAL_SHRINK)
    finally:
        _close_taken(fd)
    return np.frombuffer(data, dtype="<u8").reshape(-1, 5)  # (ValueError if it were short)


def _distinct_files(rows: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The distinct ``(fd, inode)`` of ``rows``, sorted, and the position of each row's in that
    list (vectorised: 2**18 records take milliseconds, not half a second of the link's time)."""
    fd, ino = rows[:, 2], rows[:, 4]
    order = np.lexsort((ino, fd))
    sfd, sino = fd[order], ino[order]
    first = np.ones(len(order), bool)
    first[1:] = (sfd[1:] != sfd[:-1]) | (sino[1:] != sino[:-1])
    inverse = np.empty(len(order), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return list(zip(sfd[first].tolist(), sino[first].tolist())), inverse


def map_owner(pidfd: int, table: _xproc.LeaseTable) -> _xproc.PeerMaps | None:
    """Reader: map the memory the owner behind ``pidfd`` announced in ``table``, every file
    checked first; None when nothing is mapped (every copy then goes through /proc/<pid>/mem).
    Never raises for what the owner sent: the reason is logged."""
    assert _xproc is not None
    if not _enabled():
        return None
    try:
        rows = _read_records(pidfd, table)
    except (OSError, ValueError) as exc:
        logger.info("kvdd same-host: the owner's shared memory is not used: %s", exc)
        return None
    # no rows map no file, and an empty PeerMaps is None below
    if rows is None or rows.shape[0] == 0:  # mutation: equivalent(0 -> -1): see above
        return None
    files, inverse = _distinct_files(rows)
    cap = min(rows.shape[0], MAX_LINK_MAPS)
    if len(files) > cap:
        logger.info("kvdd same-host: the owner announced %d memory files (at most %d): not "
                    "mapped", len(files), cap)
        return None
    maps = _xproc.PeerMaps(table.slots)
    file_index = np.full(len(files), -1, np.int64)  # mapping index of each file, or -1
    try:
        for k, (fdnum, ino) in enumerate(files):
            if fdnum > 0x7FFFFFFF:
                continue
            if _xproc.peer_map_totals()[0] >= MAX_PROCESS_MAPS:
                logger.info("kvdd same-host: this process maps %d files of its peers already "
                            "(MAX_PROCESS_MAPS): the rest of this owner's are not mapped",
                            MAX_PROCESS_MAPS)
                break
            if not _may_take():
                break
            try:
                fd = _xproc.pidfd_getfd(pidfd, fdnum)
            except OSError as exc:
                logger.info("kvdd same-host: cannot take the owner's fd %d: %s", fdnum, exc)
                continue
            try:
                file_index[k] = maps.add(fd, ino, MAX_LINK_MAP_BYTES - maps.mapped_bytes,
                                               MAX_PROCESS_MAPS, MAX_PROCESS_MAP_BYTES)
            except ValueError as exc:
                logger.info("kvdd same-host: the owner's fd %d is not mapped: %s", fdnum, exc)
                _close_taken(fd)
            else:
                # a tmpfs file (shm_check) now held by our mapping: this close frees nothing
                # and waits for nothing, so it is never queued (the unmapper may be busy for
                # seconds: one fd per announced file would pile up here meanwhile)
                try:
                    os.close(fd)
                except OSError as exc:  # the fd is gone whatever close says
                    logger.info("kvdd same-host: closing the owner's fd %d: %s", fdnum, exc)
        # a slot's tensors are numbered below its record count: bounded lists
        slot, tensor = rows[:, 0], rows[:, 1]
        ok = slot < table.slots
        per_slot = np.bincount(slot[ok].astype(np.int64), minlength=table.slots)
        ok[ok] = tensor[ok] < per_slot[slot[ok].astype(np.int64)]
        index = file_index[inverse]
        index[~ok] = -1
        maps.place_rows(np.ascontiguousarray(rows), index, MAX_PROCESS_PLACES)
    except BaseException:
        maps.close()
        raise
    if not len(maps):
        maps.close()
        return None
    return maps
