# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False, auto_pickle=False
"""The TCP fabric's owner side of a READ of long runs (blocks) in C: gathering ``sendmsg`` calls.

A READ whose runs are all long (``kvdd.sim.fabric.serving.RunPlan``, every run at least
``STAGE_RUN_BYTES``: paged caches' blocks) is answered by a :class:`GatherSender`: the DATA
frames of its byte stream (tensor k outer, run j inner; frames of at most ``max_data`` bytes,
each behind its 12-byte header) sent straight from the tensors' memory, each system call gathering
the header and runs of one *list* (the rule of ``RunPlan._cut``: a list ends once it holds
``gather_bytes`` bytes of the tensors, or ``buffers - 1`` buffers after a run's piece; a run is
cut where a frame or a list ends).  :meth:`GatherSender.send` sends lists without blocking, with
the GIL released, until the socket is full, the stream is sent or the caller's budget of bytes
is spent, and resumes exactly where the socket stopped taking bytes (inside a header or a run);
:meth:`GatherSender.lists` gives the same lists as Python buffers (a blocking driver, tests).

Every run is checked against every region at construction (ValueError): nothing outside the
regions is ever read.  The regions' memory is kept alive by ``keep`` (the caller's lease holds
the registration meanwhile, as for the Python path's memoryviews).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.errno cimport EAGAIN, EBADF, EINTR, errno
from libc.stdint cimport int64_t, uint32_t
from libc.string cimport memcpy

from kvdd._native._le cimport put32 as _put32

import os

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1
    object PyMemoryView_FromMemory(char* mem, Py_ssize_t size, int flags)

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "sys/socket.h" nogil:
    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t c_sendmsg "sendmsg"(int fd, const msghdr* msg, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL

__all__ = ["GatherSender", "MAX_BUFFERS"]

cdef enum:
    _HSIZE = 12  # magic (2), version, type, request id (u32), payload length (u32); little-endian
    _MAX_BUFFERS = 1024  # IOV_MAX on Linux
    _PyBUF_READ = 0x100

MAX_BUFFERS = _MAX_BUFFERS  # the most buffers a list may hold


cdef struct Walk:
    Py_ssize_t k  # the stream's tensor of the next byte
    Py_ssize_t j  # its run
    int64_t pos  # bytes of run j before the next byte
    int64_t stream  # bytes of the stream not yet in a frame
    int64_t frame_left  # bytes of the current frame not yet walked
    int hdr_left  # bytes of the current frame's header not yet walked (its end)
    char hdr[_HSIZE]  # that header
    Py_ssize_t trailer_left  # bytes of the trailer not yet walked (after the stream)


cdef class GatherSender:
    """The DATA frames of runs ``(off[j], length[j])`` of the memory at ``addrs[k]`` (k outer,
    j inner), sent by gathering ``sendmsg`` calls (not thread-safe: one sender at a time).

    Parameters
    ----------
    addrs : sequence of int
        The address of each tensor: of the stream's tensors in stream order (a tensor may
        repeat), or, with ``tensors``, of the tensors it names.
    nbytes : sequence of int
        The bytes of each (every run must lie inside each: ValueError otherwise).
    off, length : sequence of int
        The runs, bytes (the same for every tensor; a run of length 0 sends nothing); int64
        buffers (``array('q')``, numpy) are read without a Python object per run.
    header : bytes
        A DATA frame's 12-byte header; its last 4 bytes (the payload length, little-endian)
        are written per frame.
    max_data : int
        Bytes of the stream per DATA frame (the last shorter), 1 to 2^32 - 1.
    gather_bytes : int
        Bytes of the tensors that end a list, at least 1.
    buffers : int
        Buffers a list holds at most (headers included), 2 to :data:`MAX_BUFFERS`.
    keep : object
        Kept alive as long as the sender (what keeps the memory registered).
    tensors : buffer of uint32 or None
        The stream's tensors (index into ``addrs``, in stream order; checked): a READ of K
        tensors costs the sender O(distinct tensors) Python objects, not O(K).  None: the
        stream's tensors are ``addrs`` in order.
    trailer : bytes
        Sent after the stream, in the system call of its last bytes when the list has room for
        one buffer more (the READ's DONE: the peer gets it with the data, not one wake-up later).
    """

    cdef int64_t* _addr
    cdef int64_t* _off
    cdef int64_t* _len
    cdef Py_ssize_t _nk, _nj
    cdef const uint32_t[::1] _which  # the stream's tensor k is addrs[_which[k]] (when _pwhich)
    cdef const uint32_t* _pwhich
    cdef int64_t _max_data, _gather
    cdef int _buffers
    cdef Walk _w
    cdef iovec* _iov
    cdef char* _hdrs  # a copy of each list's headers (buffers x 12 bytes)
    cdef object _keep
    cdef bytes _trailer
    cdef const char* _tp  # its bytes, and how many
    cdef Py_ssize_t _tn
    cdef bint _busy
    cdef readonly int64_t total
    cdef readonly bint blocked  # the last send stopped because the socket was full

    def __cinit__(self):
        self._addr = self._off = self._len = NULL
        self._iov = NULL
        self._hdrs = NULL
        self._pwhich = NULL
        self._tp = NULL
        self._tn = 0

    def __init__(self, addrs, nbytes, off, length, bytes header, int64_t max_data,
                 int64_t gather_bytes, int buffers, keep=None, tensors=None,
                 bytes trailer=b""):
        cdef Py_ssize_t i, na = len(addrs), nk = na, nj = len(off)
        cdef int64_t o, n, hi = 0, size, per_k = 0
        cdef const uint32_t[::1] which
        cdef const int64_t[::1] offv, lenv
        cdef bint typed = False
        if self._addr != NULL or self._busy:  # (its arrays are in use: a sender is made once)
            raise RuntimeError("a GatherSender is initialized once")
        if tensors is not None:
            which = tensors
            nk = which.shape[0]
            for i in range(nk):
                if which[i] >= <uint32_t>na:
                    raise ValueError(f"the stream's tensor {i} is not one of the {na} given")
            self._which = which
            self._pwhich = &which[0] if nk else NULL
        if len(nbytes) != na or len(length) != nj:
            raise ValueError("addrs and nbytes, off and length must have one length")
        if len(header) != _HSIZE:
            raise ValueError(f"a DATA header has {_HSIZE} bytes")
        if not 0 < max_data <= 0xFFFFFFFF or gather_bytes < 1 or not 2 <= buffers <= _MAX_BUFFERS:
            raise ValueError("max_data, gather_bytes or buffers out of range")
        self._addr = <int64_t*>PyMem_Malloc((na + 1) * sizeof(int64_t))
        self._off = <int64_t*>PyMem_Malloc((nj + 1) * sizeof(int64_t))
        self._len = <int64_t*>PyMem_Malloc((nj + 1) * sizeof(int64_t))
        self._iov = <iovec*>PyMem_Malloc(buffers * sizeof(iovec))
        self._hdrs = <char*>PyMem_Malloc(buffers * _HSIZE)
        if not (self._addr and self._off and self._len and self._iov and self._hdrs):
            raise MemoryError()
        try:  # runs given as int64 buffers (the server's arrays): no Python object per run
            offv = off
            lenv = length
            typed = offv.shape[0] == nj and lenv.shape[0] == nj  # (else: as a sequence)
        except (TypeError, ValueError, BufferError):
            pass
        for i in range(nj):
            if typed:
                o = offv[i]
                n = lenv[i]
            else:
                o = off[i]
                n = length[i]
            if o < 0 or n < 0 or o > (<int64_t>0x7FFFFFFFFFFFFFFF) - n:
                raise ValueError(f"run {i} ({o}, {n}) is not a range of bytes")
            self._off[i] = o
            self._len[i] = n
            if n:
                hi = max(hi, o + n)
                if per_k > (<int64_t>0x7FFFFFFFFFFFFFFF) - n:
                    raise ValueError("the stream is longer than 2^63 - 1 bytes")
                per_k += n
        for i in range(na):
            size = nbytes[i]
            if hi > size:
                raise ValueError(f"a run ends at byte {hi}, past the {size} bytes of tensor {i}")
            self._addr[i] = addrs[i]
        if nk and per_k > (<int64_t>0x7FFFFFFFFFFFFFFF) // nk:
            raise ValueError("the stream is longer than 2^63 - 1 bytes")
        self._nk = nk
        self._nj = nj
        self._max_data = max_data
        self._gather = gather_bytes
        self._buffers = buffers
        self._keep = keep
        self.total = per_k * nk
        self._w.k = 0 if nj else nk  # (no run: nothing to walk)
        self._w.j = 0
        self._w.pos = 0
        self._w.stream = self.total
        self._w.frame_left = 0
        self._w.hdr_left = 0
        self._trailer = trailer
        self._tp = trailer
        self._tn = len(trailer)
        self._w.trailer_left = self._tn
        memcpy(self._w.hdr, <const char*>header, _HSIZE)

    def __dealloc__(self):
        PyMem_Free(self._addr)
        PyMem_Free(self._off)
        PyMem_Free(self._len)
        PyMem_Free(self._iov)
        PyMem_Free(self._hdrs)

    @property
    def done(self):
        """Every byte of the stream and the trailer was sent (or walked, by :meth:`lists`)."""
        return self._finished(&self._w)

    @property
    def left(self):
        """Bytes not yet sent, headers and the trailer included."""
        if self._max_data == 0:  # (never initialized)
            return 0
        stream = int(self._w.stream)  # (Python integers: a stream near 2^63 bytes has more)
        return stream + (stream + self._max_data - 1) // self._max_data * _HSIZE \
            + self._w.frame_left + self._w.hdr_left + self._w.trailer_left

    cdef inline bint _done(self, const Walk* w) noexcept nogil:
        """The stream walked (the trailer may follow)."""
        return w.stream == 0 and w.frame_left == 0 and w.hdr_left == 0

    cdef inline bint _finished(self, const Walk* w) noexcept nogil:
        return self._done(w) and w.trailer_left == 0

    cdef inline int64_t _base(self, Py_ssize_t k) noexcept nogil:
        return self._addr[self._pwhich[k]] if self._pwhich != NULL else self._addr[k]

    cdef inline void _next_run(self, Walk* w) noexcept nogil:
        w.pos = 0
        w.j += 1
        if w.j == self._nj:
            w.j = 0
            w.k += 1

    cdef inline void _new_frame(self, Walk* w) noexcept nogil:
        w.frame_left = w.stream if w.stream < self._max_data else self._max_data
        w.stream -= w.frame_left
        _put32(w.hdr + 8, <uint32_t>w.frame_left)
        w.hdr_left = _HSIZE

    cdef bint _ready(self, Walk* w) noexcept nogil:
        """``w`` at its next byte of the tensors (runs of length 0 skipped, a frame begun where
        the last one ended: its header is then the next thing on the wire); False at the end."""
        while not self._done(w) and w.k < self._nk:
            if w.pos >= self._len[w.j]:  # (a run of length 0)
                self._next_run(w)
            elif w.frame_left == 0:
                self._new_frame(w)
                return True
            else:
                return True
        return False

    cdef int64_t _take(self, Walk* w, int64_t limit) noexcept nogil:
        """``w`` moved past the next piece of a run (cut where the run, the frame or ``limit``
        ends): its length."""
        cdef int64_t take = self._len[w.j] - w.pos
        if take > w.frame_left:
            take = w.frame_left
        if take > limit:
            take = limit
        w.pos += take
        w.frame_left -= take
        if w.pos == self._len[w.j]:
            self._next_run(w)
        return take

    cdef inline void _trailer_into(self, Walk* w, int at) noexcept nogil:
        """What is left of the trailer as buffer ``at`` of the list (``w`` past it)."""
        self._iov[at].iov_base = <void*>(self._tp + self._tn - w.trailer_left)
        self._iov[at].iov_len = <size_t>w.trailer_left
        w.trailer_left = 0

    cdef int _fill(self, Walk* w) noexcept nogil:
        """The next list into ``_iov`` from ``w`` (advanced past it): its buffer count."""
        cdef int count = 0
        cdef int64_t gathered = 0, at
        cdef char* h
        while True:
            if w.hdr_left:  # (whole, or its rest after a send that stopped inside it)
                h = self._hdrs + count * _HSIZE
                memcpy(h, w.hdr, _HSIZE)
                self._iov[count].iov_base = h + _HSIZE - w.hdr_left
                self._iov[count].iov_len = <size_t>w.hdr_left
                count += 1
                w.hdr_left = 0
            if not self._ready(w):  # the stream walked (before this list): the trailer
                if w.trailer_left and count < self._buffers:
                    self._trailer_into(w, count)
                    count += 1
                break
            if w.hdr_left:  # a frame begins: its header first
                continue
            at = self._base(w.k) + self._off[w.j] + w.pos
            self._iov[count].iov_base = <void*><size_t>at
            self._iov[count].iov_len = <size_t>self._take(w, self._gather - gathered)
            gathered += <int64_t>self._iov[count].iov_len
            count += 1
            if self._done(w):  # the stream's last bytes: the trailer with them, if there is room
                if w.trailer_left and count < self._buffers:
                    self._trailer_into(w, count)
                    count += 1
                break
            if gathered >= self._gather or count >= self._buffers - 1:
                break
        return count

    cdef void _advance(self, Walk* w, int64_t sent) noexcept nogil:
        """``w`` moved past ``sent`` bytes of the wire (headers included), as :meth:`_fill` walks."""
        cdef int64_t take
        while sent > 0:
            if w.hdr_left:
                take = w.hdr_left if w.hdr_left < sent else sent
                w.hdr_left -= <int>take
                sent -= take
            elif not self._ready(w):  # the trailer (a send takes at most what was listed)
                take = w.trailer_left if w.trailer_left < sent else sent
                w.trailer_left -= take
                sent -= take
                if not take:
                    break
            elif not w.hdr_left:
                sent -= self._take(w, sent)

    def send(self, sock, int64_t budget):
        """Send lists on ``sock`` (non-blocking, GIL released, ``MSG_NOSIGNAL``) until the stream
        is sent (:attr:`done`), the socket is full (:attr:`blocked`) or ``budget`` bytes were
        sent.  Returns the bytes sent; OSError when the connection fails."""
        cdef int fd, err = 0
        cdef int count
        cdef int64_t sent = 0
        cdef ssize_t r
        cdef Walk w
        cdef msghdr msg
        if self._busy:
            raise RuntimeError("another thread is sending this stream")
        self._busy = True
        self.blocked = False
        try:
            fd = sock.fileno()
            if fd < 0:
                raise OSError(EBADF, os.strerror(EBADF))
            msg.msg_name = NULL
            msg.msg_namelen = 0
            msg.msg_control = NULL
            msg.msg_controllen = 0
            msg.msg_flags = 0
            msg.msg_iov = self._iov
            while True:
                with nogil:
                    while not self._finished(&self._w) and sent < budget:
                        w = self._w
                        count = self._fill(&w)
                        if count == 0:  # (never: a stream not done has a byte to list)
                            break
                        msg.msg_iovlen = <size_t>count
                        r = c_sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
                        if r < 0:
                            err = errno
                            break
                        self._advance(&self._w, r)
                        sent += r
                if err == EINTR:
                    err = 0
                    PyErr_CheckSignals()  # (a handler's exception propagates)
                    continue
                break
            if err == EAGAIN:  # (EWOULDBLOCK on Linux)
                self.blocked = True
            elif err:
                raise OSError(err, os.strerror(err))
            return sent
        finally:
            self._busy = False

    def lists(self):
        """The remaining lists as Python buffers (headers copied, runs as read-only views of the
        tensors' memory; each list should be used whole before the next is asked for)."""
        cdef int count, i
        cdef Walk w
        cdef list out
        cdef char* base
        while not self._finished(&self._w):
            if self._busy:
                raise RuntimeError("another thread is sending this stream")
            self._busy = True
            try:
                w = self._w
                count = self._fill(&w)
                out = []
                for i in range(count):
                    base = <char*>self._iov[i].iov_base
                    if (self._hdrs <= base < self._hdrs + self._buffers * _HSIZE
                            or self._tp <= base < self._tp + self._tn):  # (copied)
                        out.append(memoryview(PyBytes_FromStringAndSize(
                            <char*>self._iov[i].iov_base, <Py_ssize_t>self._iov[i].iov_len)))
                    else:
                        out.append(PyMemoryView_FromMemory(<char*>self._iov[i].iov_base,
                                                           <Py_ssize_t>self._iov[i].iov_len,
                                                           _PyBUF_READ))
                self._w = w
            finally:
                self._busy = False
            yield out
