# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: embedsignature=True, embedsignature.format=python, autotestdict=False, auto_pickle=False
"""One-sided access to another process's memory on this host (Linux ``process_vm_readv`` /
``process_vm_writev``), for the simulator's same-host cross-process data path.

The peer's Python is not involved: the kernel copies between this process's pages and the peer's.
The caller (``kvdd.sim.fabric``) holds a lease on the remote cache for the duration (SEMANTICS.md
§10 rule 5) and passes the remote tensor addresses of the link's snapshot; the local side is
given as :class:`kvdd._native._copy.Region` objects, so every local byte touched lies in memory
the simulator validated.  Every run is checked against the local regions and the remote tensor
size before anything moves.

Both calls need ptrace access to the peer (``PTRACE_MODE_ATTACH_REALCREDS``): same user and, under
Yama ``ptrace_scope >= 1``, an ancestor relationship or ``PR_SET_PTRACER``.  When that is refused the
call raises ``PermissionError`` (EPERM) and the fabric falls back to TCP.

Also here, for the same-host path's identity proof and one-sided leases
(:mod:`kvdd.sim.fabric.samehost`): :func:`pidfd_open` / :func:`pidfd_alive` (a process handle that
cannot be confused with a later process reusing the pid), :func:`peer_cred` (``SO_PEERCRED`` of an
AF_UNIX socket: the kernel's word on who is at the other end) and :class:`LeaseTable`, C11-style
sequentially consistent 64-bit atomics on a per-link table in shared memory.  The table's contents
are untrusted: every index is bounds-checked against the size this process mapped, and nothing read
from it is ever used as an address.  And the mapped copies of caches in :func:`kvdd.empty` memory
(``_xproc_maps.pxi``): :func:`pidfd_getfd`, :func:`shm_check` (what a peer's memfd must be before
it is mapped) and :class:`PeerMaps`.
"""

from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.errno cimport EFAULT, EINTR, EIO, ENOENT, ESRCH, errno
from libc.stdint cimport INT64_MAX, UINT64_MAX, UINTPTR_MAX, int64_t, uint64_t, uintptr_t
from libc.string cimport strerror
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.stat cimport S_ISREG, fstat, struct_stat
from posix.types cimport pid_t

from kvdd._native._copy cimport copy_trusted_runs
from kvdd._native._copy import Region

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                             const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                              const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)

cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void *buf, size_t count, long offset)
    ssize_t pwrite(int fd, const void *buf, size_t count, long offset)
    int c_close "close"(int fd)

cdef extern from "<fcntl.h>" nogil:
    int c_open "open"(const char *path, int flags)
    enum: O_RDWR
    enum: O_CLOEXEC

cdef extern from "<stdio.h>" nogil:
    int snprintf(char *s, size_t n, const char *fmt, ...)

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum: POLLIN

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    enum: PROT_READ
    enum: PROT_WRITE
    enum: MAP_SHARED
    enum: MAP_PRIVATE
    enum: MAP_ANONYMOUS
    void *MAP_FAILED

cdef extern from "<sys/socket.h>" nogil:
    int getsockopt(int sockfd, int level, int optname, void *optval, unsigned int *optlen)
    enum: SOL_SOCKET
    enum: SO_PEERCRED

cdef extern from *:
    """
    #include <sys/syscall.h>
    #include <unistd.h>
    #include <stdint.h>
    #include <time.h>
    #ifndef SYS_pidfd_open
    #define SYS_pidfd_open 434
    #endif
    struct kvdd_ucred { int32_t pid; uint32_t uid; uint32_t gid; };
    static inline long kvdd_pidfd_open(int pid) { return syscall(SYS_pidfd_open, pid, 0); }
    /* Sequentially consistent 64-bit atomics on shared memory (the lease table). */
    static inline uint64_t kvdd_add(uint64_t *p, uint64_t v) {
        return __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST); }
    static inline uint64_t kvdd_sub(uint64_t *p, uint64_t v) {
        return __atomic_sub_fetch(p, v, __ATOMIC_SEQ_CST); }
    static inline uint64_t kvdd_load(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline void kvdd_store(uint64_t *p, uint64_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline int kvdd_cas(uint64_t *p, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST); }
    /* The compiled copy of this thread that failed after it started (SameHostMover._move): the
       Python path, which answers that call next, reports it without copying again. */
    static __thread const void *kvdd_failed_mover = NULL;
    static __thread Py_ssize_t kvdd_failed_slot = -1;
    static __thread int kvdd_failed_errno = 0;
    static inline void kvdd_pause_ns(long ns) {
        struct timespec ts; ts.tv_sec = ns / 1000000000L; ts.tv_nsec = ns % 1000000000L;
        nanosleep(&ts, NULL); }
    """
    struct kvdd_ucred:
        int pid
        unsigned int uid
        unsigned int gid
    long kvdd_pidfd_open(int pid) nogil
    uint64_t kvdd_add(uint64_t *p, uint64_t v) noexcept nogil
    uint64_t kvdd_sub(uint64_t *p, uint64_t v) noexcept nogil
    uint64_t kvdd_load(uint64_t *p) noexcept nogil
    void kvdd_store(uint64_t *p, uint64_t v) noexcept nogil
    int kvdd_cas(uint64_t *p, uint64_t expected, uint64_t desired) noexcept nogil
    void kvdd_pause_ns(long ns) noexcept nogil
    const void *kvdd_failed_mover
    Py_ssize_t kvdd_failed_slot
    int kvdd_failed_errno

#: iovec entries per system call (the kernel's UIO_MAXIOV).
IOV_MAX = 1024
#: Default bytes per system call: bounds how late a deadline is noticed.
DEFAULT_CHUNK = 64 << 20

cdef enum:
    _IOV_MAX = 1024


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int _gather(object arr, int64_t *out, Py_ssize_t n, str what) except -1:
    cdef const int64_t[:] v
    try:
        v = arr
    except (TypeError, ValueError):
        raise TypeError(f"pvm_copy: {what} must be a 1-D int64 array") from None
    if v.shape[0] != n:
        raise ValueError(f"pvm_copy: {what} has {v.shape[0]} entries, expected {n}")
    cdef Py_ssize_t j
    for j in range(n):
        out[j] = v[j]
    return 0


include "_xproc_runs.pxi"


#: A lease-table state at least this stops a running copy at its next system call.
LEASE_ABORT = _ABORT


def pvm_copy(pid: int, local, remote, remote_nbytes: int, local_off, remote_off, length,
             write: bool, *, timeout_ms: int = -1, chunk: int = DEFAULT_CHUNK,
             pidfd: int = -1, LeaseTable leases=None, Py_ssize_t slot=-1,
             int mem_fd=-1, PeerMaps maps=None, tuple map_tensors=None) -> int:
    """Copy runs between this process's regions and another process's memory.

    For ``k in range(len(local))``, for ``j in range(len(length))``::

        read  (write=False): local[k] + local_off[j]  <-  remote[k] + remote_off[j], length[j] bytes
        write (write=True):  local[k] + local_off[j]  ->  remote[k] + remote_off[j], length[j] bytes

    Parameters
    ----------
    pid : int
        The peer process.
    local : Sequence[Region]
        This process's side, one region per tensor.
    remote : Sequence[int]
        The peer's tensor addresses, one per local region.
    remote_nbytes : int
        Size in bytes of every remote tensor; each run must lie inside ``[0, remote_nbytes)``.
    local_off, remote_off, length : numpy.ndarray
        1-D int64 arrays of equal length (bytes).
    write : bool
        ``process_vm_writev`` when true, ``process_vm_readv`` otherwise.
    timeout_ms : int, keyword-only
        Give up (``TimeoutError``) when this many milliseconds have passed, checked between system
        calls; negative: no limit.
    chunk : int, keyword-only
        Bytes per system call (>= 4096).
    pidfd : int, keyword-only
        A pidfd of ``pid`` (:func:`pidfd_open`) held by the caller: checked right before and right
        after the copy (GIL released), so a pid reused by a later process is never trusted:
        ``ProcessLookupError`` when it has exited (before: nothing moved; after: the bytes are not
        to be trusted).  Negative: no check.
    leases, slot : LeaseTable, int, keyword-only
        The lease this copy runs under: between system calls, a slot or link state of at least
        :data:`LEASE_ABORT` (the owner gave up waiting) stops it (``ConnectionAbortedError``; the
        destination holds a prefix).
    mem_fd : int, keyword-only
        The peer's ``/proc/<pid>/mem`` opened by :func:`mem_open` (the same-host data path always
        passes it): the copy is ``pread`` / ``pwrite`` on it, which reach the address space the
        file was opened on and no other, even if ``pid`` is reused meanwhile, and never wait on a
        page the peer froze with a userfaultfd (EFAULT at once).  Negative: ``process_vm_readv``
        / ``writev`` on ``pid`` (identity by pid number only: the benchmarks' baseline).
    maps, map_tensors : PeerMaps, tuple[int, ...], keyword-only
        The peer's cache memory mapped here (the same-host path's mapped copies) and the tensor
        index in ``slot`` of each remote address: when every tensor is placed in ``maps`` with at
        least ``remote_nbytes`` bytes, the runs (checked as above first) are copied with kvdd's
        copy kernels between the local regions and the mappings, at most ``chunk`` bytes per
        kernel call, the deadline and the abort checked before each (``pidfd`` before and after
        the copy, as for system calls); otherwise as without them.

    Returns
    -------
    int
        Bytes moved (``len(local) * sum(length)``).

    Raises
    ------
    ValueError, TypeError
        Mismatched lengths, a run outside a local region or the remote tensor (nothing moved).
    PermissionError
        EPERM: the kernel refuses access to the peer (ptrace rules, e.g. Yama).
    ProcessLookupError
        ESRCH: the peer process does not exist (with ``mem_fd``: its address space is gone).
    OSError
        EFAULT (a remote range is not mapped, or was unmapped), ENOMEM, ...: ``errno`` set.
    TimeoutError
        The deadline passed; the destination holds a prefix of the data.
    """
    cdef pid_t cpid = pid
    if pid <= 0 or cpid != pid:
        raise ValueError(f"pvm_copy: invalid pid {pid}")
    cdef tuple loc = tuple(local)
    cdef tuple rem = tuple(remote)
    cdef Py_ssize_t K = len(loc), J = len(length), k, j
    if len(rem) != K:
        raise ValueError(f"pvm_copy: {K} local regions but {len(rem)} remote addresses")
    cdef int64_t rn = remote_nbytes
    if rn < 0:
        raise ValueError("pvm_copy: remote_nbytes must be >= 0")
    if chunk < 4096:
        raise ValueError("pvm_copy: chunk must be >= 4096 bytes")
    cdef _Job job
    job.pid = cpid
    job.mem_fd = mem_fd
    job.write = bool(write)
    job.K = K
    job.J = J
    job.chunk = <uint64_t>chunk
    job.done = 0
    job.err = 0
    job.timed_out = False
    job.aborted = False
    job.abort_word = NULL
    job.abort_link = NULL
    if leases is not None:
        job.abort_word = leases._slot(slot) + _S_STATE
        job.abort_link = leases.base + _H_STATE
    job.deadline = -1 if timeout_ms < 0 else _now_ns() + <int64_t>timeout_ms * 1000000
    cdef uintptr_t addrs_small[3 * _SMALL + 1]
    cdef int64_t runs_small[3 * _SMALL + 1]
    cdef uintptr_t *addrs = addrs_small
    cdef int64_t *runs = runs_small
    cdef int cfd = pidfd
    cdef bint gone_before = False, gone_after = False, mapped = False
    if K > _SMALL:
        addrs = <uintptr_t *>PyMem_RawMalloc(<size_t>(3 * K + 1) * sizeof(uintptr_t))
    if J > _SMALL:
        runs = <int64_t *>PyMem_RawMalloc(<size_t>(3 * J + 1) * sizeof(int64_t))
    cdef int64_t lmin = INT64_MAX, n, total = 0
    cdef uintptr_t a
    try:
        if addrs == NULL or runs == NULL:
            raise MemoryError()
        for k in range(K):
            reg = loc[k]
            if type(reg) is not Region:
                raise TypeError(f"pvm_copy: local[{k}] is {type(reg).__name__}, not Region")
            addrs[k] = reg.addr
            if reg.nbytes < lmin:
                lmin = reg.nbytes
            a = rem[k]
            if a == 0 or a > UINTPTR_MAX - <uintptr_t>rn:
                raise ValueError(f"pvm_copy: remote[{k}] = {a:#x} is not a valid address")
            addrs[K + k] = a
        _gather(local_off, runs, J, "local_off")
        _gather(remote_off, runs + J, J, "remote_off")
        _gather(length, runs + 2 * J, J, "length")
        for j in range(J):
            n = runs[2 * J + j]
            if n < 0:
                raise ValueError(f"pvm_copy: run {j} has negative length {n}")
            if K and (runs[j] < 0 or n > lmin or runs[j] > lmin - n):
                raise ValueError(f"pvm_copy: run {j} ({runs[j]}+{n}) is outside the local regions "
                                 f"({lmin} bytes); nothing was copied")
            if runs[J + j] < 0 or n > rn or runs[J + j] > rn - n:
                raise ValueError(f"pvm_copy: run {j} ({runs[J + j]}+{n}) is outside the remote "
                                 f"tensor ({rn} bytes); nothing was copied")
            total += n
        job.laddr = addrs
        job.raddr = addrs + K
        job.loff = runs
        job.roff = runs + J
        job.ln = runs + 2 * J
        if maps is not None and total > 0 and leases is not None:
            if map_tensors is None or len(map_tensors) != K:
                raise ValueError("pvm_copy: map_tensors must name the tensor of every remote")
            mapped = maps.bases(slot, map_tensors, 0, K, rn, addrs + 2 * K)
            if mapped:
                job.raddr = addrs + 2 * K
        if total > 0:
            with nogil:
                if cfd >= 0 and _pidfd_exited(cfd):
                    gone_before = True
                else:
                    if mapped:
                        _run_map(&job, <uint64_t>total * <uint64_t>K)
                    elif job.mem_fd >= 0:
                        _run_mem(&job)
                    else:
                        _run(&job)
                    if cfd >= 0 and _pidfd_exited(cfd):
                        gone_after = True
    finally:
        if addrs != addrs_small:
            PyMem_RawFree(addrs)
        if runs != runs_small:
            PyMem_RawFree(runs)
    if gone_before or gone_after:
        raise ProcessLookupError(ESRCH, f"pvm_copy: process {pid} exited "
                                 f"({'before' if gone_before else 'during'} the copy, after "
                                 f"{job.done} bytes)")
    if job.err == ESRCH:
        raise ProcessLookupError(ESRCH, f"pvm_copy: the address space of process {pid} is gone "
                                 f"(it exited or exec'd) after {job.done} bytes")
    if job.err:
        raise OSError(job.err, f"{'write' if write else 'read'} of process {pid}"
                      f"{' (/proc/pid/mem)' if mem_fd >= 0 else ''}: "
                      f"{strerror(job.err).decode(errors='replace')} after {job.done} bytes")
    if job.timed_out:
        raise TimeoutError(f"pvm_copy: {timeout_ms} ms passed after {job.done} bytes")
    if job.aborted:
        raise ConnectionAbortedError(f"pvm_copy: the owner revoked the lease after {job.done} bytes")
    return job.done


def pvm_read_bytes(pid: int, addr: int, nbytes: int) -> bytes:
    """Read ``nbytes`` (<= 4096) at ``addr`` of process ``pid``: used to probe whether one-sided
    access to a peer works (it must return the nonce the peer announced).

    Raises OSError (PermissionError, ProcessLookupError, EFAULT) like :func:`pvm_copy`."""
    if nbytes < 0 or nbytes > 4096:
        raise ValueError("pvm_read_bytes: nbytes must lie in [0, 4096]")
    cdef pid_t cpid = pid
    if pid <= 0 or cpid != pid:
        raise ValueError(f"pvm_read_bytes: invalid pid {pid}")
    cdef uintptr_t a = addr
    cdef char buf[4096]
    cdef iovec l, r
    l.iov_base = buf
    l.iov_len = <size_t>nbytes
    r.iov_base = <void *>a
    r.iov_len = <size_t>nbytes
    cdef ssize_t got
    cdef int err = 0
    if nbytes == 0:
        return b""
    with nogil:
        got = process_vm_readv(cpid, &l, 1, &r, 1, 0)
        if got < 0:
            err = errno
    if got < 0:
        raise OSError(err, f"process_vm_readv(pid {pid}): {strerror(err).decode(errors='replace')}")
    return buf[:got]


include "_xproc_bench.pxi"


include "_xproc_identity.pxi"
include "_xproc_leases.pxi"
include "_xproc_maps.pxi"
include "_xproc_mover.pxi"
