# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False, auto_pickle=False
"""The TCP fabric's receive side in C: a buffered frame reader and a small READ's staging buffer.

:class:`FrameReader` is the base of :class:`kvdd.sim.fabric.rx.Rx` (one per link connection; the
thread leading the connection's receive side reads every frame through it): frame headers are
checked against the protocol's magic, version and per-type length bounds (anything else is handed
to the ``bad_header`` callable given at construction, which raises the precise error), payloads
are returned as bytes or received straight into a destination buffer, and the socket is read with
``recv`` with the GIL released (EINTR retried after the signal handlers ran; a socket in timeout
mode falls back to its own ``recv_into``).  Memory per connection: the buffer given at
construction; a payload longer than the buffer grows with what arrives (1 MiB at a time).

:meth:`FrameReader.small_reply` is the caller's side of a small READ (``LEASE_READ``): it takes
the DATA and DONE frames of one request, and only those, checked exactly as the generic path
checks them, into a :class:`Stage`; whatever else comes first is left unread for the generic path.
The staged bytes reach the caller's memory (:meth:`Stage.land`) only once DONE said LLM_SUCCESS.
:func:`read_answer` builds the owner's answer to a one-run small READ (DATA + DONE) in one copy;
:func:`serve_one_run` is the owner's whole serve of such a request (the twin of
``kvdd.sim.fabric.small._serve_one_run``, which serves it when fault injections are armed).
"""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
cdef extern from "Python.h":
    int PyErr_CheckSignals()
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memmove

from kvdd._native._le cimport put32 as _put32, u32 as _u32

import os

cdef extern from "sys/socket.h" nogil:
    ssize_t c_recv "recv"(int fd, void* buf, size_t n, int flags)

__all__ = ["FrameReader", "Stage", "read_answer", "serve_one_run", "HEADER_SIZE", "F_DATA", "F_DONE",
           "F_LEASE_READ", "ONE_RUN_SIZE", "RECV_CHUNK"]

HEADER_SIZE = 12  # magic (2), version, type, request id (u32), payload length (u32); little-endian
F_DATA = 15
F_DONE = 16
F_LEASE_READ = 22
ONE_RUN_SIZE = 36  # a LEASE_READ payload of one tensor and one run: <QII Iqq
RECV_CHUNK = 1 << 20  # bytes asked of one recv when receiving straight into a destination
cdef enum:
    _HSIZE = 12
    _F_DATA = 15
    _F_DONE = 16
    _F_LEASE_READ = 22
    _ONE_RUN = 36
    _CHUNK = 1 << 20


cdef class FrameReader:
    """Buffered frame reader of one socket (not thread-safe: one reader at a time).

    Parameters
    ----------
    sock : socket.socket
        The connection (blocking, or in timeout mode).
    limits : Mapping[int, int]
        The largest payload (bytes) of each frame type; other types are refused.
    magic : bytes
        The 2-byte magic of every header.
    version : int
        The protocol version every header carries.
    bad_header : Callable[[bytes], object]
        Called with a refused header (12 bytes); raises the precise error.
    error : type[Exception]
        Raised when a peer sends more DATA than a :class:`Stage` holds.
    size : int
        Bytes buffered (and the largest payload :meth:`exact` returns from the buffer).
    """

    cdef readonly object sock
    cdef char* _p  # size bytes of our own (PyMem_Malloc, not zeroed: its pages are touched only
                   # as frames arrive, and only the bytes received are ever read)
    cdef Py_ssize_t _pos, _end, _cap
    cdef int64_t _limit[256]
    cdef uint8_t _m0, _m1, _version
    cdef object _bad
    cdef readonly object error
    cdef bint _busy  # a thread is inside a method (one reader at a time: a second is refused)
    cdef readonly bint interrupted  # a signal handler raised while this reader waited

    def __init__(self, sock, limits, bytes magic, int version, bad_header, error,
                 Py_ssize_t size=65536):
        cdef int i
        if len(magic) != 2 or not 0 <= version <= 255 or size < _HSIZE + 4:
            raise ValueError("bad frame reader configuration")
        self.sock = sock
        if self._p == NULL:  # (never resized: _p stays valid)
            self._p = <char*>PyMem_Malloc(<size_t>size)
            if self._p == NULL:
                raise MemoryError()
            self._cap = size
        elif size != self._cap:
            raise ValueError("a frame reader keeps its buffer size")
        self._pos = self._end = 0
        for i in range(256):
            self._limit[i] = -1
        for ftype, limit in limits.items():
            if not 0 <= ftype <= 255 or limit < 0:
                raise ValueError("bad frame limit")
            self._limit[ftype] = limit
        self._m0 = magic[0]
        self._m1 = magic[1]
        self._version = version
        self._bad = bad_header
        self.error = error
        self._busy = False
        self.interrupted = False

    def __dealloc__(self):
        PyMem_Free(self._p)

    cdef int _enter(self) except -1:
        if self._busy:
            raise RuntimeError("another thread is reading this connection")
        self._busy = True
        self.interrupted = False
        return 0

    @property
    def buffered(self):
        """Bytes received and not yet consumed."""
        return self._end - self._pos

    cdef Py_ssize_t _recv(self, char* dst, Py_ssize_t n) except -1:
        """Receive 1..n bytes into ``dst`` (blocking, GIL released); ConnectionError at the end."""
        cdef int fd, err
        cdef ssize_t got
        while True:
            fd = self.sock.fileno()
            if fd < 0:
                raise OSError(9, "Bad file descriptor")
            with nogil:
                got = c_recv(fd, dst, <size_t>n, 0)
                err = errno
            if got > 0:
                return got
            if got == 0:
                raise ConnectionError("connection closed by the peer")
            if err == EINTR:
                if PyErr_CheckSignals() < 0:  # a handler's exception propagates
                    self.interrupted = True
                    return -1
                continue
            if err == EAGAIN:  # timeout mode: the socket's own wait
                got = self.sock.recv_into(memoryview(<char[:n]>dst))
                if got == 0:
                    raise ConnectionError("connection closed by the peer")
                return got
            raise OSError(err, os.strerror(err))

    cdef int _fill(self, Py_ssize_t need) except -1:
        """At least ``need`` (<= the buffer size) bytes buffered, blocking until they arrive."""
        cdef Py_ssize_t n
        if self._end - self._pos >= need:
            return 0
        if self._pos:  # keep the unread rest at the start
            n = self._end - self._pos
            memmove(self._p, self._p + self._pos, <size_t>n)
            self._pos = 0
            self._end = n
        while self._end < need:
            self._end += self._recv(self._p + self._end, self._cap - self._end)
        return 0

    cdef inline bint _header_ok(self, const char* h) noexcept:
        cdef uint8_t ftype = <uint8_t>h[3]
        cdef int64_t limit = self._limit[ftype]
        return (<uint8_t>h[0] == self._m0 and <uint8_t>h[1] == self._m1
                and <uint8_t>h[2] == self._version and limit >= 0 and _u32(h + 8) <= limit)

    def header(self):
        """The next frame's ``(type, request id, length)``, checked (``bad_header`` raises)."""
        cdef const char* h
        self._enter()
        try:
            self._fill(_HSIZE)
            h = self._p + self._pos
            if not self._header_ok(h):
                self._bad(PyBytes_FromStringAndSize(h, _HSIZE))
                raise self.error("bad frame header")
            self._pos += _HSIZE
            return <uint8_t>h[3], _u32(h + 4), _u32(h + 8)
        finally:
            self._busy = False

    def exact(self, Py_ssize_t n):
        """The next ``n`` bytes (a payload of a checked length); memory grows with what arrives."""
        cdef bytes out
        cdef bytearray big
        cdef Py_ssize_t take
        self._enter()
        try:
            if n < 0:
                raise ValueError("negative length")
            if n <= self._cap:
                self._fill(n)
                out = PyBytes_FromStringAndSize(self._p + self._pos, n)
                self._pos += n
                return out
            big = bytearray(self._p[self._pos:self._end])
            self._pos = self._end = 0
            while len(big) < n:
                take = min(n - len(big), _CHUNK)
                chunk = bytearray(take)
                self._into(chunk)
                big += chunk
            return bytes(big)
        finally:
            self._busy = False

    def into(self, dst):
        """The next ``len(dst)`` bytes into the writable buffer ``dst``: what is buffered, then
        straight from the socket (at most RECV_CHUNK bytes asked of one recv)."""
        self._enter()
        try:
            self._into(dst)
        finally:
            self._busy = False

    cdef int _into(self, dst) except -1:
        cdef Py_buffer view
        cdef char* d
        cdef Py_ssize_t n, take
        PyObject_GetBuffer(dst, &view, PyBUF_WRITABLE)
        try:
            d = <char*>view.buf
            n = view.len
            take = min(self._end - self._pos, n)
            if take:
                memcpy(d, self._p + self._pos, <size_t>take)
                self._pos += take
                d += take
                n -= take
            while n:
                take = self._recv(d, min(n, <Py_ssize_t>_CHUNK))
                d += take
                n -= take
        finally:
            PyBuffer_Release(&view)
        return 0

    def discard(self, Py_ssize_t n):
        """Skip the next ``n`` bytes (received into this reader's own buffer)."""
        cdef Py_ssize_t have
        self._enter()
        try:
            if n < 0:
                raise ValueError("negative length")
            have = min(self._end - self._pos, n)
            self._pos += have
            n -= have
            if n:
                self._pos = self._end = 0  # the buffer is empty: use it as scratch
                while n > 0:
                    n -= self._recv(self._p, min(n, self._cap))
        finally:
            self._busy = False

    def small_reply(self, uint32_t req, Stage stage not None):
        """The answer to this end's small READ ``req``: its DATA frames go into ``stage`` and its
        DONE's status (0 .. 2**32-1) is returned.  -1 as soon as the next frame is anything else
        (another request's, a refused header, more DATA than ``stage`` lacks, a DONE whose
        payload is not 4 bytes): that frame is left unread, for the generic path to handle."""
        cdef const char* h
        cdef uint32_t length
        cdef uint8_t ftype
        cdef uint32_t status
        self._enter()
        try:
            while True:
                self._fill(_HSIZE)
                h = self._p + self._pos
                if not self._header_ok(h) or _u32(h + 4) != req:
                    return -1
                ftype = <uint8_t>h[3]
                length = _u32(h + 8)
                if ftype == _F_DATA:
                    if length > stage.left or length > self._cap - _HSIZE:
                        return -1
                    self._fill(_HSIZE + length)
                    memcpy(stage._p + (stage.size - stage.left), self._p + self._pos + _HSIZE, length)
                    stage.left -= length
                    self._pos += _HSIZE + length
                elif ftype == _F_DONE and length == 4:
                    self._fill(_HSIZE + 4)
                    status = _u32(self._p + self._pos + _HSIZE)
                    self._pos += _HSIZE + 4
                    return status
                else:
                    return -1
        finally:
            self._busy = False

    def serve_lease_read(self, grant, owner, served, Py_ssize_t small_bytes,
                         uint32_t param_invalid):
        """The owner's side: when the next frame is a LEASE_READ of one tensor and one run (of at
        most ``small_bytes``), consume it and serve it as :func:`serve_one_run` does:
        ``(request id, answer)``.  None, with nothing consumed, when it is anything else."""
        cdef const char* h
        cdef uint32_t req
        cdef uint8_t m[2]
        cdef char payload[_ONE_RUN]
        self._enter()
        try:
            self._fill(_HSIZE)
            h = self._p + self._pos
            if (not self._header_ok(h) or <uint8_t>h[3] != _F_LEASE_READ
                    or _u32(h + 8) != _ONE_RUN):
                return None
            self._fill(_HSIZE + _ONE_RUN)
            h = self._p + self._pos
            if not _one_run(h + _HSIZE, small_bytes):
                return None
            req = _u32(h + 4)
            self._pos += _HSIZE + _ONE_RUN
            m[0] = self._m0
            m[1] = self._m1
            # the payload is copied out of the buffer first: grant() runs Python code
            memcpy(payload, h + _HSIZE, _ONE_RUN)
        finally:
            self._busy = False
        return req, _serve(req, payload, grant, owner, served, param_invalid, m, self._version)


cdef class Stage:
    """Where a one-run small READ's answer is staged: ``size`` bytes (at most ``limit``), of which
    ``left`` have not arrived.  A :class:`~kvdd.sim.fabric.rx.Sink` (``recv``)."""

    cdef char* _p
    cdef readonly Py_ssize_t size
    cdef readonly Py_ssize_t left

    def __cinit__(self, Py_ssize_t size, Py_ssize_t limit):
        if size < 0 or size > limit:
            raise ValueError(f"a stage of {size} bytes (limit {limit})")
        self._p = <char*>PyMem_Malloc(<size_t>size if size else 1)
        if self._p == NULL:
            raise MemoryError()
        self.size = size
        self.left = size

    def __dealloc__(self):
        PyMem_Free(self._p)

    def recv(self, FrameReader rx not None, Py_ssize_t n):
        """The next ``n`` bytes of ``rx`` (a DATA payload): more than ``left`` breaks the protocol."""
        if n < 0 or n > self.left:
            raise rx.error("more DATA than the transfer holds")
        if n:
            rx.into(memoryview(<char[:n]>(self._p + (self.size - self.left))))
            self.left -= n

    def land(self, uintptr_t addr):
        """Copy the staged bytes to ``addr`` (the caller's checked run of ``size`` bytes), once all
        arrived (ValueError otherwise)."""
        if self.left:
            raise ValueError("the answer is incomplete")
        if self.size:
            memcpy(<void*>addr, self._p, <size_t>self.size)


cdef inline void _header(char* p, const uint8_t* magic, int version, int ftype, uint32_t req,
                         uint32_t length) noexcept nogil:
    """A frame header at ``p``: magic, version, type, request id, payload length."""
    p[0] = <char>magic[0]
    p[1] = <char>magic[1]
    p[2] = <char>version
    p[3] = <char>ftype
    _put32(p + 4, req)
    _put32(p + 8, length)


cdef bytes _answer(uint32_t req, uintptr_t addr, Py_ssize_t n, const uint8_t* magic, int version):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 2 * _HSIZE + n + 4)
    cdef char* p = PyBytes_AS_STRING(out)
    _header(p, magic, version, _F_DATA, req, <uint32_t>n)
    memcpy(p + _HSIZE, <const void*>addr, <size_t>n)
    p += _HSIZE + n
    _header(p, magic, version, _F_DONE, req, 4)
    _put32(p + _HSIZE, 0)
    return out


def read_answer(uint32_t req, uintptr_t addr, Py_ssize_t n, bytes magic, int version):
    """A one-run small READ's answer: DATA (``n`` bytes copied from ``addr``, a run the owner
    checked) and DONE(LLM_SUCCESS), in one bytes object."""
    if n <= 0 or n > 0xFFFFFFFF or len(magic) != 2:
        raise ValueError("bad answer")
    return _answer(req, addr, n, <const uint8_t*>PyBytes_AS_STRING(magic), version)


cdef bytes _done(uint32_t req, uint32_t status, const uint8_t* magic, int version):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _HSIZE + 4)
    cdef char* p = PyBytes_AS_STRING(out)
    _header(p, magic, version, _F_DONE, req, 4)
    _put32(p + _HSIZE, status)
    return out


cdef inline int64_t _i64(const char* p) noexcept nogil:
    return <int64_t>(<uint64_t>_u32(p) | (<uint64_t>_u32(p + 4) << 32))


cdef object _serve(uint32_t req, const char* p, grant, owner, served, uint32_t param_invalid,
                   const uint8_t* m, int version):
    """Serve the one-run LEASE_READ payload at ``p`` (ONE_RUN_SIZE bytes, k = j = 1 checked)."""
    cdef uint64_t cache_id = <uint64_t>_i64(p)
    cdef uint32_t k = _u32(p + 16)
    cdef int64_t o = _i64(p + 20)
    cdef int64_t n = _i64(p + 28)
    cdef int64_t t
    status, entry = grant(owner, served, cache_id)
    if entry is None:
        return _done(req, status, m, version)
    try:
        regions = entry.regions
        if k >= min(<Py_ssize_t>entry.n, len(regions)):
            return _done(req, param_invalid, m, version)
        region = regions[k]
        t = min(<int64_t>entry.T, <int64_t>region.nbytes)
        if o < 0 or n < 0 or n > t or o > t - n:
            return _done(req, param_invalid, m, version)
        if n == 0:
            return _done(req, 0, m, version)
        return _answer(req, <uintptr_t>region.addr + <uintptr_t>o, n, m, version)
    finally:
        entry.release()


cdef inline bint _one_run(const char* p, Py_ssize_t small_bytes) noexcept:
    """Whether the LEASE_READ payload at ``p`` (ONE_RUN_SIZE bytes) is one tensor x one run of at
    most ``small_bytes`` (anything else is the generic path's: parsed there, or refused)."""
    return _u32(p + 8) == 1 and _u32(p + 12) == 1 and _i64(p + 28) <= small_bytes


def serve_one_run(bytes payload, uint32_t req, grant, owner, served, Py_ssize_t small_bytes,
                  uint32_t param_invalid, bytes magic, int version):
    """The owner's answer to a LEASE_READ of one tensor and one run: the checks of LEASE and READ
    in their order and with their statuses (``grant(owner, served, cache_id)`` = the lease checks:
    ``(status, entry)``, the entry acquired when it is not None; the run must lie inside the
    tensor's size ``entry.T`` and its registered region ``entry.regions[k]``), then DATA + DONE
    built while the entry is held (released before returning).  None when ``payload`` is not a
    one-run request of at most ``small_bytes`` (the generic path then parses, or refuses, it)."""
    if len(payload) != _ONE_RUN or len(magic) != 2:
        return None
    if not _one_run(PyBytes_AS_STRING(payload), small_bytes):
        return None
    return _serve(req, PyBytes_AS_STRING(payload), grant, owner, served, param_invalid,
                  <const uint8_t*>PyBytes_AS_STRING(magic), version)
