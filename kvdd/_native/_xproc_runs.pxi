# Included by _xproc.pyx: the copy loops of pvm_copy and the compiled mover — one job of runs
# moved with process_vm_readv/writev (_run) or pread/pwrite on the peer's /proc/<pid>/mem
# (_run_mem), the deadline and the owner's abort checked before every system call (_stop).


cdef inline Py_ssize_t _advance(iovec *liov, iovec *riov, Py_ssize_t i, Py_ssize_t n,
                                 ssize_t done) noexcept nogil:
    """Skip ``done`` bytes that one process_vm call moved over the iovec pairs from ``i`` on (the
    local and remote lists advance together); return the index of the first pair not finished."""
    while done > 0 and i < n:
        if <size_t>done >= liov[i].iov_len:
            done -= <ssize_t>liov[i].iov_len
            i += 1
        else:
            liov[i].iov_base = <void *>(<uintptr_t>liov[i].iov_base + <uintptr_t>done)
            liov[i].iov_len -= <size_t>done
            riov[i].iov_base = <void *>(<uintptr_t>riov[i].iov_base + <uintptr_t>done)
            riov[i].iov_len -= <size_t>done
            done = 0
    return i


cdef enum:
    _ABORT = 4  # LEASE_ABORT: a state word at least this stops a running copy between calls

cdef struct _Job:
    pid_t pid
    int mem_fd            # /proc/<pid>/mem of the attested peer (names its memory), or -1
    bint write
    Py_ssize_t K
    Py_ssize_t J
    const uintptr_t *laddr
    const uintptr_t *raddr
    const int64_t *loff
    const int64_t *roff
    const int64_t *ln
    uint64_t chunk
    int64_t deadline      # CLOCK_MONOTONIC ns, or -1
    uint64_t done         # bytes moved
    int err               # errno of the failure, 0 on success
    bint timed_out
    uint64_t *abort_word  # a lease-table slot state word: >= _ABORT stops the copy, or NULL
    uint64_t *abort_link  # the table's link state word (same meaning), or NULL
    bint aborted


cdef void _run(_Job *job) noexcept nogil:
    cdef iovec liov[_IOV_MAX]
    cdef iovec riov[_IOV_MAX]
    cdef Py_ssize_t k = 0, j = 0, n, i
    cdef int64_t pos = 0, take, left
    cdef uint64_t batch
    cdef ssize_t r
    while k < job.K:
        # fill one batch: at most _IOV_MAX pairs and `chunk` bytes
        n = 0
        batch = 0
        while k < job.K and n < _IOV_MAX and batch < job.chunk:
            left = job.ln[j] - pos
            if left <= 0:
                pos = 0
                j += 1
                if j == job.J:
                    j = 0
                    k += 1
                continue
            take = left
            if <uint64_t>take > job.chunk - batch:
                take = <int64_t>(job.chunk - batch)
            liov[n].iov_base = <void *>(job.laddr[k] + <uintptr_t>(job.loff[j] + pos))
            liov[n].iov_len = <size_t>take
            riov[n].iov_base = <void *>(job.raddr[k] + <uintptr_t>(job.roff[j] + pos))
            riov[n].iov_len = <size_t>take
            n += 1
            batch += <uint64_t>take
            pos += take
        if n == 0:
            break
        # move the batch, resuming after partial transfers
        i = 0
        while i < n:
            # the deadline right before every system call: a reader delayed before
            # this point starts no copy once its lease is over
            if job.deadline >= 0 and _now_ns() > job.deadline:
                job.timed_out = True
                return
            if job.abort_word != NULL and (kvdd_load(job.abort_word) >= _ABORT or
                                           kvdd_load(job.abort_link) >= _ABORT):
                job.aborted = True
                return
            if job.write:
                r = process_vm_writev(job.pid, &liov[i], <unsigned long>(n - i), &riov[i],
                                      <unsigned long>(n - i), 0)
            else:
                r = process_vm_readv(job.pid, &liov[i], <unsigned long>(n - i), &riov[i],
                                     <unsigned long>(n - i), 0)
            if r < 0:
                if errno == EINTR:
                    continue
                job.err = errno
                return
            if r == 0:
                job.err = EFAULT  # no progress: the remote range is not mapped
                return
            job.done += <uint64_t>r
            i = _advance(liov, riov, i, n, r)
    # a copy whose last system call ended past the deadline is reported as timed out, not done
    if job.deadline >= 0 and _now_ns() > job.deadline:
        job.timed_out = True


cdef inline bint _stop(_Job *job) noexcept nogil:
    """The deadline and the owner's abort, checked right before every system call."""
    if job.deadline >= 0 and _now_ns() > job.deadline:
        job.timed_out = True
        return True
    if job.abort_word != NULL and (kvdd_load(job.abort_word) >= _ABORT or
                                   kvdd_load(job.abort_link) >= _ABORT):
        job.aborted = True
        return True
    return False


cdef void _run_mem(_Job *job) noexcept nogil:
    """The runs with ``pread`` / ``pwrite`` on the peer's ``/proc/<pid>/mem`` (at most ``chunk``
    bytes per system call).  The file names the peer's address space (its mm), not its pid: after
    the peer exits or execs every call returns 0 (ESRCH here), whoever reuses the pid.  The kernel
    copies page by page without waiting on a userfaultfd: a page the peer froze (or unmapped)
    fails at once with EIO (EFAULT here)."""
    cdef Py_ssize_t k, j
    cdef int64_t pos, left, take
    cdef ssize_t r
    cdef uintptr_t la, ra
    for k in range(job.K):
        for j in range(job.J):
            pos = 0
            left = job.ln[j]
            while left > 0:
                if _stop(job):
                    return
                take = left
                if <uint64_t>take > job.chunk:
                    take = <int64_t>job.chunk
                la = job.laddr[k] + <uintptr_t>(job.loff[j] + pos)
                ra = job.raddr[k] + <uintptr_t>(job.roff[j] + pos)
                if job.write:
                    r = pwrite(job.mem_fd, <const void *>la, <size_t>take, <long>ra)
                else:
                    r = pread(job.mem_fd, <void *>la, <size_t>take, <long>ra)
                if r < 0:
                    if errno == EINTR:
                        continue
                    job.err = EFAULT if errno == EIO else errno
                    return
                if r == 0:
                    job.err = ESRCH  # the address space is gone: the peer exited or exec'd
                    return
                job.done += <uint64_t>r
                pos += r
                left -= r
    if job.deadline >= 0 and _now_ns() > job.deadline:
        job.timed_out = True


cdef enum:
    _SMALL = 16   # tensors / runs handled without any heap allocation


cdef inline bint _pidfd_exited(int fd) noexcept nogil:
    """True when the process behind pidfd ``fd`` has exited (POLLIN), or the fd is unusable."""
    cdef pollfd p
    cdef int r
    p.fd = fd
    p.events = POLLIN
    p.revents = 0
    while True:
        r = poll(&p, 1, 0)
        if r < 0 and errno == EINTR:
            continue
        return r != 0
