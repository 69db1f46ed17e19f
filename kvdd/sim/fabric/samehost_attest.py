"""Which process sent a message: the kernel's word for the same-host proof.

``SO_PASSPIDFD`` (Linux >= 6.5) makes the kernel attach to every message an AF_UNIX socket
receives a pidfd (``SCM_PIDFD``) on the process that *sent* that message.  The same-host proof
(:mod:`.samehost`) takes the pidfd that came with the peer's HMAC proof of the session key and
holds it for the link's life: the process attested is the one that proved the key, whoever called
``listen()`` / ``connect()`` (``SO_PEERCRED`` names those, and a key holder can let them exit so
that their pid is reused by a third process).

What a pidfd names (its pid in our pid namespace, its four uids) is asked of the pidfd itself
with one ``PIDFD_GET_INFO`` ioctl (Linux >= 6.13, about 2 µs); older kernels read
``/proc/self/fdinfo/<fd>`` and ``/proc/<pid>/status`` (about 20 µs, on every link's set-up).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

from .samehost_close import close_file

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

__all__ = ["SameHostRefused", "SO_PASSPIDFD", "SCM_PIDFD", "pidfd_passing", "pass_pidfd",
           "recv_msg", "pidfd_pid", "uids_of", "pidfd_identity", "attest", "same_sender",
           "close_fd"]


def close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


#: ``SO_PASSPIDFD`` / ``SCM_PIDFD`` (Linux >= 6.5; Python 3.11's socket module lacks the names).
#: The option number is the asm-generic one (``include/uapi/asm-generic/socket.h``), used by
#: x86-64, aarch64, riscv, arm, s390, loongarch; alpha, mips, parisc, powerpc and sparc define
#: their own, so there the path is not offered.  ``SCM_PIDFD`` is 4 everywhere (linux/socket.h).
_GENERIC_SOCKET_ABI = {"x86_64", "aarch64", "arm64", "riscv64", "s390x", "loongarch64", "armv7l",
                       "armv8l", "i686", "i386"}
SO_PASSPIDFD = 76 if os.uname().machine in _GENERIC_SOCKET_ABI else None
SCM_PIDFD = 4


class SameHostRefused(Exception):
    """The same-host path is not used for this link (the message says why); TCP carries it."""


_pidfd_check: tuple[bool, str] | None = None


def pidfd_passing() -> tuple[bool, str]:
    """The kernel attaches the sender's pidfd to AF_UNIX messages (SO_PASSPIDFD; checked once)."""
    global _pidfd_check
    if _pidfd_check is None:
        if SO_PASSPIDFD is None:
            _pidfd_check = (False, f"SO_PASSPIDFD's number is not known for {os.uname().machine}")
            return _pidfd_check
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pass_pidfd(b)
            a.sendall(b"?")
            _data, _fds, pidfd = recv_msg(b, 64)
            # (/proc itself: copies of memory that is no kvdd.empty go through /proc/<pid>/mem)
            ok = pidfd >= 0 and _fdinfo_pid(pidfd) == os.getpid() == pidfd_pid(pidfd)
            close_fd(pidfd)
            _pidfd_check = (ok, "" if ok else "/proc/self/fdinfo shows pids of another pid "
                                              "namespace (mount a procfs of this one)")
        except (OSError, SameHostRefused) as exc:
            _pidfd_check = (False, f"the kernel does not pass pidfds on AF_UNIX sockets "
                                   f"(SO_PASSPIDFD: {exc}; Linux >= 6.5 needed)")
        finally:
            a.close()
            b.close()
    return _pidfd_check


def pass_pidfd(sock: socket.socket) -> None:
    """Ask the kernel to attach the sender's pidfd (SCM_PIDFD) to every message ``sock`` gets.

    Set it on the sending side's socket too: recent kernels (6.18 here) record a message's
    sender only when one of the two sockets asks for it (or the receiver is not accepted yet), so
    a message sent just after ``accept()`` but before the acceptor's setsockopt would carry none
    (it is then refused, never misattributed)."""
    if SO_PASSPIDFD is None:
        raise SameHostRefused("SO_PASSPIDFD is not known on this architecture")
    sock.setsockopt(socket.SOL_SOCKET, SO_PASSPIDFD, 1)


# room for every fd one message can carry (SCM_MAX_FD, 253) + one SCM_PIDFD: a file that did
# not fit would be released by the kernel on this thread (a lingering socket's close waits)
_ANC = socket.CMSG_SPACE(4 * 253) + socket.CMSG_SPACE(4) + 64
# (plain ints: the socket module's flag enums cost microseconds per operation, on every link)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)


def recv_msg(sock: socket.socket, max_msg: int) -> tuple[bytes, list[int], int]:
    """One message: its bytes, the fds it carried (SCM_RIGHTS) and the sender's pidfd (-1: none).

    Raises SameHostRefused (every fd received closed) on truncation (MSG_TRUNC / MSG_CTRUNC)."""
    # close-on-exec: the peer's lease table is held for the link's life, and a program this
    # process runs meanwhile must not inherit it
    data, anc, flags, _addr = sock.recvmsg(max_msg, _ANC, _CLOEXEC)
    fds: list[int] = []
    pidfd = -1
    bad = bool(flags & _TRUNCATED)
    for level, kind, payload in anc:
        if level != _SOL_SOCKET:
            continue
        got = [int.from_bytes(payload[i:i + 4], "little", signed=True)
               for i in range(0, len(payload) - len(payload) % 4, 4)]
        if kind == _SCM_RIGHTS:
            fds.extend(got)
        elif kind == SCM_PIDFD and got:
            if pidfd >= 0 or len(got) != 1 or got[0] < 0:  # < 0: the kernel's error (sender gone)
                bad = True
            if got[0] >= 0 and pidfd < 0:
                pidfd = got[0]
            for extra in got[1:]:
                if extra >= 0:
                    fds.append(extra)
    if bad:
        for fd in fds:
            close_file(fd)
        close_fd(pidfd)
        raise SameHostRefused("truncated message during the same-host proof")
    return data, fds, pidfd


def _read_proc(path: str) -> list[bytes]:
    """The lines of a /proc file (read whole, without a text layer: it is on a link's path)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while True:
            chunk = os.read(fd, 8192)
            if not chunk:
                break
            parts.append(chunk)
    finally:
        os.close(fd)
    return b"".join(parts).split(b"\n")


#: ``PIDFD_GET_INFO``: ``_IOWR(0xFF, 11, struct pidfd_info)``, the first published struct (64
#: bytes: mask, cgroup id, then pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid)
_PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
_PIDFD_INFO_PID_CREDS = 0x3  # PIDFD_INFO_PID | PIDFD_INFO_CREDS
_INFO = struct.Struct("<QQ11I")
_info_ioctl: bool | None = None  # whether the kernel has PIDFD_GET_INFO (asked once)


def _has_info_ioctl() -> bool:
    global _info_ioctl
    if _info_ioctl is None:
        assert _xproc is not None
        fd = _xproc.pidfd_open(os.getpid())
        try:
            got = _ioctl_info(fd)
            _info_ioctl = got is not None and got[0] == os.getpid()
        except OSError:
            _info_ioctl = False
        finally:
            os.close(fd)
    return _info_ioctl


def _ioctl_info(pidfd: int) -> tuple[int, tuple[int, ...]] | None:
    """``(pid, (ruid, euid, suid, fsuid))`` from PIDFD_GET_INFO; ``(-1, ())`` for an exited
    (reaped) process; None when the answer lacks pid or creds."""
    buf = bytearray(64)
    struct.pack_into("<Q", buf, 0, _PIDFD_INFO_PID_CREDS)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf, True)
    except ProcessLookupError:  # ESRCH: exited and reaped (or not in our pid namespace)
        return -1, ()
    mask, _cgroup, pid, _tgid, _ppid, ruid, _rgid, euid, _egid, suid, _sgid, fsuid, _fsgid = \
        _INFO.unpack_from(buf)
    if mask & _PIDFD_INFO_PID_CREDS != _PIDFD_INFO_PID_CREDS:
        return None
    return pid, (ruid, euid, suid, fsuid)


def pidfd_identity(pidfd: int) -> tuple[int, tuple[int, ...]]:
    """``(pid, (ruid, euid, suid, fsuid))`` of the process behind ``pidfd``, the pid in our pid
    namespace: pid -1 (no uids) when it exited, 0 when it is in no namespace of ours.  Raises
    SameHostRefused for an fd that is not a pidfd; OSError when the /proc read of its uids fails
    (kernels without PIDFD_GET_INFO: it exited meanwhile)."""
    if _has_info_ioctl():
        try:
            got = _ioctl_info(pidfd)
        except OSError as exc:
            if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EBADF):
                raise SameHostRefused("the kernel's pidfd carries no pid (not a pidfd)") from None
            raise
        if got is not None:
            return got
    pid = _fdinfo_pid(pidfd)
    return pid, (uids_of(pid) if pid > 0 else ())


def pidfd_pid(pidfd: int) -> int:
    """The pid (in our pid namespace) of the process behind ``pidfd``: -1 exited, 0 elsewhere."""
    if _has_info_ioctl():
        return pidfd_identity(pidfd)[0]
    return _fdinfo_pid(pidfd)


def _fdinfo_pid(pidfd: int) -> int:
    for line in _read_proc(f"/proc/self/fdinfo/{pidfd}"):
        if line.startswith(b"Pid:"):
            return int(line.split()[1])
    raise SameHostRefused("the kernel's pidfd carries no pid (not a pidfd)")


def uids_of(pid: int) -> tuple[int, ...]:
    """Real, effective, saved and filesystem uid of ``pid`` (``/proc/<pid>/status``)."""
    for line in _read_proc(f"/proc/{pid}/status"):
        if line.startswith(b"Uid:"):
            return tuple(int(x) for x in line.split()[1:5])
    raise SameHostRefused(f"/proc/{pid}/status has no Uid line")


def attest(pidfd: int) -> tuple[int, int, int]:
    """The identity of the process that sent the proof: ``(pid, uid, pidfd)`` from the pidfd the
    kernel attached to that very message (SCM_PIDFD).  Same uid required; the pidfd is closed on
    refusal, kept otherwise."""
    assert _xproc is not None
    try:
        usable, why = pidfd_passing()  # also: /proc is of our pid namespace
        if not usable:
            raise SameHostRefused(why)
        if pidfd < 0:
            raise SameHostRefused("the kernel attached no pidfd to the proof (SO_PASSPIDFD)")
        try:
            pid, uids = pidfd_identity(pidfd)
        except OSError:  # (/proc: its status went between the two reads)
            raise SameHostRefused("the peer process exited during the proof") from None
        if pid <= 0 or pid == os.getpid():
            raise SameHostRefused("the kernel reports no usable peer process")
        if not _xproc.pidfd_alive(pidfd):  # (/proc: so the read above was of this very process)
            raise SameHostRefused("the peer process exited during the proof")
        me = os.getuid()
        other = next((u for u in uids if u != me), None)
        if other is not None:
            raise SameHostRefused(
                f"the process at the other end runs as uid {other} (real, effective, saved, "
                f"filesystem: {', '.join(map(str, uids))}), not {me}")
    except BaseException:
        close_fd(pidfd)
        raise
    return pid, uids[1], pidfd


def same_sender(pidfd: int, pid: int) -> None:
    """A later message's sender (its SCM_PIDFD, closed here) must be the attested process."""
    try:
        if pidfd < 0 or pidfd_pid(pidfd) != pid:
            raise SameHostRefused("a later proof message came from another process")
    finally:
        close_fd(pidfd)
