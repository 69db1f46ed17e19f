# Included by _xproc.pyx (at its end): the per-link lease table of the same-host path, in shared memory.

# ---- a per-link lease table in shared memory -------------------------------------------------------

cdef enum:
    _HDR_BYTES = 64
    _SLOT_BYTES = 64
    _MAX_SLOTS = 65536

#: Bytes of the table header and of one slot (a cache line each, so slots never share one).
LEASE_HEADER = _HDR_BYTES
LEASE_SLOT = _SLOT_BYTES
#: First word of a table: b"KVDDLEAS" little-endian.
LEASE_MAGIC = 0x5341454C4444564B
#: Largest slot count a table may have (one slot per cache visible over the link).
LEASE_MAX_SLOTS = _MAX_SLOTS

# word indices: header [0] magic, [1] slot count, [2] link state; slot [0] in-flight, [1] state
cdef enum:
    _H_MAGIC = 0
    _H_SLOTS = 1
    _H_STATE = 2
    _S_INFLIGHT = 0
    _S_STATE = 1


cdef class LeaseTable:
    """One link's lease table, mapped from a shared-memory file descriptor (a sealed memfd).

    Layout (64-bit little-endian words): header ``[magic, slots, link_state]`` in the first 64
    bytes, then one 64-byte slot per cache, ``[in_flight, state]``.  The reader of a one-sided
    transfer calls :meth:`enter` (in-flight += 1, then reads both states; a nonzero state undoes
    the increment and is returned), copies, then :meth:`leave`.  The owner calls :meth:`revoke`
    (state := nonzero, so no new copy starts) and then :meth:`wait_idle` until the in-flight count
    is zero.  All operations are sequentially consistent, so a reader whose increment the owner
    did not see must see the owner's state store.

    Both processes can write the table: every value read from it is untrusted (an in-flight count
    may be garbage; :meth:`wait_idle` then waits until its deadline, never past it).  Slot indices
    are checked against the slot count this process mapped, never against the header.

    Parameters
    ----------
    fd : int
        The shared memory (``memfd_create``); the mapping keeps its own reference.
    slots : int
        Slot count; the mapping is ``LEASE_HEADER + slots * LEASE_SLOT`` bytes and the file must
        be at least that large (checked by the caller, who also checks the seals).
    init : bool
        True for the owner creating the table: writes the header and zeroes the slots.
    """

    def __cinit__(self, int fd, Py_ssize_t slots, bint init=False):
        self.base = NULL
        if slots < 0 or slots > _MAX_SLOTS:
            raise ValueError(f"LeaseTable: {slots} slots (at most {LEASE_MAX_SLOTS})")
        self.slots = slots
        self.size = <size_t>(_HDR_BYTES + slots * _SLOT_BYTES)
        cdef void *p
        cdef int err = 0
        with nogil:
            p = mmap(NULL, self.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                err = errno
        if p == MAP_FAILED:
            raise OSError(err, f"LeaseTable: mmap: {strerror(err).decode(errors='replace')}")
        self.base = <uint64_t *>p
        cdef Py_ssize_t i
        if init:
            for i in range(1, <Py_ssize_t>(self.size // 8)):
                kvdd_store(&self.base[i], 0)
            kvdd_store(&self.base[_H_SLOTS], <uint64_t>slots)
            kvdd_store(&self.base[_H_MAGIC], <uint64_t>0x5341454C4444564B)

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

    def close(self) -> None:
        """Unmap (further calls raise ValueError).  Not while another thread uses the table."""
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

    cdef uint64_t *_slot(self, Py_ssize_t slot) except NULL:
        if self.base == NULL:
            raise ValueError("LeaseTable is closed")
        if slot < 0 or slot >= self.slots:
            raise IndexError(f"lease slot {slot} out of range [0, {self.slots})")
        return self.base + (_HDR_BYTES + slot * _SLOT_BYTES) // 8

    def header(self) -> tuple[int, int, int]:
        """``(magic, slots, link_state)`` as currently stored (untrusted values)."""
        if self.base == NULL:
            raise ValueError("LeaseTable is closed")
        return (kvdd_load(&self.base[_H_MAGIC]), kvdd_load(&self.base[_H_SLOTS]),
                kvdd_load(&self.base[_H_STATE]))

    def load_header(self, int word) -> int:
        """Header word ``word`` (3..7: labels; 3: the owner's memory announcement) as stored."""
        if self.base == NULL:
            raise ValueError("LeaseTable is closed")
        if word < 3 or word >= _HDR_BYTES // 8:
            raise ValueError("word must lie in [3, 8)")
        return kvdd_load(&self.base[word])

    def store_header(self, int word, uint64_t value) -> None:
        """Store ``value`` in header word ``word`` (3..7)."""
        if self.base == NULL:
            raise ValueError("LeaseTable is closed")
        if word < 3 or word >= _HDR_BYTES // 8:
            raise ValueError("word must lie in [3, 8)")
        kvdd_store(&self.base[word], value)

    def enter(self, Py_ssize_t slot) -> int:
        """Reader: count one transfer in flight on ``slot``, then check the states.

        Returns 0 (go ahead; call :meth:`leave` afterwards) or the nonzero state that forbids a
        new copy (the increment is already undone): the slot's state when nonzero, else the
        link's."""
        cdef uint64_t *s = self._slot(slot)
        cdef uint64_t st
        kvdd_add(&s[_S_INFLIGHT], 1)
        st = kvdd_load(&s[_S_STATE])
        if st == 0:
            st = kvdd_load(&self.base[_H_STATE])
        if st != 0:
            kvdd_sub(&s[_S_INFLIGHT], 1)
        return st

    def leave(self, Py_ssize_t slot) -> None:
        """Reader: the transfer counted by :meth:`enter` is over."""
        cdef uint64_t *s = self._slot(slot)
        kvdd_sub(&s[_S_INFLIGHT], 1)

    def revoke(self, Py_ssize_t slot, uint64_t state=1) -> None:
        """Owner: no new copy may start on ``slot`` (``slot = -1``: on the whole link)."""
        if slot == -1:
            if self.base == NULL:
                raise ValueError("LeaseTable is closed")
            kvdd_store(&self.base[_H_STATE], state)
            return
        cdef uint64_t *s = self._slot(slot)
        kvdd_store(&s[_S_STATE], state)

    def state(self, Py_ssize_t slot) -> int:
        """The state word of ``slot`` (``-1``: the link's)."""
        if slot == -1:
            if self.base == NULL:
                raise ValueError("LeaseTable is closed")
            return kvdd_load(&self.base[_H_STATE])
        return kvdd_load(&self._slot(slot)[_S_STATE])

    def inflight(self, Py_ssize_t slot) -> int:
        """The in-flight count of ``slot`` as stored (a garbage value reads as it is)."""
        return kvdd_load(&self._slot(slot)[_S_INFLIGHT])

    def compare_exchange(self, Py_ssize_t slot, int word, uint64_t expected,
                         uint64_t desired) -> bool:
        """Atomic compare-and-swap of word ``word`` (0..7; 0: in-flight, 1: state) of ``slot``."""
        if word < 0 or word >= _SLOT_BYTES // 8:
            raise ValueError("word must lie in [0, 8)")
        return bool(kvdd_cas(&self._slot(slot)[word], expected, desired))

    def load(self, Py_ssize_t slot, int word) -> int:
        """Word ``word`` (0..7) of ``slot`` (2: the cache id the owner labelled it with)."""
        if word < 0 or word >= _SLOT_BYTES // 8:
            raise ValueError("word must lie in [0, 8)")
        return kvdd_load(&self._slot(slot)[word])

    def store(self, Py_ssize_t slot, int word, uint64_t value) -> None:
        """Store ``value`` in word ``word`` (2..7: labels; 0 and 1 have their own methods)."""
        if word < 2 or word >= _SLOT_BYTES // 8:
            raise ValueError("word must lie in [2, 8)")
        kvdd_store(&self._slot(slot)[word], value)

    def wait_idle(self, slot, int timeout_ms, int pidfd=-1) -> int:
        """Owner: wait (GIL released) until no transfer is in flight on ``slot`` (``None``: on
        any slot).

        Returns 0 when idle, 1 when the reader process (pidfd ``pidfd``) exited (its counts are
        void), 2 when ``timeout_ms`` passed first.  Polls with a growing pause (1 µs to 1 ms)."""
        cdef Py_ssize_t lo = 0, hi = self.slots, i
        if slot is not None:
            self._slot(slot)
            lo = slot
            hi = lo + 1
        elif self.base == NULL:
            raise ValueError("LeaseTable is closed")
        cdef int64_t deadline = _now_ns() + <int64_t>max(timeout_ms, 0) * 1000000
        cdef long pause = 1000
        cdef int result = 0
        cdef bint busy
        cdef uint64_t *b = self.base
        with nogil:
            while True:
                busy = False
                for i in range(lo, hi):
                    if kvdd_load(&b[(_HDR_BYTES + i * _SLOT_BYTES) // 8 + _S_INFLIGHT]) != 0:
                        busy = True
                        break
                if not busy:
                    result = 0
                    break
                if pidfd >= 0 and _pidfd_exited(pidfd):
                    result = 1
                    break
                if _now_ns() >= deadline:
                    result = 2
                    break
                kvdd_pause_ns(pause)
                if pause < 1000000:
                    pause *= 2
        return result
