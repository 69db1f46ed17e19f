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


include "_copy_request.pxi"


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
