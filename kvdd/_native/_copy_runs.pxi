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
    cdef Py_ssize_t n = len(src), i, r = 0
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
    cdef u64 dmax = d[0], run = 1
    cols[0][0] = s[0]
    cols[1][0] = d[0]
    for i in range(1, n):
        if d[i] > dmax:
            dmax = d[i]
        if s[i] == s[i - 1] + 1 and d[i] == d[i - 1] + 1:  # uint64 arithmetic wraps
            run += 1
            continue
        cols[2][r] = run
        cols[3][r] = s[i - 1]
        cols[4][r] = d[i - 1]
        r += 1
        cols[0][r] = s[i]
        cols[1][r] = d[i]
        run = 1
    cols[2][r] = run
    cols[3][r] = s[n - 1]
    cols[4][r] = d[n - 1]
    r += 1
    return (_u64_list(cols[0], r), _u64_list(cols[1], r), _u64_list(cols[2], r), _u64_list(cols[3], r),
            _u64_list(cols[4], r), PyLong_FromUnsignedLongLong(dmax))


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
    a = _np.empty((3, n), dtype=_np.int64)
    cdef int64_t[:, ::1] v = a
    cdef int64_t so, do, nb
    cdef u64 x, total = 0, se = 0, de = 0
    for i in range(n):
        x = PyLong_AsUnsignedLongLong(s0[i])
        if x >= (<u64>1 << 32):
            raise ValueError("small_byte_plan: block index >= 2**32")
        so = <int64_t>x * b
        x = PyLong_AsUnsignedLongLong(d0[i])
        if x >= (<u64>1 << 32):
            raise ValueError("small_byte_plan: block index >= 2**32")
        do = <int64_t>x * b
        x = PyLong_AsUnsignedLongLong(ln[i])
        if x >= (<u64>1 << 32):
            raise ValueError("small_byte_plan: run length >= 2**32")
        nb = t if (t > 0 and i == n - 1) else <int64_t>x * b
        v[0, i] = so
        v[1, i] = do
        v[2, i] = nb
        if total > <u64>INT64_MAX - <u64>nb:
            raise ValueError("small_byte_plan: total length overflows int64")
        total += <u64>nb
        if <u64>so + <u64>nb > se:
            se = <u64>so + <u64>nb
        if <u64>do + <u64>nb > de:
            de = <u64>do + <u64>nb
    return a[0], a[1], a[2], PyLong_FromUnsignedLongLong(total), PyLong_FromUnsignedLongLong(se), \
        PyLong_FromUnsignedLongLong(de)
