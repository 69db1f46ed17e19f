# Included by _copy.pyx (one module, at the place of this include): a copy request checked and
# snapshotted into C memory (regions, run arrays, bounds against the smallest region of each side),
# the job planned from it (stores, threads) and run with or without the GIL.


cdef tuple _as_regions(object seq, str what):
    """The regions of `seq` as a tuple (a tuple is kept alive for the whole call, so no region or owner
    can be freed while the GIL is released)."""
    cdef tuple t
    if type(seq) is tuple:
        t = <tuple>seq
    elif isinstance(seq, (str, bytes, bytearray)):
        raise TypeError(f"copy_runs: {what} must be a sequence of Region, not {type(seq).__name__}")
    else:
        try:
            t = PySequence_Tuple(seq)
        except TypeError:
            raise TypeError(f"copy_runs: {what} must be a sequence of Region, not {type(seq).__name__}") from None
    cdef Py_ssize_t i
    cdef object item
    for i in range(PyTuple_GET_SIZE(t)):
        item = <object>PyTuple_GET_ITEM(t, i)
        if type(item) is not Region:
            raise TypeError(f"copy_runs: {what}[{i}] is {type(item).__name__}, not Region "
                            "(regions are created by kvdd.sim for registered memory)")
    return t


cdef int _get_i64(object obj, Py_buffer *view, str what) except -1:
    """Acquire a 1-D buffer of 8-byte integers (numpy int64/uint64, native byte order)."""
    if PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) != 0:
        return -1
    cdef const char *f = view.format
    cdef bint ok = view.ndim == 1 and view.itemsize == 8 and f != NULL
    if ok:
        if f[0] == b'@' or f[0] == b'=' or (f[0] == b'<' and _little_endian) or (f[0] == b'>' and not _little_endian):
            f += 1
        ok = (f[0] == b'q' or f[0] == b'Q' or f[0] == b'l' or f[0] == b'L') and f[1] == 0
    if not ok:
        PyBuffer_Release(view)
        raise TypeError(f"copy_runs: {what} must be a 1-D int64 or uint64 array")
    return 0


cdef inline void _gather(const Py_buffer *v, int64_t *out, Py_ssize_t n) noexcept nogil:
    cdef const char *p = <const char *>v.buf
    cdef Py_ssize_t st = v.strides[0], j
    if st == 8:
        memcpy(out, p, <size_t>n * 8)
    else:
        for j in range(n):
            memcpy(&out[j], p + j * st, 8)


cdef Py_ssize_t _take_runs(object src_off, object dst_off, object length, int64_t *small,
                           Py_ssize_t small_j, int64_t **runs) except -1:
    """Snapshot the three run arrays into C memory: ``*runs`` holds J source offsets, then J
    destination offsets, then J lengths, in `small` (room for `small_j` runs) or else in memory
    from PyMem_RawMalloc that the caller frees. Returns J.

    Raises TypeError for an array that is not 1-D int64/uint64, ValueError for unequal lengths."""
    cdef Py_buffer vs, vd, vl
    cdef int held = 0  # buffers acquired so far (vs, vd, vl in that order)
    cdef Py_ssize_t J
    try:
        _get_i64(src_off, &vs, "src_off")
        held = 1
        _get_i64(dst_off, &vd, "dst_off")
        held = 2
        _get_i64(length, &vl, "length")
        held = 3
        J = vl.shape[0]
        if vs.shape[0] != J or vd.shape[0] != J:
            raise ValueError(f"copy_runs: src_off, dst_off and length must have equal lengths, not "
                             f"{vs.shape[0]}, {vd.shape[0]} and {J}")
        if J <= small_j:
            runs[0] = small
        else:
            runs[0] = <int64_t *>PyMem_RawMalloc(<size_t>J * 3 * 8)
            if runs[0] == NULL:
                raise MemoryError()
        _gather(&vs, runs[0], J)
        _gather(&vd, runs[0] + J, J)
        _gather(&vl, runs[0] + 2 * J, J)
        return J
    finally:
        if held >= 1:
            PyBuffer_Release(&vs)
        if held >= 2:
            PyBuffer_Release(&vd)
        if held >= 3:
            PyBuffer_Release(&vl)


@cython.final
@cython.auto_pickle(False)
cdef class _Request:
    """Validated, snapshotted copy request: the pairs and run arrays live in C memory owned here."""

    cdef kvdd_job job
    cdef tuple src, dst            # keep regions (and their owners) alive
    cdef kvdd_pair small_pairs[SMALL_K]
    cdef int64_t small_runs[3 * SMALL_J]
    cdef kvdd_pair *pairs
    cdef int64_t *runs
    cdef uint64_t total

    def __dealloc__(self):
        if self.pairs != NULL and self.pairs != self.small_pairs:
            PyMem_RawFree(self.pairs)
        if self.runs != NULL and self.runs != self.small_runs:
            PyMem_RawFree(self.runs)


cdef object _bound_error(str side, Py_ssize_t j, int64_t off, int64_t n, Py_ssize_t limit, Py_ssize_t k):
    return ValueError(
        f"copy_runs: run {j} is out of bounds: {side}_off {off} + length {n} must lie in "
        f"[0, {limit}] bytes of {side} region {k}; nothing was copied")


cdef _Request _prepare(object src, object dst, object src_off, object dst_off, object length,
                       object threads_arg):
    cdef int threads
    if type(threads_arg) is int and 0 <= <long>threads_arg <= 2:
        threads = <int><long>threads_arg
    else:
        t = PyNumber_Index(threads_arg)
        if not 0 <= t <= 2:
            raise ValueError(f"copy_runs: threads must be 0 (automatic), 1 or 2, not {t}")
        threads = t
    cdef _Request r = _Request.__new__(_Request)
    r.src = _as_regions(src, "src")
    r.dst = _as_regions(dst, "dst")
    cdef Py_ssize_t K = PyTuple_GET_SIZE(r.src), k
    if PyTuple_GET_SIZE(r.dst) != K:
        raise ValueError(f"copy_runs: {K} source regions but {PyTuple_GET_SIZE(r.dst)} destination "
                         "regions; pass one destination per source")
    if K <= SMALL_K:
        r.pairs = r.small_pairs
    else:
        r.pairs = <kvdd_pair *>PyMem_RawMalloc(<size_t>K * sizeof(kvdd_pair))
        if r.pairs == NULL:
            raise MemoryError()
    cdef Py_ssize_t J = _take_runs(src_off, dst_off, length, r.small_runs, SMALL_J, &r.runs)

    # Bounds: each run must fit every region, i.e. the smallest one on each side.
    cdef Region reg
    cdef Py_ssize_t smin = INT64_MAX, dmin = INT64_MAX, sk = 0, dk = 0
    for k in range(K):
        reg = <Region>PyTuple_GET_ITEM(r.src, k)
        r.pairs[k].src = reg.addr
        if reg.nbytes < smin:
            smin = reg.nbytes
            sk = k
        reg = <Region>PyTuple_GET_ITEM(r.dst, k)
        r.pairs[k].dst = reg.addr
        if reg.nbytes < dmin:
            dmin = reg.nbytes
            dk = k
    # (with no tensors the limits stay INT64_MAX: offsets and lengths are still checked for sign and
    # overflow)
    r.total = _plan_job(&r.job, r.pairs, K, r.runs, r.runs + J, r.runs + 2 * J, J, smin, sk, dmin, dk,
                        threads)
    return r


cdef uint64_t _plan_job(kvdd_job *job, const kvdd_pair *pairs, Py_ssize_t K, const int64_t *so,
                        const int64_t *do, const int64_t *ln, Py_ssize_t J, Py_ssize_t smin,
                        Py_ssize_t sk, Py_ssize_t dmin, Py_ssize_t dk, int threads) except? 0:
    """Check every run against the smallest region of each side (`smin` bytes, region `sk`; `dmin`,
    `dk`), then fill `job` and decide its stores and threads (module notes); returns the total bytes
    (0 for an empty job). ValueError when a run is out of bounds or empty, or the total overflows."""
    cdef uint64_t per_k = 0, total
    cdef int64_t n
    cdef Py_ssize_t j
    for j in range(J):
        n = ln[j]
        if n <= 0:
            # every run the engine plans moves bytes (SEMANTICS.md rejects size 0 before any copy);
            # a zero or negative length is a request the engine did not validate
            raise ValueError(f"copy_runs: run {j} has length {n} (must be > 0); nothing was copied")
        if so[j] < 0 or n > smin or so[j] > smin - n:
            raise _bound_error("src", j, so[j], n, smin, sk)
        if do[j] < 0 or n > dmin or do[j] > dmin - n:
            raise _bound_error("dst", j, do[j], n, dmin, dk)
        per_k += <uint64_t>n
        if per_k > <uint64_t>INT64_MAX:
            raise ValueError("copy_runs: total length overflows; nothing was copied")
    if K > 0 and per_k > <uint64_t>INT64_MAX // <uint64_t>K:
        raise ValueError("copy_runs: total length overflows; nothing was copied")
    total = per_k * <uint64_t>K

    job.pairs = pairs
    job.K = <size_t>K
    job.soff = so
    job.doff = do
    job.len = ln
    job.J = <size_t>J
    job.per_k = per_k
    job.isa = _isa
    job.stream = _isa != KVDD_ISA_MEMCPY and total >= _streaming_threshold
    job.chunk = _chunk_size
    job.threads = 1
    cdef uint64_t auto_min = <uint64_t>_threads_threshold if _threads_threshold >= 0 else kvdd_threads_min_bytes()
    cdef bint auto_two = False
    if threads == 0 and total >= auto_min:
        auto_two = kvdd_auto_threads_allowed()
    elif threads == 0 and _threads_threshold < 0 and total >= (256 << 10) and kvdd_auto_threads_allowed():
        auto_two = kvdd_threads_probe()  # now and then: keep the measured start latency current
    if total > 0 and (threads == 2 or auto_two):
        if kvdd_job_independent(job):
            job.threads = 2
    return total


cdef uint64_t _run_job(const kvdd_job *job, uint64_t total) noexcept:
    """Execute a planned job: with the GIL held when it is short and on one thread (releasing
    and re-taking the GIL would cost more), else without it."""
    cdef uint64_t done
    if total < _nogil_threshold and job.threads == 1:
        return kvdd_job_run(job)
    with nogil:
        done = kvdd_job_run(job)
    return done
