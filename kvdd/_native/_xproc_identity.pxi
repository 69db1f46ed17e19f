# Included by _xproc.pyx: process handles for the same-host path's identity proof and copies.

# ---- process identity ------------------------------------------------------------------------------


def pidfd_open(pid: int) -> int:
    """``pidfd_open(pid, 0)``: a file descriptor that refers to this very process (not to whatever
    later reuses the pid).  The caller owns it (``os.close``).

    Raises
    ------
    ProcessLookupError
        ESRCH: no such process.
    OSError
        ENOSYS (kernel < 5.3), EMFILE, ...
    """
    if pid <= 0 or pid > 0x7FFFFFFF:
        raise ValueError(f"pidfd_open: invalid pid {pid}")
    cdef long fd
    cdef int err = 0, cpid = pid
    with nogil:
        fd = kvdd_pidfd_open(cpid)
        if fd < 0:
            err = errno
    if fd < 0:
        raise OSError(err, f"pidfd_open({pid}): {strerror(err).decode(errors='replace')}")
    return fd


def pidfd_alive(fd: int) -> bool:
    """True while the process behind pidfd ``fd`` has not exited (``poll`` for POLLIN, 0 ms).
    A zombie counts as exited.  False as well for an fd that is not a pidfd."""
    if fd < 0:
        raise ValueError("pidfd_alive: negative fd")
    cdef int cfd = fd
    cdef bint gone
    with nogil:
        gone = _pidfd_exited(cfd)
    return not gone


def mem_open(pid: int, pidfd: int) -> int:
    """Open ``/proc/<pid>/mem`` read-write for :func:`pvm_copy`'s ``mem_fd``, proven to be the
    memory of the process that pidfd ``pidfd`` holds: the file is bound to the address space of
    the process ``pid`` named at ``open`` time, and the pidfd is checked *after* the open (a
    process that has not exited still holds its pid, so the open found that very process).
    The caller owns the fd (``os.close``).

    Raises
    ------
    ProcessLookupError
        The process exited (before or during the open).
    PermissionError
        The kernel refuses ptrace access to it (``PTRACE_MODE_ATTACH``).
    OSError
        Any other failure of ``open``.
    """
    if pid <= 0 or pid > 0x7FFFFFFF:
        raise ValueError(f"mem_open: invalid pid {pid}")
    if pidfd < 0:
        raise ValueError("mem_open: a pidfd of the process is required")
    cdef char path[64]
    cdef int fd, err = 0, cpidfd = pidfd
    cdef bint gone = False
    snprintf(path, 64, "/proc/%d/mem", <int>pid)
    with nogil:
        fd = c_open(path, O_RDWR | O_CLOEXEC)
        if fd < 0:
            err = errno
        elif _pidfd_exited(cpidfd):
            c_close(fd)
            gone = True
    if gone or err == ENOENT:
        raise ProcessLookupError(ESRCH, f"mem_open: process {pid} exited")
    if fd < 0:
        raise OSError(err, f"open(/proc/{pid}/mem): {strerror(err).decode(errors='replace')}")
    return fd


def peer_cred(fd: int) -> tuple[int, int, int]:
    """``SO_PEERCRED`` of a connected AF_UNIX socket: ``(pid, uid, gid)`` of the process at the
    other end, as the kernel recorded it at ``connect`` / ``listen`` time.

    Raises OSError (ENOTCONN, ENOTSOCK, ...)."""
    cdef kvdd_ucred cred
    cdef unsigned int n = sizeof(cred)
    cdef int cfd = fd, r, err = 0
    with nogil:
        r = getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &n)
        if r < 0:
            err = errno
    if r < 0:
        raise OSError(err, f"SO_PEERCRED: {strerror(err).decode(errors='replace')}")
    if n != sizeof(cred):
        raise OSError(EFAULT, "SO_PEERCRED: short answer")
    return cred.pid, cred.uid, cred.gid
