# Included by _xproc.pyx: the same-host path's mappings of a peer's shareable cache memory
# (kvdd.empty: sealed memfds) and the copies through them.

cimport cython
import os as _os


cdef extern from "<sys/vfs.h>" nogil:
    struct statfs:
        long f_type
    int fstatfs(int fd, statfs *buf)


cdef extern from *:
    """
    #include <sys/mman.h>
    #include <fcntl.h>
    #ifndef SYS_pidfd_getfd
    #define SYS_pidfd_getfd 438
    #endif
    #ifndef F_GET_SEALS
    #define F_GET_SEALS 1034
    #endif
    #ifndef F_SEAL_SHRINK
    #define F_SEAL_SHRINK 0x0002
    #endif
    #ifndef MADV_DONTFORK
    #define MADV_DONTFORK 10
    #endif
    static inline long kvdd_pidfd_getfd(int pidfd, int fd) {
        return syscall(SYS_pidfd_getfd, pidfd, fd, 0); }
    static inline int kvdd_get_seals(int fd) { return fcntl(fd, F_GET_SEALS); }
    static inline int kvdd_dontfork(void *p, size_t n) { return madvise(p, n, MADV_DONTFORK); }
    """
    long kvdd_pidfd_getfd(int pidfd, int fd) nogil
    int kvdd_get_seals(int fd) nogil
    int kvdd_dontfork(void *p, size_t n) nogil
    enum: F_SEAL_SHRINK

cdef extern from "<unistd.h>" nogil:
    pid_t getpid()

cdef extern from *:
    """
    #ifndef MADV_WIPEONFORK
    #define MADV_WIPEONFORK 18
    #endif
    static inline int kvdd_wipeonfork(void *p, size_t n) { return madvise(p, n, MADV_WIPEONFORK); }
    """
    int kvdd_wipeonfork(void *p, size_t n) nogil

# "Made in this process?" for PeerMaps.bases at every copy, without a system call: one private
# page marked MADV_WIPEONFORK holds this process's mark, a random nonzero word.  The kernel
# zeroes it in every child that does not share our memory, however the child was made: fork()
# (os.fork), glibc's _Fork() and a raw clone(), which run no pthread_atfork handler (a pid kept
# by such a handler stayed the parent's in a _Fork child, whose next copy then went through the
# parent's mappings, absent there: SIGSEGV, or the child's own memory since).  A child's first
# PeerMaps draws a new mark; the parent's PeerMaps never match it.  A mark, not the pid: a
# grandchild can get the pid of the process that mapped (it exited, the pid was reused), and
# its copies and unmaps through the PeerMaps it inherited then reached its own memory there.
cdef uint64_t *_here = NULL


cdef uint64_t _fresh_mark() except 0:
    cdef uint64_t mark = 0
    while mark == 0:
        mark = int.from_bytes(_os.urandom(8), "little")
    return mark


cdef int _here_init() except -1:
    global _here
    cdef void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        raise ImportError("kvdd._native._xproc: cannot map one page")
    if kvdd_wipeonfork(p, 4096) != 0:  # (Linux < 4.14: getpid() at every copy instead)
        munmap(p, 4096)
        return 0
    _here = <uint64_t *>p
    _here[0] = _fresh_mark()
    return 0


_here_init()


cdef inline bint _made_here(uint64_t mark) noexcept nogil:
    """Whether this process is the one whose mark a PeerMaps recorded (``mark``) at its making
    (without MADV_WIPEONFORK: its pid)."""
    if _here != NULL:
        return _here[0] == mark
    return <uint64_t>getpid() == mark


#: ``statfs.f_type`` of tmpfs / shmem (where ``memfd_create`` files live without MFD_HUGETLB).
TMPFS_MAGIC = 0x01021994
#: Largest file (bytes) mapped from a peer (a check against absurd sizes; 1 TiB).
SHM_MAX_BYTES = 1 << 40

# Mappings (and their bytes) that every PeerMaps of this process holds now: the process-wide
# bounds of :meth:`PeerMaps.add` (changed with the GIL held only).
cdef uint64_t _total_maps = 0
cdef uint64_t _total_bytes = 0
cdef uint64_t _total_placed = 0  # entries of every PeerMaps's placement lists (~130 bytes each)


def _forget_parents_maps() -> None:
    """In a forked child: none of the parent's mappings is here (``MADV_DONTFORK``), so none
    counts against this process's bounds on mappings (the child's own links map up to them);
    the inherited placement lists are memory here too and still count."""
    global _total_maps, _total_bytes
    _total_maps = _total_bytes = 0


_os.register_at_fork(after_in_child=_forget_parents_maps)


def peer_map_totals() -> tuple:
    """``(mappings, bytes)`` of peers' memory that this process's :class:`PeerMaps` hold now."""
    return _total_maps, _total_bytes


def peer_placed_total() -> int:
    """Tensor places (entries of the placement lists) every :class:`PeerMaps` holds now."""
    return _total_placed


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """``pidfd_getfd(pidfd, fd, 0)``: a duplicate, in this process, of file descriptor ``fd`` of
    the process behind ``pidfd`` (Linux >= 5.6; needs ptrace access to it, like
    ``/proc/<pid>/mem``).  The caller owns it (``os.close``); it is close-on-exec.

    Raises OSError (EBADF: no such fd there, EPERM, ESRCH: the process exited, ENOSYS)."""
    if pidfd < 0 or fd < 0 or fd > 0x7FFFFFFF:
        raise ValueError(f"pidfd_getfd: invalid fd {fd} or pidfd {pidfd}")
    cdef long r
    cdef int err = 0, cpidfd = pidfd, cfd = fd
    with nogil:
        r = kvdd_pidfd_getfd(cpidfd, cfd)
        if r < 0:
            err = errno
    if r < 0:
        raise OSError(err, f"pidfd_getfd({fd}): {strerror(err).decode(errors='replace')}")
    return r


def shm_check(int fd, unsigned long ino) -> int:
    """Validate a peer's shareable memory before it is mapped; its size in bytes.

    The file must have seals (``F_GET_SEALS``, asked first: it reaches no file system, where
    ``fstatfs`` of a FUSE file waits for its server, which the peer may be), be on tmpfs
    (``fstatfs``: a ``memfd_create`` file without MFD_HUGETLB; a disk
    file, a pipe, a socket, a hugetlbfs memfd are refused), a regular file, the inode ``ino`` the
    peer announced, sealed with ``F_SEAL_SHRINK`` (it can never shrink under the mapping: no
    SIGBUS; ``/dev/shm`` files cannot be sealed), and of 1 byte .. :data:`SHM_MAX_BYTES`.

    Raises ValueError (the reason) when it is not."""
    cdef statfs sfs
    cdef struct_stat st
    cdef int seals = kvdd_get_seals(fd)
    # first: F_GET_SEALS asks no file system (EINVAL but for shmem and hugetlbfs files), where
    # fstatfs / fstat of a FUSE file wait for its server, the owner itself: as long as it likes
    if seals < 0:
        raise ValueError(f"not a tmpfs memfd (no seals: {strerror(errno).decode(errors='replace')})")
    if fstatfs(fd, &sfs) != 0:
        raise ValueError(f"fstatfs failed ({strerror(errno).decode(errors='replace')})")
    if <unsigned long>sfs.f_type != TMPFS_MAGIC:
        raise ValueError(f"not a tmpfs memfd (file system magic {<unsigned long>sfs.f_type:#x})")
    if fstat(fd, &st) != 0:
        raise ValueError(f"fstat failed ({strerror(errno).decode(errors='replace')})")
    if not S_ISREG(st.st_mode):
        raise ValueError(f"not a regular file (mode {st.st_mode:#o})")
    if st.st_ino != ino:
        raise ValueError(f"inode {st.st_ino}, announced {ino}")
    if not (seals & F_SEAL_SHRINK):
        raise ValueError(f"not sealed against shrinking (seals {seals:#x})")
    if st.st_size <= 0 or st.st_size > SHM_MAX_BYTES:
        raise ValueError(f"size {st.st_size} bytes is outside [1, {SHM_MAX_BYTES}]")
    return st.st_size


# Not tracked by the collector (its lists hold only ints and tuples of ints: it is in no cycle of
# its own; a cycle that holds it, such as a reader and its SameHostMover, still frees it): when
# tracked, the collector emptied its lists (or set them to None) before __dealloc__, which then
# neither unmapped nor gave the process-wide counts back.
@cython.no_gc
cdef class PeerMaps:
    """One link reader's mappings of the owner's cache memory, and which tensor of which lease
    slot lies where in them.

    :meth:`add` maps a file that :func:`shm_check` accepted (MAP_SHARED, read-write,
    ``MADV_DONTFORK`` so a forked child never holds it); :meth:`place` says where a slot's tensor
    starts in a mapping.  A copy uses the mappings only when every tensor it touches is placed and
    its mapping holds the tensor's registered bytes from its offset on (:meth:`lookup`, checked at
    every call, after the run checks).  :meth:`close` unmaps: the caller does it only when no copy
    runs (the reader's copy count, as for the link's other fds).  In a child of the process
    that mapped (made by any fork or clone without shared memory: ``_made_here``) nothing is mapped (``MADV_DONTFORK``; the range may hold the
    child's own memory since): no copy uses the mappings and nothing is unmapped there.

    Parameters
    ----------
    slots : int
        The lease table's slot count.
    """

    cdef Py_ssize_t slots
    cdef uint64_t mark       # the process whose address space holds the mappings (_made_here)
    cdef list _maps          # [(addr, size)]
    cdef dict _placed        # slot -> list of (addr, avail) per tensor index (0: not placed)
    cdef readonly bint closed
    #: Copies that went through the mappings (both paths), for tests and ``kvdd bench``.
    cdef readonly uint64_t uses
    #: False: every copy goes through ``/proc/<pid>/mem`` (tests and ``kvdd bench`` compare).
    cdef public bint enabled

    def __cinit__(self, Py_ssize_t slots):
        if slots < 0 or slots > _MAX_SLOTS:
            raise ValueError(f"PeerMaps: {slots} slots")
        self.slots = slots
        if _here == NULL:
            self.mark = <uint64_t>getpid()
        else:
            if _here[0] == 0:  # the first one in a child (the kernel wiped the page)
                _here[0] = _fresh_mark()
            self.mark = _here[0]
        self._maps = []
        self._placed = {}
        self.closed = False
        self.enabled = True

    def __dealloc__(self):
        self._unmap()

    cdef void _unmap(self):
        global _total_maps, _total_bytes, _total_placed
        if self._maps is None:
            return
        for lst in self._placed.values():
            _total_placed -= <uint64_t>len(<list>lst)
        # taken before the GIL is released below: another thread's _unmap finds nothing left
        cdef list maps = self._maps
        self._maps = []
        self._placed = {}
        # a forked child holds none of the mappings (MADV_DONTFORK) and counts none of them
        # (_forget_parents_maps): the range is not its to unmap, the counts not its to lower
        if not _made_here(self.mark):
            return
        cdef void *p
        cdef size_t n
        for addr, size in maps:
            p = <void *><uintptr_t>addr
            n = <size_t>size
            # without the GIL: when the owner exited, this is the last reference to its file
            # and frees its memory (~0.2 s per GiB), which must not stop the process's threads
            with nogil:
                munmap(p, n)
            _total_maps -= 1  # (counted until unmapped: the process-wide bounds hold)
            _total_bytes -= <uint64_t>n

    def add(self, int fd, unsigned long ino, uint64_t limit=SHM_MAX_BYTES,
            uint64_t process_maps=UINT64_MAX, uint64_t process_bytes=UINT64_MAX) -> int:
        """Check (:func:`shm_check`) and map ``fd`` whole, when it has at most ``limit`` bytes
        and the mappings of every PeerMaps of this process (:func:`peer_map_totals`) stay within
        ``process_maps`` mappings and ``process_bytes`` bytes with it; returns the mapping's
        index.  The fd stays the caller's (close it: the mapping keeps the memory).
        ValueError: refused."""
        global _total_maps, _total_bytes
        if self.closed or not _made_here(self.mark):
            raise ValueError("PeerMaps is closed (or was made by the parent of this process)")
        cdef long size = shm_check(fd, ino)
        if <uint64_t>size > limit:
            raise ValueError(f"{size} bytes would pass the {limit} bytes left to map")
        if _total_maps >= process_maps or <uint64_t>size > process_bytes - min(_total_bytes, process_bytes):
            raise ValueError(f"{size} bytes would pass this process's bounds on peers' memory "
                             f"mapped ({process_maps} mappings, {process_bytes} bytes; "
                             f"{_total_maps} and {_total_bytes} held)")
        _total_maps += 1  # reserved before the GIL is released (other threads' adds count it)
        _total_bytes += <uint64_t>size
        cdef void *p
        cdef int err = 0
        with nogil:
            p = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                err = errno
            elif kvdd_dontfork(p, <size_t>size) != 0:
                err = errno
                munmap(p, <size_t>size)
        if err:
            _total_maps -= 1
            _total_bytes -= <uint64_t>size
            raise ValueError(f"mmap failed ({strerror(err).decode(errors='replace')})")
        self._maps.append((<uintptr_t>p, size))
        return len(self._maps) - 1

    def place(self, Py_ssize_t slot, Py_ssize_t tensor, Py_ssize_t index, uint64_t offset) -> bool:
        """Tensor ``tensor`` of ``slot`` starts ``offset`` bytes into mapping ``index``; False
        (not placed) when that lies outside the mapping."""
        if slot < 0 or slot >= self.slots or tensor < 0 or tensor >= _MAX_MAPPED_TENSORS:
            return False
        if index < 0 or index >= len(self._maps):
            return False
        addr, size = self._maps[index]
        if offset >= <uint64_t>size:
            return False
        global _total_placed
        placed = self._placed.setdefault(slot, [])
        while len(placed) <= tensor:
            placed.append((0, 0))
            _total_placed += 1
        placed[tensor] = (addr + offset, size - offset)
        return True

    def place_rows(self, const uint64_t[:, ::1] rows not None,
                   const int64_t[::1] index not None, uint64_t process_placed=UINT64_MAX) -> int:
        """:meth:`place` for every row ``(slot, tensor, -, offset, -)`` of ``rows`` in order
        (a later row of the same tensor wins), in mapping ``index[r]`` (negative: skipped), in
        one C loop, as long as the placement lists of every PeerMaps of this process
        (:func:`peer_placed_total`) stay within ``process_placed`` entries (a row that would
        pass it is skipped); how many were placed."""
        global _total_placed
        if rows.shape[1] != 5 or index.shape[0] != rows.shape[0]:
            raise ValueError("place_rows: rows of 5 words and one index per row are required")
        cdef Py_ssize_t r, done = 0, nmaps = len(self._maps), grow
        cdef uint64_t slot, tensor, off
        cdef int64_t i
        cdef list placed
        for r in range(rows.shape[0]):
            i, slot, tensor, off = index[r], rows[r, 0], rows[r, 1], rows[r, 3]
            if (i < 0 or i >= nmaps or slot >= <uint64_t>self.slots
                    or tensor >= <uint64_t>_MAX_MAPPED_TENSORS):
                continue
            addr, size = self._maps[i]
            if off >= <uint64_t>size:
                continue
            placed = self._placed.setdefault(<Py_ssize_t>slot, [])
            grow = <Py_ssize_t>tensor + 1 - len(placed)
            if grow > 0 and <uint64_t>grow > process_placed - min(_total_placed, process_placed):
                continue
            while len(placed) <= <Py_ssize_t>tensor:
                placed.append((0, 0))
                _total_placed += 1
            placed[<Py_ssize_t>tensor] = (addr + off, size - off)
            done += 1
        return done

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped (the sum of the mapped files' sizes)."""
        return sum(size for _addr, size in self._maps)

    def __len__(self):
        return len(self._maps)

    def placed(self, Py_ssize_t slot) -> int:
        """How many tensors of ``slot`` are placed."""
        return sum(1 for a, _n in self._placed.get(slot, ()) if a)

    cdef bint bases(self, Py_ssize_t slot, object tensors, Py_ssize_t first, Py_ssize_t K,
                    int64_t rn, uintptr_t *out) except -1:
        """The mapped address of each tensor (``tensors[k]`` when given, else ``first + k``) of
        ``slot``; False when any is not placed, or its mapping holds fewer than ``rn`` bytes
        from the tensor's offset (the copy then goes through ``/proc/<pid>/mem``)."""
        if self.closed or not self.enabled or rn < 0 or not _made_here(self.mark):
            return False
        placed = self._placed.get(slot)
        if placed is None:
            return False
        cdef Py_ssize_t k, t, n = len(<list>placed)
        cdef uintptr_t a
        cdef uint64_t avail
        for k in range(K):
            t = tensors[k] if tensors is not None else first + k
            if t < 0 or t >= n:
                return False
            a, avail = (<list>placed)[t]
            if a == 0 or avail < <uint64_t>rn:
                return False
            out[k] = a
        self.uses += 1
        return True

    def close(self) -> None:
        """Unmap everything (no copy may run: the caller's copy count says so)."""
        self.closed = True
        self._unmap()


cdef enum:
    _WIN = 256  # runs per kernel call of a mapped copy
    _MAX_MAPPED_TENSORS = 1 << 20


cdef void _run_map(_Job *job, uint64_t call_bytes) noexcept nogil:
    """The runs with kvdd's copy kernels between local memory and the peer's memory mapped here
    (``job.raddr``: mapped addresses): at most ``chunk`` bytes per kernel call, the deadline and
    the owner's abort checked right before each, like :func:`_run_mem` before each system call."""
    cdef int64_t so[_WIN]
    cdef int64_t do[_WIN]
    cdef int64_t ln[_WIN]
    cdef Py_ssize_t n = 0, k, j
    cdef uint64_t batch = 0
    cdef int64_t pos, left, take
    cdef uintptr_t la, ra
    for k in range(job.K):
        for j in range(job.J):
            pos = 0
            left = job.ln[j]
            while left > 0:
                take = left
                if <uint64_t>take > job.chunk - batch:
                    take = <int64_t>(job.chunk - batch)
                la = job.laddr[k] + <uintptr_t>(job.loff[j] + pos)
                ra = job.raddr[k] + <uintptr_t>(job.roff[j] + pos)
                if job.write:
                    so[n] = <int64_t>la
                    do[n] = <int64_t>ra
                else:
                    so[n] = <int64_t>ra
                    do[n] = <int64_t>la
                ln[n] = take
                n += 1
                batch += <uint64_t>take
                pos += take
                left -= take
                if n == _WIN or batch >= job.chunk:
                    if _stop(job):
                        return
                    job.done += copy_trusted_runs(so, do, ln, n, call_bytes)
                    n = 0
                    batch = 0
    if n:
        if _stop(job):
            return
        job.done += copy_trusted_runs(so, do, ln, n, call_bytes)
    if job.deadline >= 0 and _now_ns() > job.deadline:
        job.timed_out = True
