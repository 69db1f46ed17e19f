"""The one-sided same-host data path: a per-link lease table in shared memory + the peer's
``/proc/<pid>/mem``.

No per-call message reaches the owner (like RDMA on hardware, the owner's CPU is not needed, so a
stopped but living owner's memory is still read: SEMANTICS.md §10 rules 2 and 9).  Rule 5 holds
through the lease table of each link (:class:`~kvdd._native._xproc.LeaseTable`, one 64-byte slot
per cache the owner serves over the link, slot ``i`` = the ``i``-th cache of the owner's snapshot):

* reader (:class:`OneSidedPeer`): ``enter(slot)`` (in-flight += 1, then read the slot's and the
  link's state word; nonzero: no copy, the count undone), copy with ``pread`` / ``pwrite`` on the
  peer's ``/proc/<pid>/mem`` (opened once after the proof and bound to the attested address space:
  a reused pid is never reached; a page the peer froze with a userfaultfd fails at once instead
  of holding the call), at most PVM_CHUNK bytes per system call, the reader's own deadline and the
  owner's abort checked before each, then ``leave(slot)``.  Caches in :func:`kvdd.empty` memory
  are copied with kvdd's copy kernels through the reader's mapping of the owner's memfds
  (:mod:`.samehost_shm`), at most PVM_CHUNK bytes per kernel call, the same checks before each.  A lease covers one transfer and never
  outlives the reader's ``SyncKvCacheWaitTime``.
* owner (:class:`ServedTable`): unregister sets the slot's state (no new copy starts), then waits
  until its in-flight count is zero; unlink and finalize do the same with the link's state word.
  After DRAIN_PATIENCE_MS of waiting the owner aborts the copy (state STATE_ABORT: the reader
  checks it, like its deadline, right before every system call and stops).  The wait ends when
  the count is zero, early when the reader process exited (its pidfd: a dead reader's counts are
  void), and at the latest after ``MAX_LEASE_MS + DRAIN_GRACE_MS`` (the cap the TCP path uses too: a
  living reader is waited for, SEMANTICS.md §10 rule 5, but not forever).  Once a wait ended
  because the reader died or the cap passed, the link is closed for good (no new copy starts) and
  no later unregister / unlink / finalize waits on this table again.  A reader's lease never
  outlives ``min(its own time limit, MAX_LEASE_MS)``, and it checks that deadline right before
  every system call, so only a reader stopped inside one system call (or between that check and
  the call) for longer than the cap can still move bytes (at most ``PVM_CHUNK``) after the
  owner's wait ended: see docs/security.md.  All accesses are sequentially consistent, so a
  reader that the owner's wait did not count must see the owner's state word.  An unregister
  revokes the cache's slot in every table first and then waits for all of them from that one
  start (:meth:`ServedTable.revoke_slot`), a finalize its links' tables likewise
  (:func:`drain_window`): one call waits one cap, however many links count.

The table is untrusted input for both sides: a peer may scribble anything into it.  Indices are
checked against the slot count each side mapped; values are only compared with zero; nothing read
from it is used as an address or a size.  Garbage can make the owner wait (bounded, as above) or
refuse copies; it cannot make either side touch memory outside the registered caches.
"""

from __future__ import annotations

import fcntl
import logging
from collections import Counter
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ...status import NOT_EXIST, S_OK, TIMEOUT, Status
from . import samehost_close
from .samehost import SameHostLink, SameHostRefused
from .samehost_shm import announce, map_owner
from .wire import LEASE_GRACE_MS, MAX_LEASE_MS

if TYPE_CHECKING:
    from ..memory import Region
    from .protocol import RemoteCache, ServedCache

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = ["ServedTable", "OneSidedPeer", "OneSidedLease", "STATE_UNREGISTERED", "MAX_LEASE_MS",
           "STATE_FINALIZED", "STATE_CLOSED", "new_table_fd", "seal_table_fd", "check_table_fd",
           "drain_window"]


#: State words (0: open).  Slot: the cache was unregistered.  Link: the owner finalized / closed.
STATE_UNREGISTERED = 1
STATE_FINALIZED = 2
STATE_CLOSED = 3
STATE_ABORT = 4  # (_xproc.LEASE_ABORT) a copy still running stops at its next system call
DRAIN_PATIENCE_MS = 1000  # how long an unregister waits for a copy before aborting it
DRAIN_GRACE_MS = LEASE_GRACE_MS  # beyond the cap, as on the TCP path
PVM_CHUNK = 4 << 20  # bytes per system call: bounds how late a reader notices its deadline


_window = threading.local()  # .start: the common start of this thread's table closes


@contextmanager
def drain_window(start: float | None = None) -> Iterator[None]:
    """The tables this thread closes inside (:meth:`ServedTable.close`) wait for their readers
    from one start (``start``, or taken here): enter it once every one of them is revoked
    (finalize revokes the tables of all its links first), so closing k tables waits one cap."""
    outer = getattr(_window, "start", None)
    if outer is None:
        _window.start = time.monotonic() if start is None else start
    try:
        yield
    finally:
        if outer is None:
            _window.start = None


def seal_table_fd(fd: int) -> None:
    """Seal a lease table's memfd so neither side can resize it under the other (no SIGBUS)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)


def check_table_fd(fd: int, slots: int, size: int) -> None:
    """A received lease table must be a tmpfs memfd sealed against resizing, of exactly ``size``
    bytes for ``slots`` slots; raises SameHostRefused otherwise.

    tmpfs as for the owner's memory files (:func:`kvdd._native._xproc.shm_check`, seals asked
    first: no file system is reached for a file without them): a hugetlbfs memfd takes the same
    seals, and its page, punched out by the peer while none is free, is SIGBUS at the reader's
    next lease."""
    assert _xproc is not None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # first (see above)
        st = os.fstat(fd)
        _xproc.shm_check(fd, st.st_ino)  # tmpfs, a regular file, 1 byte .. 1 TiB
    except (OSError, ValueError) as exc:
        raise SameHostRefused(f"the peer's lease table is not a sealed tmpfs memfd ({exc})") from None
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    if seals & need != need or seals & fcntl.F_SEAL_WRITE or st.st_size != size:
        raise SameHostRefused(f"the peer's lease table ({st.st_size} bytes, seals {seals:#x}) is "
                              f"not sealed or not {size} bytes for {slots} slots")


def new_table_fd(slots: int) -> int:
    """A sealed memfd sized for ``slots`` slots (the owner maps it with ``init=True``)."""
    assert _xproc is not None
    fd = os.memfd_create("kvdd-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _xproc.LEASE_HEADER + slots * _xproc.LEASE_SLOT)
        seal_table_fd(fd)
    except OSError:
        os.close(fd)
        raise
    return fd


class ServedTable:
    """The owner's side of one link's lease table: slot ``i`` is the ``i``-th served cache,
    labelled with its cache id (word 2) for the reader.

    Hand :meth:`take_fd` to the proof (it sends the fd), then :meth:`attach` the proven reader:
    from then on unregistering one of the entries revokes its slot and waits for the reader's
    copies (through ``ServedCache.add_drain``)."""

    def __init__(self, entries: Mapping[int, ServedCache], cap_ms: int = MAX_LEASE_MS) -> None:
        """``cap_ms``: the longest time a living reader is waited for (tests shorten it)."""
        assert _xproc is not None
        self.cap_ms = min(max(cap_ms, 0), MAX_LEASE_MS)
        self.entries = list(entries.values())
        self._fd = new_table_fd(len(self.entries))
        self.table = _xproc.LeaseTable(self._fd, len(self.entries), True)
        for slot, entry in enumerate(self.entries):
            self.table.store(slot, 2, entry.cache_id)
        self._announce_fd = -1
        self._announced = False
        self._lock = threading.Lock()
        self._pidfd = -1  # the reader's, our own duplicate (closed by the last user after close)
        self._waiting = 0  # threads in _wait (they use the pidfd)
        self.reader_pid = 0
        self._wait_ms = 0
        self.reader_limit_ms = 0  # the reader's own time limit as honoured (<= MAX_LEASE_MS)
        self._waited_out = False  # the reader died or a wait hit the cap: never wait again
        self._hooks: list[tuple[ServedCache, Callable[[], object]]] = []
        self._closing = False
        self._closed = False
        self.revoked = False  # revoke() ran: no new copy on any slot

    def announce(self) -> None:
        """Announce the served tensors that live in shareable memory (:func:`kvdd.empty`) in the
        table, for the reader to map (:mod:`.samehost_shm`); once (:meth:`take_fd` does it at
        the latest, before the reader can see the table)."""
        if self._announced:
            return
        self._announced = True
        try:
            self._announce_fd = announce(self.table, self.entries)
        except OSError as exc:
            logger.info("kvdd same-host: shared cache memory not announced: %s", exc)

    def take_fd(self) -> tuple[int, int]:
        """``(fd, slots)`` for the proof, which owns (closes) the fd from now on."""
        self.announce()
        fd, self._fd = self._fd, -1
        return fd, len(self.entries)

    def attach(self, link: SameHostLink, reader_wait_ms: int) -> None:
        """The reader is proven: its copies count from now; unregister waits for them."""
        pidfd = os.dup(link.pidfd)
        with self._lock:
            self._pidfd = pidfd
            self.reader_pid = link.peer_pid
            self.reader_limit_ms = min(max(reader_wait_ms, 0), MAX_LEASE_MS)
            # a living reader is waited for (§10 rule 5), up to the cap shared with TCP
            self._wait_ms = self.cap_ms + DRAIN_GRACE_MS
        for slot, entry in enumerate(self.entries):
            hook = self._hook(slot)
            if entry.add_drain(hook):
                self._hooks.append((entry, hook))
            else:  # unregistered since the snapshot: no copy may start on it
                self.table.revoke(slot, STATE_UNREGISTERED)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def reader_gone(self) -> bool:
        """True once the attached reader process exited (its table can be dropped)."""
        assert _xproc is not None
        with self._lock:
            return self._pidfd >= 0 and not self._closed and not _xproc.pidfd_alive(self._pidfd)

    def _hook(self, slot: int) -> Callable[[], Callable[[float], None]]:
        return lambda: self.revoke_slot(slot)

    def revoke_slot(self, slot: int) -> Callable[[float], None]:
        """Unregister of ``entries[slot]``, first step: no new copy starts on it.  Returns the
        second step, ``wait(start)``: wait until no copy runs, bounded from ``start`` (a
        ``time.monotonic()`` taken after every table of the unregister was revoked, so that one
        unregister waits one cap whatever the number of tables: ``CacheEntry.retire``)."""
        self.table.revoke(slot, STATE_UNREGISTERED)
        return lambda start: self._wait(slot, start)

    def drain(self, slot: int) -> None:
        """Unregister of ``entries[slot]``: no new copy; wait until none runs (bounded)."""
        self.revoke_slot(slot)(time.monotonic())

    def _wait(self, slot: int | None, start: float | None = None) -> None:
        with self._lock:
            pidfd, wait_ms = self._pidfd, self._wait_ms
            if pidfd < 0 or self._waited_out:  # no reader counts here (any more)
                return
            self._waiting += 1
        result = 0
        try:
            # a copy still counted DRAIN_PATIENCE_MS after ``start`` is aborted at its next
            # system call; a living reader still counted then is waited for (§10 rule 5) up to
            # the cap, from ``start`` too
            t0 = time.monotonic() if start is None else start
            patience = min(wait_ms, DRAIN_PATIENCE_MS) - int((time.monotonic() - t0) * 1000)
            result = self.table.wait_idle(slot, max(patience, 0), pidfd)
            if result == 2:
                self.table.revoke(-1 if slot is None else slot, STATE_ABORT)
                left = wait_ms - int((time.monotonic() - t0) * 1000)
                result = self.table.wait_idle(slot, max(left, 0), pidfd)
        finally:
            with self._lock:
                self._waiting -= 1
                if result:  # 1: the reader died; 2: the cap passed
                    self._waited_out = True
                last = self._closed and self._waiting == 0 and self._pidfd >= 0
                if last:
                    os.close(self._pidfd)
                    self._pidfd = -1
        if result:  # a dead reader, or garbage / a stopped reader: the link is over for good
            if result == 2:
                logger.warning("kvdd same-host: reader pid %d still counted as copying after %d "
                               "ms; closing its one-sided access", self.reader_pid, wait_ms)
            self.table.revoke(-1, STATE_CLOSED)

    def revoke(self) -> None:
        """No new copy on any slot, without waiting for running ones: the table stays attached,
        so the unregister of a cache still waits for a copy counted on it (bounded, once), and
        is closed without a wait once idle or its reader exited (:mod:`.samehost_tables`)."""
        self.revoked = True
        self.table.revoke(-1, STATE_CLOSED)

    def close_if_idle(self) -> bool:
        """Revoke, then close without waiting if no copy of the reader's can run or start any
        more: no count left on any slot (a count that comes later never starts a copy: a
        reader's enter adds its count and only then reads the state words, all sequentially
        consistent, so it sees the revocation stored before our look and undoes its count), or
        the reader exited, or a wait on this table already ended for good.  False (and nothing
        more done) while a count is left."""
        self.revoke()
        with self._lock:
            if self._closing:
                return True
            pidfd = -1 if self._waited_out else self._pidfd
            if pidfd >= 0:
                self._waiting += 1
        result = 0
        try:
            if pidfd >= 0:
                result = self.table.wait_idle(None, 0, pidfd)  # a look, no wait
        finally:
            if pidfd >= 0:
                with self._lock:
                    self._waiting -= 1
                    if self._closed and self._waiting == 0 and self._pidfd >= 0:
                        os.close(self._pidfd)
                        self._pidfd = -1
        if result == 2:
            return False
        self.close(wait=False)
        return True

    def close(self, state: int = STATE_CLOSED, wait: bool = True,
              start: float | None = None) -> None:
        """No new copy on any slot (the reader falls back to TCP), wait for running ones
        (bounded, from ``start`` when given; ``wait=False`` only when none can run: an idle or
        never attached table), detach from the entries, drop the reader's pidfd."""
        self.table.revoke(-1, state)
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if wait:
            self._wait(None, getattr(_window, "start", None) if start is None else start)
        for entry, hook in self._hooks:
            entry.remove_drain(hook)
        self._hooks.clear()
        with self._lock:
            self._closed = True
            if self._waiting == 0 and self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._announce_fd >= 0:
            os.close(self._announce_fd)
            self._announce_fd = -1


class OneSidedLease:
    """A lease on one remote cache for one transfer: the slot is entered until released."""

    __slots__ = ("rc", "slot", "deadline", "addrs", "entered", "failed")

    def __init__(self, rc: RemoteCache, slot: int, deadline: float,
                 addrs: tuple[int, ...], failed: int = 0) -> None:
        self.rc = rc
        self.slot = slot
        self.deadline = deadline
        self.addrs = addrs
        self.entered = True
        #: errno of the compiled copy of this very call, which failed after it started (0: none)
        self.failed = failed


class OneSidedPeer:
    """The reader's side: leases in the peer's table and ``process_vm`` copies on the peer's
    tensor addresses (from the link's snapshot), the peer process held by ``link``'s pidfd.

    Maps the table ``link`` received (checked: a sealed memfd of the size for its slot count,
    kvdd's header) and reads the owner's cache-id labels once: a cache the table does not label
    (or labels twice) is not served by this path (``acquire`` returns None: TCP)."""

    def __init__(self, link: SameHostLink) -> None:
        assert _xproc is not None
        slots = link.table_slots
        if link.table_fd < 0 or not 0 <= slots <= _xproc.LEASE_MAX_SLOTS:
            raise SameHostRefused("the peer sent no usable lease table")
        check_table_fd(link.table_fd, slots, _xproc.LEASE_HEADER + slots * _xproc.LEASE_SLOT)
        self.table = _xproc.LeaseTable(link.table_fd, slots)
        if self.table.header()[:2] != (_xproc.LEASE_MAGIC, slots):
            raise SameHostRefused("the peer's lease table has a bad header")
        labels = [self.table.load(i, 2) for i in range(slots)]
        twice = {cid for cid, n in Counter(labels).items() if n > 1}
        self._slot = {cid: i for i, cid in enumerate(labels) if cid and cid not in twice}
        self.link = link
        self.mem_fd = link.open_memory()  # the attested address space (closed with the link)
        #: The owner's cache memory mapped here (.samehost_shm), or None: /proc/<pid>/mem only.
        self.maps = map_owner(link.pidfd, self.table)
        self.usable = True  # False after EPERM (ptrace rules) or close: TCP from then on
        #: The compiled copy of kvdd.sim._fastpath (the same lease protocol, from C); it also
        #: counts this reader's copies, so that close() leaves the fds to the last one.
        self.mover = _xproc.SameHostMover(self, self.table, self._slot, self.mem_fd, link.pidfd,
                                          link.peer_pid, MAX_LEASE_MS, PVM_CHUNK, self.maps)

    def begin_copy(self) -> bool:
        """Count one copy that uses the link's fds (False once closed: copy nothing)."""
        return bool(self.mover.begin())

    def end_copy(self) -> None:
        """The copy counted by :meth:`begin_copy` is over (the last one after close closes the
        fds)."""
        if self.mover.end():
            self.release_fds()

    def release_fds(self) -> None:
        """Unmap the owner's memory and close the link's fds (no copy runs: the copy count).
        The unmapping runs on the unmapper thread (:func:`.samehost_close.unmap_later`): when the
        owner exited, it frees the owner's cache memory (~0.2 s per GiB), which must not hold
        the unlink, finalize or copy that closes the link."""
        if self.maps is not None:
            self.maps.enabled = False  # (no copy runs or starts: the copy count; doubly sure)
            samehost_close.unmap_later(self.maps.close)
        self.link.close()

    def acquire(self, rc: RemoteCache, addrs: tuple[int, ...],
                timeout_ms: int) -> tuple[int, OneSidedLease | None] | None:
        """Enter the cache's slot: ``(status, lease)``, or None (use TCP for this transfer)."""
        slot = self._slot.get(rc.cache_id)
        # the compiled path's copy of this call failed after it started: report that failure
        # (move), never copy again under a fresh deadline
        failed = self.mover.take_failure(-1 if slot is None else slot)
        if not self.usable or slot is None or len(addrs) != rc.num_tensors:
            return None
        if timeout_ms <= 0:  # §10 rule 9: a 0 ms wait always times out
            return TIMEOUT, None
        state = self.table.enter(slot)
        if state:
            if self.table.state(slot):  # unregistered (or its copy aborted)
                return NOT_EXIST, None
            self.usable = False  # the owner dropped the table: TCP carries this link from now
            return None
        limit_ms = min(timeout_ms, MAX_LEASE_MS)  # the owner waits no longer (TCP: the same)
        return S_OK, OneSidedLease(rc, slot, time.monotonic() + limit_ms / 1000.0, addrs, failed)

    def release(self, lease: OneSidedLease) -> None:
        if lease.entered:
            lease.entered = False
            self.table.leave(lease.slot)

    def move(self, lease: OneSidedLease, tensors: Sequence[int], local: Sequence[Region],
             local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
             write: bool) -> int:
        """One-sided copy under ``lease``; a status."""
        assert _xproc is not None
        left_ms = int((lease.deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return TIMEOUT
        addrs = lease.addrs
        if not self.begin_copy():  # closed: never copy without the attested address space held
            return TIMEOUT
        try:
            if lease.failed:  # the compiled copy of this call failed: the same answer, no copy
                raise OSError(lease.failed, os.strerror(lease.failed))  # (EPERM: PermissionError)
            remote = [addrs[t] for t in tensors]
            _xproc.pvm_copy(self.link.peer_pid, local, remote, lease.rc.tensor_nbytes,
                            local_off, remote_off, length, write,
                            timeout_ms=left_ms, chunk=PVM_CHUNK, pidfd=self.link.pidfd,
                            leases=self.table, slot=lease.slot, mem_fd=self.mem_fd,
                            maps=self.maps, map_tensors=tuple(tensors))
        except PermissionError as exc:  # ptrace rules changed (Yama: another reader admitted)
            logger.warning("kvdd same-host: process_vm refused by the kernel (%s); this link "
                           "uses TCP from now on", exc)
            self.usable = False
            return Status.LLM_FAILED
        except ProcessLookupError:  # the peer exited: certain death
            return TIMEOUT
        except (TimeoutError, ConnectionAbortedError):  # our limit (also a copy that ran past
            # it: the owner may have moved on), or the owner's abort
            return TIMEOUT
        except (ValueError, IndexError, TypeError):
            return Status.LLM_PARAM_INVALID
        except OSError:  # EFAULT: the owner freed (or froze) registered memory
            return TIMEOUT if not self.link.alive() else Status.LLM_FAILED
        finally:
            self.end_copy()  # the fds stay open (their numbers not reused) until here
        return S_OK

    def close(self) -> None:
        """Stop using the path and drop the peer's pidfd and memory: at once, or when the last
        copy running now ends (the mapping goes with the last reference)."""
        self.usable = False
        if self.mover.close():
            self.release_fds()
