# Included by _xproc.pyx: the bare process_vm baselines `kvdd bench --cross-process` compares with
# (one plain loop, and the same scattered runs in one call). Not used by the data path.

def pvm_bench(pid: int, local not None, remote: int, nbytes: int, write: bool) -> int:
    """One plain ``process_vm_readv`` / ``process_vm_writev`` loop of ``nbytes`` between a local
    region and a remote address (single iovec each side, GIL released): the raw mechanism the
    benchmarks compare the fabric against.  Returns the bytes moved; raises OSError on failure."""
    if type(local) is not Region:
        raise TypeError("pvm_bench: local must be a Region")
    if nbytes < 0 or nbytes > local.nbytes:
        raise ValueError("pvm_bench: nbytes must lie in [0, local.nbytes]")
    cdef pid_t cpid = pid
    cdef iovec l, r
    cdef uintptr_t la = local.addr, ra = remote
    cdef size_t left = <size_t>nbytes, done = 0
    cdef ssize_t got = 0
    cdef int err = 0
    cdef bint w = bool(write)
    with nogil:
        while left > 0:
            l.iov_base = <void *>(la + done)
            l.iov_len = left
            r.iov_base = <void *>(ra + done)
            r.iov_len = left
            if w:
                got = process_vm_writev(cpid, &l, 1, &r, 1, 0)
            else:
                got = process_vm_readv(cpid, &l, 1, &r, 1, 0)
            if got < 0:
                if errno == EINTR:
                    continue
                err = errno
                break
            if got == 0:
                err = EFAULT
                break
            done += <size_t>got
            left -= <size_t>got
    if err:
        raise OSError(err, f"pvm_bench(pid {pid}): {strerror(err).decode(errors='replace')}")
    return done


def pvm_bench_runs(pid: int, local not None, remote: int, local_off, remote_off, length,
                   write: bool) -> int:
    """The bare mechanism for scattered runs: ``process_vm_readv`` / ``writev`` of the runs
    ``local.addr + local_off[j]`` <-> ``remote + remote_off[j]`` (``length[j]`` bytes), 1024
    iovecs per call, GIL released, no checks of the remote side (a benchmark limit, not a data
    path).  Returns the bytes moved; raises OSError on failure."""
    if type(local) is not Region:
        raise TypeError("pvm_bench_runs: local must be a Region")
    cdef Py_ssize_t J = len(length), j, n, i
    cdef int64_t *runs = <int64_t *>PyMem_RawMalloc(<size_t>(3 * J + 1) * sizeof(int64_t))
    if runs == NULL:
        raise MemoryError()
    cdef iovec liov[_IOV_MAX]
    cdef iovec riov[_IOV_MAX]
    cdef pid_t cpid = pid
    cdef uintptr_t la = local.addr, ra = remote
    cdef int64_t lsize = local.nbytes
    cdef ssize_t got = 0
    cdef size_t done = 0
    cdef int err = 0
    cdef bint w = bool(write)
    try:
        _gather(local_off, runs, J, "local_off")
        _gather(remote_off, runs + J, J, "remote_off")
        _gather(length, runs + 2 * J, J, "length")
        for j in range(J):
            if runs[2 * J + j] < 0 or runs[j] < 0 or runs[j] + runs[2 * J + j] > lsize:
                raise ValueError(f"pvm_bench_runs: run {j} is outside the local region")
        with nogil:
            j = 0
            while j < J and err == 0:
                n = 0
                while j < J and n < _IOV_MAX:
                    liov[n].iov_base = <void *>(la + <uintptr_t>runs[j])
                    liov[n].iov_len = <size_t>runs[2 * J + j]
                    riov[n].iov_base = <void *>(ra + <uintptr_t>runs[J + j])
                    riov[n].iov_len = <size_t>runs[2 * J + j]
                    n += 1
                    j += 1
                i = 0
                while i < n:
                    if w:
                        got = process_vm_writev(cpid, &liov[i], <unsigned long>(n - i), &riov[i],
                                                <unsigned long>(n - i), 0)
                    else:
                        got = process_vm_readv(cpid, &liov[i], <unsigned long>(n - i), &riov[i],
                                               <unsigned long>(n - i), 0)
                    if got < 0:
                        if errno == EINTR:
                            continue
                        err = errno
                        break
                    if got == 0:
                        err = EFAULT
                        break
                    done += <size_t>got
                    i = _advance(liov, riov, i, n, got)
    finally:
        PyMem_RawFree(runs)
    if err:
        raise OSError(err, f"pvm_bench_runs(pid {pid}): {strerror(err).decode(errors='replace')}")
    return done


def mem_bench_runs(int fd, local not None, remote: int, local_off, remote_off, length,
                   write: bool) -> int:
    """The bare mechanism of the data path: ``pread`` / ``pwrite`` on an open
    ``/proc/<pid>/mem`` (``fd``), one system call per run ``local.addr + local_off[j]`` <->
    ``remote + remote_off[j]`` (``length[j]`` bytes), GIL released, no checks of the remote side
    (a benchmark limit).  Returns the bytes moved; raises OSError on failure."""
    if type(local) is not Region:
        raise TypeError("mem_bench_runs: local must be a Region")
    cdef Py_ssize_t J = len(length), j
    cdef int64_t *runs = <int64_t *>PyMem_RawMalloc(<size_t>(3 * J + 1) * sizeof(int64_t))
    if runs == NULL:
        raise MemoryError()
    cdef uintptr_t la = local.addr, ra = remote
    cdef int64_t lsize = local.nbytes, pos, left
    cdef ssize_t got = 0
    cdef size_t done = 0
    cdef int err = 0
    cdef bint w = bool(write)
    try:
        _gather(local_off, runs, J, "local_off")
        _gather(remote_off, runs + J, J, "remote_off")
        _gather(length, runs + 2 * J, J, "length")
        for j in range(J):
            if runs[2 * J + j] < 0 or runs[j] < 0 or runs[j] + runs[2 * J + j] > lsize:
                raise ValueError(f"mem_bench_runs: run {j} is outside the local region")
        with nogil:
            for j in range(J):
                pos = 0
                left = runs[2 * J + j]
                while left > 0 and err == 0:
                    if w:
                        got = pwrite(fd, <const void *>(la + <uintptr_t>(runs[j] + pos)),
                                     <size_t>left, <long>(ra + <uintptr_t>(runs[J + j] + pos)))
                    else:
                        got = pread(fd, <void *>(la + <uintptr_t>(runs[j] + pos)), <size_t>left,
                                    <long>(ra + <uintptr_t>(runs[J + j] + pos)))
                    if got < 0:
                        if errno == EINTR:
                            continue
                        err = errno
                    elif got == 0:
                        err = ESRCH
                    else:
                        done += <size_t>got
                        pos += got
                        left -= got
                if err:
                    break
    finally:
        PyMem_RawFree(runs)
    if err:
        raise OSError(err, f"mem_bench_runs: {strerror(err).decode(errors='replace')}")
    return done
