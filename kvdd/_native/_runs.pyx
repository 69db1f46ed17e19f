# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False, auto_pickle=False
"""Compiled helpers for long lists of block indices (a 1024-block PullKvBlocks / PushKvBlocks).

The facade checks every index of ``src_blocks`` / ``dst_blocks`` (:func:`kvdd.widths.check_int_seq`)
and the simulator groups the pairs into runs (:class:`kvdd.sim.runs.Runs`, SEMANTICS.md §3.11 step
7).  In Python both cost a few hundred microseconds for 1024 indices, more right after a large copy
has evicted the interpreter's data from the caches: about 6% of a 64 MiB same-host block pull.
Here each is one pass in C: :func:`ints_within` (the check), :func:`block_runs` (the grouping,
with each column's maximum for the bound checks), :func:`byte_runs` (the byte plan, with exact or
saturated sums) and :func:`sum_int64`.

The first two only ever answer for the common case (a ``list`` or ``tuple`` of exact ``int``); for
anything else they return ``False`` / ``None`` and the caller takes its general path, which gives
the same results and every error message.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.list cimport PyList_CheckExact
from cpython.tuple cimport PyTuple_CheckExact
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint64_t

import numpy as np

_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

cdef extern from "Python.h":
    PyObject *PySequence_Fast_GET_ITEM(object o, Py_ssize_t i)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    # declared here without an exception value: the caller checks PyErr_Occurred itself
    unsigned long long PyLong_AsUnsignedLongLong(object o)


cdef inline int _as_u64(object v, uint64_t *out) noexcept:
    """``v`` (an exact int) as uint64: 1, or 0 when it is negative or above 2**64-1."""
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow == 0:
        if x < 0:
            return 0
        out[0] = <uint64_t>x
        return 1
    if overflow < 0:
        return 0
    cdef unsigned long long u = PyLong_AsUnsignedLongLong(v)
    if u == <unsigned long long>-1 and PyErr_Occurred() != NULL:
        PyErr_Clear()
        return 0
    out[0] = <uint64_t>u
    return 1


def ints_within(seq: object, lo: int, hi: int) -> bool:
    """True when `seq` is a ``list`` or ``tuple`` of exact ``int`` (``bool`` excluded), each in
    ``[lo, hi]``; False otherwise (including every case the caller must look at item by item).

    ``lo`` must be 0 or at least -2**63, ``hi`` at most 2**64-1; other bounds give False.
    """
    if not (PyList_CheckExact(seq) or PyTuple_CheckExact(seq)):
        return False
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
    cdef object v
    cdef uint64_t u, ulo, uhi
    cdef long long x, slo, shi
    cdef int overflow
    if lo >= 0:
        if hi > _U64_MAX:
            return False
        ulo = lo
        uhi = hi
        for i in range(n):
            v = <object>PySequence_Fast_GET_ITEM(seq, i)
            if not PyLong_CheckExact(v) or not _as_u64(v, &u) or u < ulo or u > uhi:
                return False
        return True
    if lo < _I64_MIN or hi > _I64_MAX:
        return False
    slo = lo
    shi = hi
    for i in range(n):
        v = <object>PySequence_Fast_GET_ITEM(seq, i)
        if not PyLong_CheckExact(v):
            return False
        overflow = 0
        x = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow != 0 or x < slo or x > shi:
            return False
    return True


cdef int _fill(object seq, uint64_t[::1] out) noexcept:
    cdef Py_ssize_t i
    cdef object v
    cdef uint64_t u
    for i in range(out.shape[0]):
        v = <object>PySequence_Fast_GET_ITEM(seq, i)
        if not PyLong_CheckExact(v) or not _as_u64(v, &u):
            return 0
        out[i] = u
    return 1


def block_runs(src: object, dst: object) -> tuple | None:
    """SEMANTICS.md §3.11 step 7: the pairs ``(src[i], dst[i])`` grouped into maximal runs where both
    indices step by +1 (uint64, wrapping as in C), in list order.

    Returns
    -------
    (s0, d0, ln, s_last, d_last, d_max, maxima) or None
        Per run: first source and destination block (uint64 arrays), length in blocks (int64
        array), last source and destination block (uint64 arrays); ``d_max`` the largest
        destination block (int); ``maxima`` the largest value of each of the five arrays, in that
        order (ints: the bound checks and the longest run without another pass).  None when `src` and `dst` are not both non-empty ``list`` /
        ``tuple`` of exact ``int`` in ``[0, 2**64-1]`` of equal length.
    """
    if not ((PyList_CheckExact(src) or PyTuple_CheckExact(src)) and
            (PyList_CheckExact(dst) or PyTuple_CheckExact(dst))):
        return None
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(src)
    if n == 0 or PySequence_Fast_GET_SIZE(dst) != n:
        return None
    # one allocation: the two index columns (scratch), then the five run columns
    buf = np.empty((7, n), dtype=np.uint64)
    cdef uint64_t[::1] sa = buf[0], da = buf[1]
    if not _fill(src, sa) or not _fill(dst, da):
        return None
    s0_, d0_, sl_, dl_ = buf[2], buf[3], buf[5], buf[6]
    ln_ = buf[4].view(np.int64)
    cdef uint64_t[::1] s0 = s0_, d0 = d0_, sl = sl_, dl = dl_
    cdef int64_t[::1] ln = ln_
    cdef Py_ssize_t i, m = 0
    cdef int64_t run = 1
    cdef uint64_t dmax = da[0]
    s0[0] = sa[0]
    d0[0] = da[0]
    with nogil:
        for i in range(1, n):
            if da[i] > dmax:
                dmax = da[i]
            if sa[i] == sa[i - 1] + 1 and da[i] == da[i - 1] + 1:
                run += 1
                continue
            ln[m] = run
            sl[m] = sa[i - 1]
            dl[m] = da[i - 1]
            m += 1
            s0[m] = sa[i]
            d0[m] = da[i]
            run = 1
        ln[m] = run
        sl[m] = sa[n - 1]
        dl[m] = da[n - 1]
        m += 1
    cdef uint64_t s0_max = 0, d0_max = 0, sl_max = 0, dl_max = 0
    cdef int64_t ln_max = 0
    with nogil:
        for i in range(m):
            if s0[i] > s0_max:
                s0_max = s0[i]
            if d0[i] > d0_max:
                d0_max = d0[i]
            if sl[i] > sl_max:
                sl_max = sl[i]
            if dl[i] > dl_max:
                dl_max = dl[i]
            if ln[i] > ln_max:
                ln_max = ln[i]
    return (s0_[:m], d0_[:m], ln_[:m], sl_[:m], dl_[:m], int(dmax),
            (int(s0_max), int(d0_max), int(ln_max), int(sl_max), int(dl_max)))


cdef extern from *:
    """
    #include <stdint.h>
    /* a * b + c in uint64, UINT64_MAX when it does not fit (GCC/Clang overflow builtins) */
    static inline uint64_t kvdd_sat_muladd(uint64_t a, uint64_t b, uint64_t c) {
        uint64_t r;
        if (__builtin_mul_overflow(a, b, &r) || __builtin_add_overflow(r, c, &r)) return UINT64_MAX;
        return r;
    }
    """
    uint64_t kvdd_sat_muladd(uint64_t a, uint64_t b, uint64_t c) noexcept nogil


def byte_runs(s0: object, d0: object, ln: object, block: int, tail: int) -> tuple:
    """The byte plan of block runs in one pass: ``s0 * block``, ``d0 * block`` and ``ln * block`` as
    int64 arrays, the last length `tail` when `tail` > 0 (the §3.11 quirk), then ``sum(length)``
    and the largest ``src_off + length`` and ``dst_off + length``.

    The three sums are exact (ints), or ``2**64 - 1`` when a value does not fit 64 bits, so a bound
    check ``end > tensor_nbytes`` always refuses a run that does not fit; an offset or length of
    2**63 or more (then refused that way) is stored wrapped.  `s0`, `d0`: uint64 arrays, `ln`:
    int64 (>= 0), of equal length >= 1; `block` and `tail` >= 0."""
    cdef const uint64_t[:] s = s0, d = d0
    cdef const int64_t[:] n = ln
    cdef Py_ssize_t m = n.shape[0], i
    if s.shape[0] != m or d.shape[0] != m or m == 0:
        raise ValueError("byte_runs: s0, d0 and ln must have the same length >= 1")
    if block < 0 or tail < 0 or block > _I64_MAX or tail > _I64_MAX:
        raise ValueError(f"byte_runs: block {block} / tail {tail} out of range")
    buf = np.empty((3, m), dtype=np.int64)
    cdef int64_t[::1] so = buf[0], do = buf[1], lo = buf[2]
    cdef uint64_t b = <uint64_t>block, last = <uint64_t>tail
    cdef uint64_t tot = 0, s_end = 0, d_end = 0, xs, xd, xl, e
    with nogil:
        for i in range(m):
            xs = kvdd_sat_muladd(s[i], b, 0)
            xd = kvdd_sat_muladd(d[i], b, 0)
            xl = last if (last > 0 and i == m - 1) else kvdd_sat_muladd(<uint64_t>n[i], b, 0)
            so[i] = <int64_t>xs
            do[i] = <int64_t>xd
            lo[i] = <int64_t>xl
            tot = kvdd_sat_muladd(1, tot, xl)
            e = kvdd_sat_muladd(1, xs, xl)
            if e > s_end:
                s_end = e
            e = kvdd_sat_muladd(1, xd, xl)
            if e > d_end:
                d_end = e
    return buf[0], buf[1], buf[2], tot, s_end, d_end


def sum_int64(a: object) -> int:
    """``int(a.sum())`` of an int64 array (wrapping as numpy's int64 sum does)."""
    cdef const int64_t[:] v = a
    cdef uint64_t t = 0
    cdef Py_ssize_t i
    with nogil:
        for i in range(v.shape[0]):
            t += <uint64_t>v[i]
    return <int64_t>t
