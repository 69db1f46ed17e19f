# The C-level interface of kvdd/_native/_xproc.pyx for the compiled transfer path
# (kvdd/sim/_fastpath.pyx cimports SameHostMover).
from libc.stdint cimport int64_t, uint64_t, uintptr_t

from kvdd._native._copy cimport RegionTable


cdef void forget_failure() noexcept nogil


cdef class LeaseTable:
    cdef uint64_t *base
    cdef size_t size
    cdef readonly Py_ssize_t slots

    cdef uint64_t *_slot(self, Py_ssize_t slot) except NULL


cdef class SameHostMover:
    cdef object reader            # the OneSidedPeer: its usable flag and its fds' copy count
    cdef LeaseTable table
    cdef dict slot_of             # cache id -> slot
    cdef int mem_fd
    cdef int pidfd
    cdef int pid
    cdef int64_t max_lease_ms
    cdef uint64_t chunk
    cdef readonly uint64_t moved
    cdef Py_ssize_t copies        # copies using the fds now (the GIL guards it)
    cdef bint closing
    cdef object maps              # PeerMaps: the owner's cache memory mapped here, or None

    cdef int move(self, object rc, object addrs, RegionTable lt, bint pull, Py_ssize_t l_first,
                  Py_ssize_t r_first, Py_ssize_t K, const int64_t *l_off, const int64_t *r_off,
                  const int64_t *ln, Py_ssize_t J, int64_t wait_ms) except -9
    cdef int _move(self, object rc, object addrs, RegionTable lt, bint pull, Py_ssize_t l_first,
                   Py_ssize_t r_first, Py_ssize_t K, const int64_t *l_off, const int64_t *r_off,
                   const int64_t *ln, Py_ssize_t J, int64_t wait_ms, Py_ssize_t slot,
                   uintptr_t *addr) except -9
