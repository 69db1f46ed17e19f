# Included by _copy.pyx (one module): the block runs of small PullKvBlocks / PushKvBlocks requests
# planned in C (kvdd/sim/runs.py keeps the numpy path for large ones and the checks' order). A block
# request of 8 pairs spent ~20 us of Python per call grouping its runs and computing their byte
# offsets and bounds, more with the interpreter's caches cold after the previous copy.

from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsUnsignedLongLong, PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint64_t as u64

import numpy as _np

#: The most block pairs :func:`group_small_runs` plans (larger requests: numpy).
GROUP_SMALL_RUNS_MAX = 256


cdef object _u64_list(const u64 *v, Py_ssize_t n):
    cdef list out = PyList_New(n)
    cdef Py_ssize_t i
    cdef object x
    for i in range(n):
        x = PyLong_FromUnsignedLongLong(v[i])
        Py_INCREF(x)
        PyList_SET_ITEM(out, i, x)
    return out


cdef int _as_u64(object seq, u64 *out, Py_ssize_t n) except -1:
    """Items of `seq` (a list or tuple of `n` items) as uint64; 1 when every item is an int in
    [0, 2**64), else 0 (nothing raised: the caller falls back)."""
    cdef Py_ssize_t i
    cdef object item
    for i in range(n):
        item = seq[i]
        if type(item) is not int or item < 0:
            return 0
        out[i] = PyLong_AsUnsignedLongLong(item)  # raises OverflowError past 2**64 - 1
    return 1


def group_small_runs(src, dst, Py_ssize_t max_pairs):
    """The maximal runs of block pairs ``(src[i], dst[i])`` in which both indices step by +1 (uint64:
    2**64 - 1 is followed by 0), as Python int lists ``(s0, d0, ln, s_last, d_last)`` (first source
    and destination block, length in blocks, last source and destination block of each run) and
    ``d_max`` (the largest destination block); None when the request is not 1 to `max_pairs` pairs of
    equal-length lists or tuples of ints in [0, 2**64) (then the caller plans it with numpy); at most
    ``GROUP_SMALL_RUNS_MAX`` pairs."""
    if type(src) not in (list, tuple) or type(dst) not in (list, tuple):
        return None
    cdef Py_ssize_t n = len(src), r
    if n == 0 or n > max_pairs or n > 256 or len(dst) != n:
        return None
    cdef u64 s[256]
    cdef u64 d[256]
    try:
        if not _as_u64(src, s, n) or not _as_u64(dst, d, n):
            return None
    except OverflowError:
        return None
    cdef u64 cols[5][256]  # s0, d0, ln, s_last, d_last
    cdef u64 dmax
    r = group_runs(s, d, n, cols[0], cols[1], cols[2], cols[3], cols[4], &dmax)
    return (_u64_list(cols[0], r), _u64_list(cols[1], r), _u64_list(cols[2], r), _u64_list(cols[3], r),
            _u64_list(cols[4], r), PyLong_FromUnsignedLongLong(dmax))


cdef Py_ssize_t group_runs(const u64 *s, const u64 *d, Py_ssize_t n, u64 *s0, u64 *d0, u64 *ln,
                           u64 *s_last, u64 *d_last, u64 *dmax) noexcept nogil:
    """Group `n` >= 1 block pairs into maximal runs in which both indices step by +1 (uint64
    arithmetic: 2**64 - 1 is followed by 0): each run's first source and destination block, length
    in blocks, last source and destination block; the largest destination block in `dmax`. Returns
    the number of runs (the columns hold at least `n` items)."""
    cdef Py_ssize_t i, r = 0
    cdef u64 run = 1
    dmax[0] = d[0]
    s0[0] = s[0]
    d0[0] = d[0]
    for i in range(1, n):
        if d[i] > dmax[0]:
            dmax[0] = d[i]
        if s[i] == s[i - 1] + 1 and d[i] == d[i - 1] + 1:  # uint64 arithmetic wraps
            run += 1
            continue
        ln[r] = run
        s_last[r] = s[i - 1]
        d_last[r] = d[i - 1]
        r += 1
        s0[r] = s[i]
        d0[r] = d[i]
        run = 1
    ln[r] = run
    s_last[r] = s[n - 1]
    d_last[r] = d[n - 1]
    return r + 1


def small_byte_plan(list s0, list d0, list ln, block, tail):
    """The byte runs of block runs (lists of ints < 2**32, as checked before): ``(src_off, dst_off,
    length, total, src_end, dst_end)``: three int64 arrays ``s0[i] * block``, ``d0[i] * block`` and
    ``ln[i] * block`` (the last `tail` bytes when `tail` > 0: the §3.11 quirk), their total and the
    largest ``src_off[i] + length[i]`` and ``dst_off[i] + length[i]``."""
    cdef Py_ssize_t n = len(ln), i
    if len(s0) != n or len(d0) != n or n == 0 or n > 256:
        raise ValueError("small_byte_plan: s0, d0 and ln must be non-empty lists of equal length <= 256")
    cdef int64_t b = block, t = tail
    if b < 0 or b >= (<int64_t>1 << 31) or t < 0:
        raise ValueError(f"small_byte_plan: block {block} / tail {tail} out of range")
    cdef u64 cols[3][256]
    for i in range(n):
        cols[0][i] = PyLong_AsUnsignedLongLong(s0[i])
        cols[1][i] = PyLong_AsUnsignedLongLong(d0[i])
        cols[2][i] = PyLong_AsUnsignedLongLong(ln[i])
    a = _np.empty((3, n), dtype=_np.int64)
    cdef int64_t[:, ::1] v = a
    cdef u64 total, se, de
    cdef int err = byte_plan(cols[0], cols[1], cols[2], n, b, t, &v[0, 0], &v[1, 0], &v[2, 0], &total, &se, &de)
    if err:
        raise ValueError("small_byte_plan: block index or run length >= 2**32" if err == 1 else
                         "small_byte_plan: total length overflows int64")
    return a[0], a[1], a[2], PyLong_FromUnsignedLongLong(total), PyLong_FromUnsignedLongLong(se), \
        PyLong_FromUnsignedLongLong(de)


cdef int byte_plan(const u64 *s0, const u64 *d0, const u64 *ln, Py_ssize_t n, int64_t block, int64_t tail,
                   int64_t *so, int64_t *do, int64_t *nb, u64 *total, u64 *s_end, u64 *d_end) noexcept nogil:
    """The byte runs of `n` block runs (§3.11 step 11, §3.13): ``so = s0 * block``, ``do = d0 *
    block``, ``nb = ln * block`` (the last run `tail` bytes when `tail` > 0: the §3.11 quirk), their
    total and the largest ``so + nb`` and ``do + nb``. `block` must lie in [0, 2**31). Returns 0, 1
    when an index or run length is >= 2**32, 2 when the total passes int64 (nothing meaningful is
    written then)."""
    cdef Py_ssize_t i
    cdef u64 t = 0, se = 0, de = 0
    for i in range(n):
        if s0[i] >= (<u64>1 << 32) or d0[i] >= (<u64>1 << 32) or ln[i] >= (<u64>1 << 32):
            return 1
        so[i] = <int64_t>s0[i] * block
        do[i] = <int64_t>d0[i] * block
        nb[i] = tail if (tail > 0 and i == n - 1) else <int64_t>ln[i] * block
        if t > <u64>INT64_MAX - <u64>nb[i]:
            return 2
        t += <u64>nb[i]
        if <u64>so[i] + <u64>nb[i] > se:
            se = <u64>so[i] + <u64>nb[i]
        if <u64>do[i] + <u64>nb[i] > de:
            de = <u64>do[i] + <u64>nb[i]
    total[0] = t
    s_end[0] = se
    d_end[0] = de
    return 0
