# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False
"""Copy kernels of the kvdd simulator: every byte the simulator moves goes through :func:`copy_runs`.

The engine builds :class:`Region` handles for memory it has validated (registered tensors) and asks
for runs ``(src_off, dst_off, length)`` applied to each (source, destination) tensor pair. This module
checks every run against every region again, snapshots the request into C memory (so nothing a Python
thread does meanwhile can move it out of bounds) and copies without the GIL (_copy_impl.c).

How a call is executed
----------------------
* Below ``NOGIL_THRESHOLD`` (32 KiB) the copy runs with the GIL held: it is shorter than releasing
  and re-taking the GIL, which can cost a 5 ms switch interval when another Python thread is busy
  (numpy does the same for small arrays).
* Below the streaming threshold (2 MiB per call): regular stores. Runs of <= 32 KiB use a vector loop
  that prefetches the next run's source and destination (random 16 KiB runs: 0.51 -> 0.70x of memcpy
  at 1 MiB, 0.53 -> 0.79x at 4 MiB); longer runs use glibc memmove.
* From 2 MiB per call: non-temporal (streaming) stores, destinations aligned to 64 bytes, AVX-512,
  AVX2 or SSE2 chosen at run time (``set_isa``), ``sfence`` at the end; short runs prefetch the next
  run's source. Runs that overlap their own source and runs < 512 bytes always use memmove.
* threads=0 uses a second thread from 32 MiB per call (threads=2 at any size) when the runs are
  independent (no run writes bytes another run reads or writes: checked in O(K log K + J)); otherwise
  runs execute in order on the calling thread. The helper is a detached pthread created per call and
  pinned away from the caller's CPU; both threads claim work items from a shared counter, so a helper
  that starts late only does less. What made 2-thread copies stall on this shared 2-CPU machine is a
  helper descheduled in the middle of an item (the caller must wait for it: its writes cannot be
  abandoned). So automatic mode also requires a free CPU right now (runnable tasks in /proc/loadavg)
  and, after a stall (waited > 1 ms and > 1/4 of the caller's own work), stays on one thread for 2 s.

Measurements (``python -m benchmarks.kernels --threads 1,2,0``; 2-core AMD EPYC Zen 4 KVM guest, L2
2 MiB per core, L3 32 MiB, AVX-512; other load while measuring 2%; one tensor, runs at random distinct
block offsets; ratio = time of the best plain memcpy of the same bytes, contiguous, between the same
buffers / copy_runs time, min over interleaved repeats in the same run; >1 = faster than memcpy):

=======  ====================  ===========================  ===========================
total    automatic path        1 thread: runs of 16 / 64 /  2 threads (threads=2):
                               128 / 256 KiB                16 / 64 / 128 / 256 KiB
=======  ====================  ===========================  ===========================
1 MiB    regular, 1 thread     0.69 / 0.86 / 1.20 / 1.19    0.64 / 0.66 / 0.80 / 0.77
4 MiB    streaming, 1 thread   1.07 / 1.09 / 1.08 / 1.08    0.94 / 0.96 / 0.94 / 0.94
16 MiB   streaming, 1 thread   0.97 / 1.04 / 1.06 / 1.08    1.52 / 1.41 / 1.02 / 1.04
64 MiB   streaming, 2 threads  0.87 / 1.13 / 1.42 / 1.33    1.41 / 1.55 / 2.38 / 1.81
256 MiB  streaming, 2 threads  0.99 / 1.20 / 1.31 / 1.38    1.83 / 2.14 / 1.74 / 1.76
=======  ====================  ===========================  ===========================

The limit (glibc memcpy) ran at 32-38 GB/s at 1 MiB, 26 GB/s at 4-16 MiB, 13.5-17 GB/s at 64-256 MiB
(regular stores read every destination line first); one contiguous streaming copy (``stream_bench``)
reached 22 GB/s at 256 MiB, so one thread of random 16 KiB runs reaches 0.64 of that, 256 KiB runs
0.91, and two threads 1.15-1.40 (25-31 GB/s).

Thresholds: streaming from 2 MiB because regular stores lost from 4 MiB on (regular 0.74-0.91 at
4 MiB in an earlier sweep, streaming 1.02-1.09) while at 1 MiB regular stores keep the destination in
cache for its reader and are as fast or faster for runs >= 128 KiB (streaming: 0.84-0.93 at 1 MiB).
Two threads from 32 MiB because below it they lose (thread start ~15-20 us, in-cache data crossing
cores) or gain only in the best repeats: at 16 MiB the 2-thread medians were 1.06-1.13, within the
1-thread spread, and on this shared machine they stalled whenever the other CPU was busy.
The regular-store vector loop with next-run prefetch took random 16 KiB runs from 0.51 to 0.70x at
1 MiB and 0.53 to 0.79x at 4 MiB; the source prefetch of the streaming loop took them from 11.2 to
14 GB/s at 256 MiB. Prefetching runs longer than 32 KiB, or into L1, measured slower.

Per-call overhead of a 64-byte copy (one tensor, one run): 0.245 us median (0.24 us min; an empty
call into the extension costs 0.08 us).
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
    void kvdd_thread_stats(uint64_t out[4])
    int kvdd_auto_threads_allowed()

# ---- tuning (process-wide; read once per call) -----------------------------------------------------

#: Default bytes per call from which streaming stores are used (see the module docstring).
DEFAULT_STREAMING_THRESHOLD = 2 << 20
#: Default bytes per call from which threads=0 uses two threads.
DEFAULT_THREADS_THRESHOLD = 32 << 20
#: Default bytes per work item of the 2-thread path (0: total / 32, clamped to 256 KiB .. 1 MiB).
DEFAULT_CHUNK_SIZE = 0
#: Bytes per call from which the GIL is released (below it the copy is shorter than the release).
NOGIL_THRESHOLD = 32 << 10

cdef uint64_t _streaming_threshold = DEFAULT_STREAMING_THRESHOLD
cdef uint64_t _threads_threshold = DEFAULT_THREADS_THRESHOLD
cdef uint64_t _chunk_size = DEFAULT_CHUNK_SIZE
cdef uint64_t _nogil_threshold = NOGIL_THRESHOLD
cdef int _isa = kvdd_isa_best()

_ISA_NAMES = ("memcpy", "sse2", "avx2", "avx512")

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
    cdef Py_buffer vs, vd, vl
    cdef int held = 0  # buffers acquired so far (vs, vd, vl in that order)
    cdef Py_ssize_t J, j
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
        if K <= SMALL_K:
            r.pairs = r.small_pairs
        else:
            r.pairs = <kvdd_pair *>PyMem_RawMalloc(<size_t>K * sizeof(kvdd_pair))
            if r.pairs == NULL:
                raise MemoryError()
        if J <= SMALL_J:
            r.runs = r.small_runs
        else:
            r.runs = <int64_t *>PyMem_RawMalloc(<size_t>J * 3 * 8)
            if r.runs == NULL:
                raise MemoryError()
        _gather(&vs, r.runs, J)
        _gather(&vd, r.runs + J, J)
        _gather(&vl, r.runs + 2 * J, J)
    finally:
        if held >= 1:
            PyBuffer_Release(&vs)
        if held >= 2:
            PyBuffer_Release(&vd)
        if held >= 3:
            PyBuffer_Release(&vl)

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
    cdef const int64_t *so = r.runs
    cdef const int64_t *do = r.runs + J
    cdef const int64_t *ln = r.runs + 2 * J
    cdef uint64_t per_k = 0
    cdef int64_t n
    # (with no tensors the limits stay INT64_MAX: offsets and lengths are still checked for sign and
    # overflow)
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
    r.total = per_k * <uint64_t>K

    r.job.pairs = r.pairs
    r.job.K = <size_t>K
    r.job.soff = so
    r.job.doff = do
    r.job.len = ln
    r.job.J = <size_t>J
    r.job.per_k = per_k
    r.job.isa = _isa
    r.job.stream = _isa != KVDD_ISA_MEMCPY and r.total >= _streaming_threshold
    r.job.chunk = _chunk_size
    r.job.threads = 1
    if r.total > 0 and (threads == 2 or (threads == 0 and r.total >= _threads_threshold
                                          and kvdd_auto_threads_allowed())):
        if kvdd_job_independent(&r.job):
            r.job.threads = 2
    return r


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
        0: automatic (two threads from ``get_threads_threshold()`` bytes, when a CPU is free and no
        recent 2-thread call stalled); 1: the calling thread only; 2: two threads. Two threads only
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
    / AVX2 / SSE2 chosen at run time) for non-overlapping runs of at least 512 bytes. The GIL is
    released for calls of at least ``NOGIL_THRESHOLD`` bytes.
    """
    cdef _Request r = _prepare(src, dst, src_off, dst_off, length, threads)
    cdef uint64_t done
    if r.total == 0:
        return 0
    if r.total < _nogil_threshold and r.job.threads == 1:
        done = kvdd_job_run(&r.job)
    else:
        with nogil:
            done = kvdd_job_run(&r.job)
    return done


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


# ---- configuration ---------------------------------------------------------------------------------

def cpu_features():
    """CPU features checked at run time (``{"avx2": True, ...}``), for ``kvdd doctor``."""
    return {kvdd_cpu_feature_name(i).decode(): bool(kvdd_cpu_feature_value(i))
            for i in range(kvdd_cpu_feature_count())}


def thread_stats():
    """Counters of the 2-thread path since import: ``calls``, ``chunks`` (work items) and
    ``helper_chunks`` (those done by the second thread; the rest ran on the calling thread)."""
    cdef uint64_t out[4]
    kvdd_thread_stats(out)
    return {"calls": out[0], "chunks": out[1], "helper_chunks": out[2], "stalls": out[3]}


def available_isas():
    """Streaming implementations usable on this CPU, best last (``"memcpy"`` = regular stores)."""
    cdef unsigned m = kvdd_isa_mask()
    return [name for i, name in enumerate(_ISA_NAMES) if m & (1u << i)]


def get_isa():
    """The streaming implementation used for calls at or above the streaming threshold."""
    return _ISA_NAMES[_isa]


def set_isa(name):
    """Select the streaming implementation (``"avx512"``, ``"avx2"``, ``"sse2"``, ``"memcpy"`` or
    ``"best"``); returns the previous one. Raises ValueError for one this CPU cannot run."""
    global _isa
    prev = _ISA_NAMES[_isa]
    if name == "best":
        _isa = kvdd_isa_best()
        return prev
    if name not in _ISA_NAMES:
        raise ValueError(f"set_isa: unknown implementation {name!r}; choose from {_ISA_NAMES + ('best',)}")
    cdef int i = _ISA_NAMES.index(name)
    if not (kvdd_isa_mask() & (1u << i)):
        raise ValueError(f"set_isa: this CPU cannot run {name!r}; available: {available_isas()}")
    _isa = i
    return prev


cdef uint64_t _threshold_arg(object nbytes, str what) except? 0:
    n = PyNumber_Index(nbytes)
    if n < 0:
        raise ValueError(f"{what}: threshold must be >= 0 bytes, not {n}")
    return min(n, 1 << 62)


def get_streaming_threshold():
    """Bytes per call from which :func:`copy_runs` uses streaming stores."""
    return _streaming_threshold


def set_streaming_threshold(nbytes):
    """Set the streaming threshold in bytes (0: always stream); returns the previous value."""
    global _streaming_threshold
    prev = _streaming_threshold
    _streaming_threshold = _threshold_arg(nbytes, "set_streaming_threshold")
    return prev


def get_threads_threshold():
    """Bytes per call from which ``threads=0`` uses two threads."""
    return _threads_threshold


def set_threads_threshold(nbytes):
    """Set the automatic 2-thread threshold in bytes (0: always); returns the previous value."""
    global _threads_threshold
    prev = _threads_threshold
    _threads_threshold = _threshold_arg(nbytes, "set_threads_threshold")
    return prev


def get_chunk_size():
    """Bytes per work item of the 2-thread path (0: automatic)."""
    return _chunk_size


def set_chunk_size(nbytes):
    """Set the bytes per work item of the 2-thread path (0: automatic); returns the previous value."""
    global _chunk_size
    prev = _chunk_size
    _chunk_size = _threshold_arg(nbytes, "set_chunk_size")
    return prev
