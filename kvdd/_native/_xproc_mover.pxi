# Included by _xproc.pyx (at its end): the compiled same-host transfer of kvdd.sim._fastpath.

cdef enum:
    _MOVED = 1       # the bytes moved: the call succeeded
    _DECLINED = 0    # nothing happened: the Python path runs the call
    _FAILED = -1     # the copy failed after it started (bytes may have moved): the Python path
                     # answers the call, reporting this copy's errno (take_failure) without
                     # copying again
    _TIMED_OUT = -2  # deadline, owner's abort, or the peer's address space gone: the link is
                     # broken (LLM_TIMEOUT, as OneSidedPeer.move reports it)


cdef void forget_failure() noexcept nogil:
    """Drop this thread's record of a failed compiled copy (every compiled call starts with it, so
    a record never outlives the call that made it)."""
    global kvdd_failed_mover, kvdd_failed_slot, kvdd_failed_errno
    kvdd_failed_mover = NULL
    kvdd_failed_slot = -1
    kvdd_failed_errno = 0


cdef class SameHostMover:
    """One link reader's compiled copy (:class:`kvdd.sim.fabric.samehost_path.OneSidedPeer`):
    the lease protocol of :meth:`~kvdd.sim.fabric.samehost_path.OneSidedPeer.acquire` /
    ``move`` / ``release`` (enter the slot, copy through the owner's cache memory mapped here
    when every tensor of the call is (``maps``), else through the peer's ``/proc/<pid>/mem``,
    under the reader's deadline and the owner's abort, leave) with the same meaning, called from C by
    ``kvdd.sim._fastpath`` after the call's checks; no Python object per call but the reader's
    copy count.

    Parameters
    ----------
    reader : OneSidedPeer
        Its ``usable`` flag is honoured; its copies count here too (:meth:`begin`, :meth:`end`,
        :meth:`close`: all under the GIL), so the link's fds stay open while any copy runs.
    table : LeaseTable
        The owner's lease table as the reader mapped it (kept mapped by this object).
    slot_of : dict[int, int]
        Cache id -> slot, as the reader read the owner's labels.
    mem_fd, pidfd, pid : int
        The attested peer's ``/proc/<pid>/mem``, pidfd and pid (owned by the reader's link).
    max_lease_ms, chunk : int
        A lease's longest life (``MAX_LEASE_MS``) and the bytes per system call (or per kernel
        call of a mapped copy).
    maps : PeerMaps or None
        The owner's cache memory mapped by the reader (unmapped by the reader's
        ``release_fds`` with the other fds, when no copy runs).
    """

    def __cinit__(self, reader, LeaseTable table not None, dict slot_of not None, int mem_fd,
                  int pidfd, int pid, int64_t max_lease_ms, uint64_t chunk, PeerMaps maps=None):
        if mem_fd < 0 or pidfd < 0 or pid <= 0 or chunk < 4096:
            raise ValueError("SameHostMover: an open memory fd, a pidfd, a pid and a chunk "
                             ">= 4096 are required")
        for cid, slot in slot_of.items():
            if type(slot) is not int or not 0 <= slot < table.slots:
                raise ValueError(f"SameHostMover: slot {slot} of cache {cid} is out of range")
        self.reader = reader
        self.table = table
        self.slot_of = dict(slot_of)
        self.mem_fd = mem_fd
        self.pidfd = pidfd
        self.pid = pid
        self.max_lease_ms = max_lease_ms
        self.chunk = chunk
        self.moved = 0
        self.copies = 0
        self.closing = False
        self.maps = maps

    @property
    def maps(self):
        """The owner's memory mapped by the reader (:class:`PeerMaps`), or None."""
        return self.maps

    def take_failure(self, Py_ssize_t slot) -> int:
        """The errno of this thread's compiled copy on ``slot`` that failed after it started (the
        call the Python path answers now), or 0; the record is dropped either way.

        The compiled path declines such a call and the Python path answers it: it must report the
        failure, not copy everything again under a fresh deadline (the call would then take the
        compiled copy's time plus its own, past its deadline)."""
        cdef int err = 0
        if (kvdd_failed_errno != 0 and kvdd_failed_mover == <void *>self
                and kvdd_failed_slot == slot):
            err = kvdd_failed_errno
        forget_failure()
        return err

    def begin(self) -> bool:
        """Count one copy that uses the link's fds (False once closed: copy nothing)."""
        if self.closing:
            return False
        self.copies += 1
        return True

    def end(self) -> bool:
        """The copy counted by :meth:`begin` is over; True when the caller must now close the
        link's fds (closed meanwhile, and this was the last copy)."""
        self.copies -= 1
        return self.closing and self.copies == 0

    def close(self) -> bool:
        """No new copy; True when none runs (the caller closes the fds now), False when the last
        running copy will (the compiled one closes ``reader.link`` itself)."""
        self.closing = True
        return self.copies == 0

    cdef int move(self, object rc, object addrs, RegionTable lt, bint pull, Py_ssize_t l_first,
                  Py_ssize_t r_first, Py_ssize_t K, const int64_t *l_off, const int64_t *r_off,
                  const int64_t *ln, Py_ssize_t J, int64_t wait_ms) except -9:
        """Runs ``k < K``, ``j < J``: local tensor ``l_first + k`` at ``l_off[j]`` <-> remote
        tensor ``r_first + k`` (address ``addrs[r_first + k]``) at ``r_off[j]``, ``ln[j]``
        bytes (``pull``: into the local side).  Every run is checked against the local regions
        and the remote tensor size again.  Returns _MOVED, _DECLINED, _FAILED or _TIMED_OUT."""
        if type(addrs) is not tuple or not self.reader.usable:
            return _DECLINED
        slot_obj = self.slot_of.get(rc.cache_id)
        if slot_obj is None or len(<tuple>addrs) != rc.num_tensors or wait_ms <= 0:
            return _DECLINED  # not served one-sided (TCP), or §10 rule 9: the Python path says
        cdef Py_ssize_t slot = slot_obj, j
        cdef int64_t rn = rc.tensor_nbytes, lmin = lt.nbytes, n
        if (K <= 0 or l_first < 0 or r_first < 0 or l_first + K > lt.n
                or r_first + K > len(<tuple>addrs)):
            return _DECLINED
        for j in range(J):
            n = ln[j]
            if (n < 0 or l_off[j] < 0 or n > lmin or l_off[j] > lmin - n or r_off[j] < 0
                    or n > rn or r_off[j] > rn - n):
                return _DECLINED
        cdef uintptr_t small[3 * _SMALL]
        cdef uintptr_t *addr = small
        if K > _SMALL:
            addr = <uintptr_t *>PyMem_RawMalloc(<size_t>(3 * K) * sizeof(uintptr_t))
            if addr == NULL:
                return _DECLINED
        try:
            return self._move(rc, addrs, lt, pull, l_first, r_first, K, l_off, r_off, ln, J,
                              wait_ms, slot, addr)
        finally:
            if addr != small:
                PyMem_RawFree(addr)

    cdef int _move(self, object rc, object addrs, RegionTable lt, bint pull, Py_ssize_t l_first,
                   Py_ssize_t r_first, Py_ssize_t K, const int64_t *l_off, const int64_t *r_off,
                   const int64_t *ln, Py_ssize_t J, int64_t wait_ms, Py_ssize_t slot,
                   uintptr_t *addr) except -9:
        cdef int64_t rn = rc.tensor_nbytes
        cdef uintptr_t *laddr = addr
        cdef uintptr_t *raddr = addr + K
        cdef uintptr_t a
        cdef Py_ssize_t k, j
        for k in range(K):
            a = (<tuple>addrs)[r_first + k]
            if a == 0 or a > UINTPTR_MAX - <uintptr_t>rn:
                return _DECLINED
            raddr[k] = a
            laddr[k] = lt.addrs[l_first + k]
        # the owner's memory mapped here, when every tensor is (checked after the runs and the
        # remote addresses, as pvm_copy does); the copy stays inside each mapped tensor
        cdef bint mapped = (self.maps is not None and
                            (<PeerMaps>self.maps).bases(slot, None, r_first, K, rn, addr + 2 * K))
        cdef uint64_t call_bytes = 0
        for j in range(J):
            call_bytes += <uint64_t>ln[j]
        call_bytes *= <uint64_t>K
        cdef int cpidfd = self.pidfd
        if mapped:
            raddr = addr + 2 * K
        cdef _Job job
        job.pid = self.pid
        job.mem_fd = self.mem_fd
        job.write = not pull
        job.K = K
        job.J = J
        job.laddr = laddr
        job.raddr = raddr
        job.loff = l_off
        job.roff = r_off
        job.ln = ln
        job.chunk = self.chunk
        job.done = 0
        job.err = 0
        job.timed_out = False
        job.aborted = False
        cdef uint64_t *s = self.table._slot(slot)
        job.abort_word = s + _S_STATE
        job.abort_link = self.table.base + _H_STATE
        if self.closing:  # closed: the fds are no longer ours
            return _DECLINED
        self.copies += 1  # the fds stay open (their numbers not reused) until the copy ends
        try:
            if not lt.take():  # the local lease (CacheEntry.acquire)
                return _DECLINED
            try:
                # the remote lease (LeaseTable.enter): in-flight += 1, then both state words
                kvdd_add(&s[_S_INFLIGHT], 1)
                if kvdd_load(&s[_S_STATE]) != 0 or kvdd_load(&self.table.base[_H_STATE]) != 0:
                    kvdd_sub(&s[_S_INFLIGHT], 1)
                    return _DECLINED
                try:
                    if wait_ms > self.max_lease_ms:
                        wait_ms = self.max_lease_ms  # the owner waits no longer
                    job.deadline = _now_ns() + wait_ms * 1000000
                    with nogil:
                        if mapped:  # the peer alive before and after, as /proc/<pid>/mem says
                            if _pidfd_exited(cpidfd):
                                job.err = ESRCH
                            else:
                                _run_map(&job, call_bytes)
                                # a copy of at most one chunk (microseconds) is taken as done
                                # before an exit racing it, as one pread of /proc/<pid>/mem is;
                                # a longer one fails when the peer exited meanwhile
                                if call_bytes > <uint64_t>job.chunk and _pidfd_exited(cpidfd):
                                    job.err = ESRCH
                        else:  # (no pidfd check: the file names the attested address space)
                            _run_mem(&job)
                finally:
                    kvdd_sub(&s[_S_INFLIGHT], 1)  # LeaseTable.leave
            finally:
                lt.give()
        finally:
            self.copies -= 1
            if self.closing and self.copies == 0:
                self.reader.release_fds()  # the reader closed meanwhile: the last copy closes
        if job.timed_out or job.aborted or job.err == ESRCH:
            return _TIMED_OUT
        if job.err:  # the Python path answers the call, reporting this errno (take_failure)
            global kvdd_failed_mover, kvdd_failed_slot, kvdd_failed_errno
            kvdd_failed_mover = <void *>self
            kvdd_failed_slot = slot
            kvdd_failed_errno = job.err
            return _FAILED
        self.moved += 1
        return _MOVED
