# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False
"""Copy kernels of the kvdd simulator: every byte the simulator moves goes through :func:`copy_runs`.

The engine builds :class:`Region` handles for memory it has validated (registered tensors) and asks
for runs ``(src_off, dst_off, length)`` applied to each (source, destination) tensor pair. This module
checks every run against every region again, snapshots the request into C memory (so nothing a Python
thread does meanwhile can move it out of bounds) and copies without the GIL (C: _copy_kernels.c for
the per-run loops, _copy_impl.c for jobs and threads, _copy_plan.c for the independence check).

How a call is executed
----------------------
* Below ``NOGIL_THRESHOLD`` (32 KiB) the copy runs with the GIL held: it is shorter than releasing
  and re-taking the GIL, which can cost a 5 ms switch interval when another Python thread is busy.
* Below the streaming threshold (``DEFAULT_STREAMING_THRESHOLD``: twice the per-core L2 cache,
  clamped to 1-4 MiB, so that the copy would not stay in the core's cache anyway): regular stores.
  Runs of <= 32 KiB use a vector loop that prefetches the next run's source and destination; longer
  runs use the C library's ``memmove``.
* From the streaming threshold: non-temporal (streaming) stores, destinations aligned to 64 bytes,
  ``sfence`` (aarch64: ``dmb ishst``) at the end. Runs of at least 4 pages are copied 4 pages at a
  time, interleaved, each page's source prefetched one step ahead; shorter runs and tails use a linear
  loop that prefetches the next short run's source. Runs that overlap their own source and runs
  < 512 bytes always use ``memmove``. The implementation is chosen at run time: AVX-512, AVX2 or
  SSE2 on x86-64, NEON (``stnp``) on aarch64, plain ``memmove`` elsewhere (``set_isa`` forces one).
* ``threads=0`` uses a second thread when the runs are independent (no run writes bytes another
  run reads or writes: checked in O(K log K + J)), no 2-thread call stalled recently (the helper
  was descheduled mid-item: the other CPU is busy; "recently" is 100 times what the stall cost the
  caller, 50 ms to 2 s), and the call is large enough for the
  second thread to pay: by default from ``4 x extra / cost`` bytes, where ``extra`` is what a
  2-thread call measurably costs its caller beyond its own share (posting the work, and waiting at
  the end for the item the helper is still copying, which grows when the other CPU is busy: the
  median of the last 15 calls, so one descheduled call does not move it; stalled calls are left
  out, the backoff answers them) and
  ``cost`` the measured one-thread time per byte of this process's own calls
  (:func:`threads_model`; one in 32 smaller calls of at least 256 KiB uses two threads anyway, so
  the measurement follows the machine); ``set_threads_threshold`` fixes a size instead. The
  helper is a resident pthread started at the first 2-thread call and kept off the caller's CPU; it
  spins 200 us for the next call, then sleeps (a futex on Linux: a wake costs the caller one
  syscall) (after a fork the child starts its own; a second
  concurrent caller gets a helper created for its call). Both threads claim work items from a shared
  counter, so a helper that starts late only does less.

Measurements are in docs/benchmarks.md (``kvdd bench`` and ``python -m benchmarks.kernels``).
"""

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_STRIDES, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from cpython.number cimport PyNumber_Index
from cpython.sequence cimport PySequence_Tuple
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport INT64_MAX, UINTPTR_MAX, int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memmove

import sys

cdef extern from "_copy_impl.h" nogil:
    enum:
        KVDD_ISA_MEMCPY
        KVDD_ISA_SSE2
        KVDD_ISA_AVX2
        KVDD_ISA_AVX512
        KVDD_ISA_NEON
        KVDD_ISA_COUNT
        KVDD_NT_MIN_RUN
    ctypedef struct kvdd_pair:
        uintptr_t src
        uintptr_t dst
    ctypedef struct kvdd_job:
        const kvdd_pair *pairs
        size_t K
        const int64_t *soff
        const int64_t *doff
        const int64_t *len
        size_t J
        uint64_t per_k
        int isa
        int stream
        int threads
        uint64_t chunk
    unsigned kvdd_isa_mask()
    int kvdd_isa_best()
    int kvdd_cpu_feature_count()
    const char *kvdd_cpu_feature_name(int i)
    int kvdd_cpu_feature_value(int i)
    int kvdd_job_independent(const kvdd_job *job)
    uint64_t kvdd_job_run(const kvdd_job *job)
    void kvdd_copy_one(int isa, void *dst, const void *src, size_t n)
    enum:
        KVDD_STATS
    void kvdd_thread_stats(uint64_t *out)
    int kvdd_auto_threads_allowed()
    uint64_t kvdd_threads_min_bytes()
    int kvdd_threads_probe()
    void kvdd_threads_model(int64_t out[2])
    uint64_t kvdd_l2_bytes()
    uint64_t kvdd_llc_bytes()

# ---- tuning (process-wide; read once per call) -----------------------------------------------------

cdef uint64_t _default_streaming_threshold():
    cdef uint64_t l2 = kvdd_l2_bytes()
    if l2 == 0:
        return 2 << 20
    return min(max(2 * l2, <uint64_t>1 << 20), <uint64_t>4 << 20)


#: Default bytes per call from which streaming stores are used: twice the per-core L2 cache,
#: clamped to 1-4 MiB (2 MiB when the cache size is unknown).
DEFAULT_STREAMING_THRESHOLD = _default_streaming_threshold()
#: Default of the automatic 2-thread threshold: None, decided by measured cost (:func:`threads_model`).
DEFAULT_THREADS_THRESHOLD = None
#: Default bytes per work item of the 2-thread path (0: total / 32, clamped to 256 KiB .. 1 MiB, the last
#: two items' worth in quarters of at least 64 KiB).
DEFAULT_CHUNK_SIZE = 0
#: Bytes per call from which the GIL is released (below it the copy is shorter than the release).
NOGIL_THRESHOLD = 32 << 10

cdef uint64_t _streaming_threshold = DEFAULT_STREAMING_THRESHOLD
cdef int64_t _threads_threshold = -1  # -1: by measured cost
cdef uint64_t _chunk_size = DEFAULT_CHUNK_SIZE
cdef uint64_t _nogil_threshold = NOGIL_THRESHOLD
cdef int _isa = kvdd_isa_best()

_ISA_NAMES = ("memcpy", "sse2", "avx2", "avx512", "neon")

# Requests of at most this many runs / tensors are snapshotted inside the request object (no malloc).
cdef enum:
    SMALL_J = 8
    SMALL_K = 8

cdef bint _little_endian = sys.byteorder == "little"
cdef uintptr_t _ADDR_MAX = UINTPTR_MAX
cdef int64_t _I64_MAX = INT64_MAX


@cython.final
@cython.auto_pickle(False)
cdef class Region:
    """A span ``[addr, addr + nbytes)`` of host memory in this process, validated by the simulator.

    Constructed only by ``kvdd.sim`` for registered tensors; the copy functions accept nothing else as
    memory, so every byte they touch lies in a region the engine has checked. Not picklable (an address
    means nothing in another process).

    Parameters
    ----------
    addr : int
        Start address (> 0).
    nbytes : int
        Length in bytes (>= 0); ``addr + nbytes`` must not overflow.
    owner : object, optional
        Kept alive as long as the region (e.g. the numpy array that owns the memory).
    """

    cdef readonly uintptr_t addr
    cdef readonly Py_ssize_t nbytes
    cdef readonly object owner

    def __cinit__(self, addr, nbytes, owner=None):
        # __cinit__, not __init__: it runs once per object, so a validated region cannot be re-pointed
        a = PyNumber_Index(addr)
        n = PyNumber_Index(nbytes)
        if a <= 0 or a > _ADDR_MAX:
            raise ValueError(f"Region: address {a:#x} is not a valid host address")
        if n < 0 or n > _I64_MAX or a + n > _ADDR_MAX:
            raise ValueError(f"Region: nbytes {n} is negative or runs past the address space")
        self.addr = a
        self.nbytes = n
        self.owner = owner

    def __repr__(self):
        return f"Region(addr={self.addr:#x}, nbytes={self.nbytes})"


@cython.final
@cython.auto_pickle(False)
cdef class CopyPlan:
    """How :func:`copy_runs` would execute a request (for tests, benchmarks and ``kvdd doctor``)."""

    cdef readonly uint64_t nbytes
    cdef readonly bint streaming
    cdef readonly int threads
    cdef readonly str isa
    cdef readonly bint nogil

    def __repr__(self):
        return (f"CopyPlan(nbytes={self.nbytes}, streaming={self.streaming}, threads={self.threads}, "
                f"isa={self.isa!r}, nogil={self.nogil})")


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


def copy_runs(src, dst, src_off, dst_off, length, *, threads=0):
    """Copy runs of bytes between validated regions, tensor by tensor.

    For ``k in range(len(src))``, for ``j in range(len(length))``::

        memmove(dst[k].addr + dst_off[j], src[k].addr + src_off[j], length[j])

    Every run is checked against every region first; on any failure nothing is copied.

    Parameters
    ----------
    src, dst : Sequence[Region]
        Source and destination regions, one pair per tensor (equal lengths).
    src_off, dst_off, length : numpy.ndarray
        1-D int64 or uint64 arrays of equal length: byte offsets into each source / destination
        region and run lengths in bytes. Zero-length runs copy nothing.
    threads : int, keyword-only
        0: automatic (two threads when the call is large enough for them to pay, see the module
        notes, a CPU is free and no recent 2-thread call stalled); 1: the calling thread only;
        2: two threads. Two threads only
        run independent runs (no run writes bytes another run reads or writes); otherwise, and
        whenever a second thread cannot start, everything runs in order on the calling thread.

    Returns
    -------
    int
        Bytes copied (``len(src) * sum(length)``).

    Raises
    ------
    ValueError
        ``len(src) != len(dst)``, arrays of different lengths, a negative offset, a length <= 0, a run
        past the end of any region (either side), total overflow, or threads not in {0, 1, 2}.
    TypeError
        A region that is not a :class:`Region`, or an array that is not 1-D int64/uint64.

    Notes
    -----
    Runs apply in order (k outer, j inner): a destination named twice ends with the last source, and a
    run whose source and destination overlap behaves as ``memmove``. Calls of at least
    ``get_streaming_threshold()`` bytes use non-temporal stores (64-byte-aligned destinations, AVX-512
    / AVX2 / SSE2 / NEON chosen at run time) for non-overlapping runs of at least 512 bytes. The GIL is
    released for calls of at least ``NOGIL_THRESHOLD`` bytes.
    """
    cdef _Request r = _prepare(src, dst, src_off, dst_off, length, threads)
    if r.total == 0:
        return 0
    return _run_job(&r.job, r.total)


def plan_runs(src, dst, src_off, dst_off, length, *, threads=0):
    """Validate a request like :func:`copy_runs` and say how it would run, copying nothing.

    Returns
    -------
    CopyPlan
        ``nbytes``, ``streaming``, ``threads`` (1 or 2 actually used), ``isa`` (streaming
        implementation, ``"memcpy"`` for regular stores) and ``nogil``.
    """
    cdef _Request r = _prepare(src, dst, src_off, dst_off, length, threads)
    cdef CopyPlan p = CopyPlan.__new__(CopyPlan)
    p.nbytes = r.total
    p.streaming = r.job.stream != 0
    p.threads = r.job.threads
    p.isa = _ISA_NAMES[r.job.isa]
    p.nogil = r.total >= _nogil_threshold or r.job.threads == 2
    return p


cdef Py_ssize_t _bench_nbytes(Region dst, Region src, object nbytes, str what) except -1:
    n = PyNumber_Index(nbytes)
    if n < 0 or n > src.nbytes or n > dst.nbytes:
        raise ValueError(f"{what}: nbytes {n} must lie in [0, {min(src.nbytes, dst.nbytes)}]")
    return n


def memcpy_bench(Region dst not None, Region src not None, nbytes):
    """One plain ``memcpy`` (``memmove`` if the spans overlap) of `nbytes` from `src` to `dst`, GIL
    released: the limit the benchmarks compare :func:`copy_runs` against.

    Raises
    ------
    ValueError
        `nbytes` negative or larger than either region.
    """
    cdef Py_ssize_t n = _bench_nbytes(dst, src, nbytes, "memcpy_bench")
    cdef uintptr_t d = dst.addr, s = src.addr
    with nogil:
        if d + <size_t>n <= s or s + <size_t>n <= d:
            memcpy(<void *>d, <const void *>s, <size_t>n)
        else:
            memmove(<void *>d, <const void *>s, <size_t>n)


def stream_bench(Region dst not None, Region src not None, nbytes):
    """One streaming copy (the current ISA, ``sfence`` after) of `nbytes` from `src` to `dst`, GIL
    released; ``memmove`` if the spans overlap. Used by the benchmarks as a second limit.

    Raises
    ------
    ValueError
        `nbytes` negative or larger than either region.
    """
    cdef Py_ssize_t n = _bench_nbytes(dst, src, nbytes, "stream_bench")
    cdef uintptr_t d = dst.addr, s = src.addr
    cdef int isa = _isa
    with nogil:
        if d + <size_t>n <= s or s + <size_t>n <= d:
            kvdd_copy_one(isa, <void *>d, <const void *>s, <size_t>n)
        else:
            memmove(<void *>d, <const void *>s, <size_t>n)


include "_copy_config.pxi"
include "_copy_runs.pxi"
include "_copy_tables.pxi"
