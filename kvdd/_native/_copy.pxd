# The C-level interface of kvdd._native._copy, for the compiled transfer path
# (kvdd/_native/_fastpath.pyx): region tables, copies between them, and the block-run grouping.
from libc.stdint cimport int64_t, uint64_t, uintptr_t


cdef class RegionTable:
    cdef uintptr_t *addrs         # n region addresses
    cdef readonly Py_ssize_t n
    cdef readonly Py_ssize_t nbytes  # the smallest region's size (0 without regions)
    cdef tuple _regions           # keeps the regions and their owners alive
    cdef readonly Py_ssize_t inflight  # leases held
    cdef readonly bint closed     # new leases refused
    cdef object _drained          # set when closed and the last lease ends

    cdef bint take(self) noexcept
    cdef int give(self) except -1


cdef uint64_t copy_table_runs(RegionTable src, Py_ssize_t s_first, RegionTable dst, Py_ssize_t d_first,
                              Py_ssize_t K, const int64_t *so, const int64_t *do, const int64_t *ln,
                              Py_ssize_t J) except? 0

cdef Py_ssize_t group_runs(const uint64_t *s, const uint64_t *d, Py_ssize_t n, uint64_t *s0, uint64_t *d0,
                           uint64_t *ln, uint64_t *s_last, uint64_t *d_last, uint64_t *dmax) noexcept nogil

cdef int byte_plan(const uint64_t *s0, const uint64_t *d0, const uint64_t *ln, Py_ssize_t n, int64_t block,
                   int64_t tail, int64_t *so, int64_t *do, int64_t *nb, uint64_t *total, uint64_t *s_end,
                   uint64_t *d_end) noexcept nogil

cdef uint64_t copy_trusted_runs(const int64_t *so, const int64_t *do, const int64_t *ln, Py_ssize_t J,
                                uint64_t call_bytes) noexcept nogil
