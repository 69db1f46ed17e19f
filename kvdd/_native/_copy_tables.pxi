# Included by _copy.pyx (one module; declared in _copy.pxd): region tables, a registered cache's
# tensors as one C array with the count of transfers using them (leases), and copies between them.
# The compiled transfer path (kvdd/sim/_fastpath.pyx) leases and copies through these without a
# Python call or a Python object per tensor: with the interpreter's caches cold after the previous
# copy, a 78-tensor block pull spent ~40 us building and checking region lists and ~17 us in four
# lease calls.
#
# Leases: take / give (and acquire / release from Python) change the count with the GIL held and
# call no Python code in between, so they are atomic between threads without a lock (kvdd needs a
# GIL build of CPython). close() refuses new leases; its Event is set when the last one ends.


@cython.auto_pickle(False)
cdef class RegionTable:
    """The regions of one registered cache's tensors, their addresses in C memory.

    Parameters
    ----------
    regions : Sequence[Region]
        The tensors in order; kept alive (with their owners) as long as the table.

    Raises
    ------
    TypeError
        An item that is not a :class:`Region`.
    """

    def __cinit__(self, regions):
        cdef tuple t = _as_regions(regions, "regions")
        cdef Py_ssize_t n = PyTuple_GET_SIZE(t), k, smallest = INT64_MAX if n else 0
        cdef Region reg
        self.addrs = <uintptr_t *>PyMem_RawMalloc(<size_t>(n if n > 0 else 1) * sizeof(uintptr_t))
        if self.addrs == NULL:
            raise MemoryError()
        for k in range(n):
            reg = <Region>PyTuple_GET_ITEM(t, k)
            self.addrs[k] = reg.addr
            if reg.nbytes < smallest:
                smallest = reg.nbytes
        self._regions = t
        self.n = n
        self.nbytes = smallest

    def __dealloc__(self):
        PyMem_RawFree(self.addrs)

    cdef bint take(self) noexcept:
        if self.closed:
            return False
        self.inflight += 1
        return True

    cdef int give(self) except -1:
        if self.inflight <= 0:
            raise RuntimeError("RegionTable.release without a lease")
        self.inflight -= 1
        if self.inflight == 0 and self._drained is not None:
            self._drained.set()
        return 0

    def acquire(self):
        """Take a lease (a transfer is using the regions); False once :meth:`close` was called."""
        return self.take()

    def release(self):
        """End a lease taken by :meth:`acquire`; sets the Event of :meth:`close` at the last one.

        Raises
        ------
        RuntimeError
            No lease is held.
        """
        self.give()

    def close(self, drained):
        """Refuse new leases from now; ``drained.set()`` (a :class:`threading.Event`) once no lease
        is held, at once if none is. Idempotent: a later call keeps the first Event."""
        self.closed = True
        if self._drained is None:
            self._drained = drained
        if self.inflight == 0:
            self._drained.set()
        return self._drained

    def __len__(self):
        return self.n

    def __repr__(self):
        return f"RegionTable({self.n} regions of >= {self.nbytes} bytes)"


cdef uint64_t copy_table_runs(RegionTable src, Py_ssize_t s_first, RegionTable dst, Py_ssize_t d_first,
                              Py_ssize_t K, const int64_t *so, const int64_t *do, const int64_t *ln,
                              Py_ssize_t J) except? 0:
    """:func:`copy_runs` for the tensors ``[s_first, s_first + K)`` of `src` and ``[d_first, d_first +
    K)`` of `dst`, the runs given as C arrays: the same checks of every run against every region
    (nothing copied on a failure), the same stores and automatic threads. Returns the bytes copied.
    The caller holds a lease on both tables (taken with ``take``): the copy does not look at them."""
    if K < 0 or s_first < 0 or d_first < 0 or s_first > src.n - K or d_first > dst.n - K:
        raise ValueError(f"copy_tables: tensors [{s_first}, {s_first} + {K}) of a {src.n}-region table to "
                         f"[{d_first}, {d_first} + {K}) of a {dst.n}-region table; nothing was copied")
    cdef kvdd_pair small[SMALL_K]
    cdef kvdd_pair *pairs = small
    cdef kvdd_job job
    cdef Py_ssize_t k
    cdef uint64_t total
    if K > SMALL_K:
        pairs = <kvdd_pair *>PyMem_RawMalloc(<size_t>K * sizeof(kvdd_pair))
        if pairs == NULL:
            raise MemoryError()
    try:
        for k in range(K):
            pairs[k].src = src.addrs[s_first + k]
            pairs[k].dst = dst.addrs[d_first + k]
        total = _plan_job(&job, pairs, K, so, do, ln, J, src.nbytes if K else INT64_MAX, s_first,
                          dst.nbytes if K else INT64_MAX, d_first, 0)
        if total == 0:
            return 0
        return _run_job(&job, total)
    finally:
        if pairs != small:
            PyMem_RawFree(pairs)


def copy_tables(RegionTable src not None, Py_ssize_t s_first, RegionTable dst not None, Py_ssize_t d_first,
                Py_ssize_t K, src_off, dst_off, length):
    """Copy runs between the tensors ``[s_first, s_first + K)`` of `src` and ``[d_first, d_first + K)``
    of `dst`, as :func:`copy_runs` does between region lists (automatic threads). The caller holds
    a lease on both tables (:meth:`RegionTable.acquire`): the copy does not check them.

    Parameters
    ----------
    src, dst : RegionTable
    s_first, d_first, K : int
        The first tensor of each table and the tensor count.
    src_off, dst_off, length : numpy.ndarray
        As in :func:`copy_runs` (bytes).

    Returns
    -------
    int
        Bytes copied.

    Raises
    ------
    ValueError
        Tensors outside a table, or anything :func:`copy_runs` refuses.
    TypeError
        Arrays that are not 1-D int64/uint64.
    """
    cdef int64_t small[3]
    cdef int64_t *runs = NULL
    cdef Py_ssize_t J = _take_runs(src_off, dst_off, length, small, 1, &runs)
    try:
        return copy_table_runs(src, s_first, dst, d_first, K, runs, runs + J, runs + 2 * J, J)
    finally:
        if runs != small:
            PyMem_RawFree(runs)


cdef uint64_t copy_trusted_runs(const int64_t *so, const int64_t *do, const int64_t *ln,
                                Py_ssize_t J, uint64_t call_bytes) noexcept nogil:
    """Copy ``J`` runs between absolute addresses: ``memmove(do[j], so[j], ln[j])`` (addresses as
    int64, lengths > 0), with the stores :func:`copy_runs` would use for a call of ``call_bytes``
    and its automatic threads for these runs.  The runs are not checked: the caller (the
    same-host path's mapped copy, ``kvdd/_native/_xproc.pyx``) validated every one against its
    regions and its peer's mapped tensors.  Returns the bytes copied."""
    cdef kvdd_pair pair
    cdef kvdd_job job
    cdef uint64_t total = 0
    cdef Py_ssize_t j
    for j in range(J):
        total += <uint64_t>ln[j]
    if total == 0:
        return 0
    pair.src = 0
    pair.dst = 0
    job.pairs = &pair
    job.K = 1
    job.soff = so
    job.doff = do
    job.len = ln
    job.J = <size_t>J
    job.per_k = total
    job.isa = _isa
    job.stream = _isa != KVDD_ISA_MEMCPY and call_bytes >= _streaming_threshold
    job.chunk = _chunk_size
    job.threads = 1
    cdef uint64_t auto_min = (<uint64_t>_threads_threshold if _threads_threshold >= 0
                              else kvdd_threads_min_bytes())
    cdef bint two = False
    if total >= auto_min:
        two = kvdd_auto_threads_allowed()
    elif _threads_threshold < 0 and total >= (256 << 10) and kvdd_auto_threads_allowed():
        two = kvdd_threads_probe()
    if two and kvdd_job_independent(&job):
        job.threads = 2
    return kvdd_job_run(&job)
