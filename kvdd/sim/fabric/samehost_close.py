"""Closing files a same-host peer handed us, off the link's set-up thread.

A file that came from a peer — taken from the owner with ``pidfd_getfd`` (:mod:`.samehost_shm`)
or received over the proof's AF_UNIX socket with ``SCM_RIGHTS`` (the lease table) — can make
``close`` wait as long as the peer likes:

* a file on a FUSE mount the peer serves: ``close`` sends FLUSH and waits for the answer (the
  wait cannot be interrupted but by killing the process);
* a TCP socket with ``SO_LINGER`` whose peer never reads (the sender closed its own copy, so ours
  is the last): the last ``close`` waits the linger time (up to 2^31 s) for the FIN to be
  acknowledged.  No privilege needed.  The same wait runs when the kernel drops such a file for
  us: a message whose ``SCM_RIGHTS`` did not fit the control buffer, or an AF_UNIX socket
  closed with such a message still queued (the kernel releases the file on the thread that
  received or closed).

So every such close is handed to :func:`close_file` / :func:`close_socket`: one daemon thread
(``kvdd-samehost-closer``) closes them in order, and a close that hangs holds that thread and
the files queued behind it, not the link.  What a peer can make us spend is bounded by
admission, not by refusing a file already here: the link set-up asks :func:`room` before it
takes or receives a peer's file (``pidfd_getfd``, the proof's messages); with
:data:`MAX_PENDING` closes pending, a link maps nothing more (its copies go through
``/proc/<pid>/mem``) or declines the path (TCP).  Files already received are always queued
(never closed inline, never leaked): at most :data:`MAX_PENDING` plus the files of the messages
and takes already admitted (one file per ``pidfd_getfd``; a proof message carries at most one
fd that kvdd keeps, and at most ``SCM_MAX_FD`` (253) in all).

A memfd (``F_GET_SEALS`` succeeds: shmem or hugetlbfs, which define no flush) is closed at once
on the caller's thread when it holds at most :data:`FREE_INLINE` bytes of memory; a larger one
on the unmapper thread: when ours is the last reference its release frees its pages (about
0.2 s per GiB), which always ends but need not hold the caller.  Such closes count against
:data:`MAX_PENDING` with the closer's (:func:`room`): the unmapper is busy as long as freeing an
exited owner's memory takes, and a peer announcing many large memfds (one fd each) would
otherwise have the fds pile up meanwhile (measured: 256 fds held by one link's set-up).

``SO_PASSRIGHTS`` (Linux >= 6.16, :func:`refuse_files` / :func:`accept_files`): the proof's
sockets refuse ``SCM_RIGHTS`` until the peer has proven the session key, so a local process
without the secret cannot hand the endpoint any file at all (its ``sendmsg`` fails with EPERM).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["MAX_PENDING", "SO_PASSRIGHTS", "close_file", "close_socket", "close_stranger", "room", "pending",
           "wait_room", "refuse_files", "accept_files", "files_refusable", "idle", "unmap_later",
           "unmaps_idle"]

#: Closes of peers' files that may wait at once (beyond it: links decline to take more).
MAX_PENDING = 64
#: Bytes of memory a peer's memfd may hold to be closed on the caller's thread (its pages are
#: freed there when ours is the last reference).
FREE_INLINE = 64 << 20
#: ``SO_PASSRIGHTS`` (Linux >= 6.16): the asm-generic number, used only where
#: :data:`.samehost_attest.SO_PASSPIDFD` is known (the same architectures).
SO_PASSRIGHTS = 83


class _Closer:
    """One daemon thread closing queued files in order."""

    def __init__(self, name: str, cv: threading.Condition) -> None:
        self.name = name
        self.cv = cv  # (shared by both threads: room() counts the files queued on either)
        self.queue: deque[tuple[Callable[[], None], bool]] = deque()
        self.busy = 0  # 1 while the thread runs a close
        self.files = 0  # closes of peers' files queued or running (put with file=True)
        self.thread: threading.Thread | None = None

    def pending(self) -> int:
        with self.cv:
            return len(self.queue) + self.busy

    def put(self, close: Callable[[], None], file: bool = False) -> None:
        with self.cv:
            self.queue.append((close, file))
            self.files += file
            self.cv.notify_all()  # (the condition is shared: wake this thread whichever waits)
            if self.thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread now: queued, the next put tries again
                    logger.warning("kvdd same-host: cannot start the closer thread: %s", exc)
                else:
                    self.thread = thread

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                close, file = self.queue.popleft()
                self.busy = 1
            try:
                close()
            except OSError as exc:  # the fd is gone whatever close says (a failed flush)
                logger.info("kvdd same-host: closing a peer's file: %s", exc)
            except Exception:  # pragma: no cover (never raised by os.close / socket.close)
                logger.exception("kvdd same-host: releasing a peer's file or memory failed")
            finally:
                with self.cv:
                    self.busy = 0
                    self.files -= file
                    self.cv.notify_all()

    def idle(self, timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: not self.queue and not self.busy, timeout_s)

    def after_fork(self, cv: threading.Condition) -> None:
        """In a forked child: the queued fds are the child's too (its copies); no thread runs."""
        self.cv = cv
        self.busy = 0
        self.files = 0
        self.thread = None
        if self.queue:
            queued = list(self.queue)
            self.queue.clear()
            for close, file in queued:
                self.put(close, file)


# One condition for both threads: the bound on pending closes of peers' files (room) counts the
# closer's queue and the files queued on the unmapper together.
_cv = threading.Condition()
_closer = _Closer("kvdd-samehost-closer", _cv)
# Unmapping a peer's memory (PeerMaps.close) frees the pages when ours was the last reference
# (the owner exited): ~0.2 s per GiB of its cache, on the thread that unmaps.  That always ends,
# so it has a thread of its own (a close hung on the closer never holds it).
_unmapper = _Closer("kvdd-samehost-unmap", _cv)


def _after_fork() -> None:
    cv = threading.Condition()
    _closer.after_fork(cv)
    _unmapper.after_fork(cv)


os.register_at_fork(after_in_child=_after_fork)


def _pending() -> int:  # (the shared condition held)
    return len(_closer.queue) + _closer.busy + _unmapper.files


def room() -> bool:
    """True while fewer than :data:`MAX_PENDING` closes of peers' files are pending (on the
    closer, or large memfds on the unmapper, which is busy as long as freeing an exited
    owner's memory takes): only then does a link set-up take or receive another file of its
    peer."""
    return pending() < MAX_PENDING


def pending() -> int:
    """Closes of peers' files queued or running now (the closer's and the unmapper's)."""
    with _cv:
        return _pending()


def wait_room(timeout_s: float) -> bool:
    """Wait until :func:`room` (at most ``timeout_s``); its value then."""
    with _cv:
        return _cv.wait_for(lambda: _pending() < MAX_PENDING, timeout_s)


def idle(timeout_s: float) -> bool:
    """Wait until no close is pending (tests); False when ``timeout_s`` passed first."""
    return _closer.idle(timeout_s)


def unmap_later(unmap: Callable[[], None]) -> None:
    """Run ``unmap`` (a :class:`kvdd._native._xproc.PeerMaps`'s ``close``: no copy may use it
    any more) on the unmapper thread: a link's close or a copy's end never waits for the freeing
    of an exited owner's cache memory."""
    _unmapper.put(unmap)


def unmaps_idle(timeout_s: float) -> bool:
    """Wait until no unmapping is pending (tests); False when ``timeout_s`` passed first."""
    return _unmapper.idle(timeout_s)


def _memfd_bytes(fd: int) -> int:
    """Bytes of memory the memfd ``fd`` holds, or -1 when it is no memfd."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # first: asks no file system
        return int(os.fstat(fd).st_blocks) * 512  # (shmem / hugetlbfs: no file system waits)
    except OSError:
        return -1


def close_file(fd: int) -> None:
    """Close ``fd``, a file a peer handed us, never waiting: a memfd of at most
    :data:`FREE_INLINE` bytes at once, a larger one on the unmapper thread, anything else on the
    closer thread (an error of ``close`` is logged, the fd is gone all the same)."""
    if fd < 0:
        return
    held = _memfd_bytes(fd)
    if 0 <= held <= FREE_INLINE:
        try:
            os.close(fd)
        except OSError as exc:  # (shmem defines no flush; EINTR, EIO of a hook)
            logger.info("kvdd same-host: closing a peer's memfd: %s", exc)
    elif held > FREE_INLINE:
        _unmapper.put(lambda: os.close(fd), file=True)  # (counted by room: bounded)
    else:
        _closer.put(lambda: os.close(fd))


# sockets that accepted files at some time (accept_files): their close may release them
_accepting: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def close_socket(sock: socket.socket) -> None:
    """Close an AF_UNIX socket a peer may have queued files on (the proof's): at once when it
    never accepted any (:func:`refuse_files` held from its start, where the kernel can refuse
    them), else on the closer thread (files still queued in it are released by that close)."""
    if files_refusable() and sock not in _accepting:
        sock.close()
        return
    refuse_files(sock)  # no more files queued from now on (where the kernel can refuse them)
    _accepting.discard(sock)
    _closer.put(sock.close)


def close_stranger(fd: int) -> None:
    """Close an accepted connection that never accepted files (a listening socket with
    :func:`refuse_files` passes that on): at once where the kernel refuses files, else on the
    closer thread."""
    if files_refusable():
        os.close(fd)
    else:
        _closer.put(lambda: os.close(fd))


def refuse_files(sock: socket.socket) -> None:
    """``SO_PASSRIGHTS`` off: a peer's ``sendmsg`` with ``SCM_RIGHTS`` to ``sock`` fails (EPERM)
    instead of queueing a file here (an accepted socket inherits it from its listening socket).
    Nothing where the kernel lacks it (Linux < 6.16)."""
    _passrights(sock, 0)


def accept_files(sock: socket.socket) -> None:
    """``SO_PASSRIGHTS`` on (the peer proved the key: its lease table may come); the socket's
    close then goes to the closer (:func:`close_socket`)."""
    _accepting.add(sock)
    _passrights(sock, 1)


_refusable: bool | None = None


def files_refusable() -> bool:
    """The kernel can refuse a socket's incoming files (``SO_PASSRIGHTS``; checked once)."""
    global _refusable
    if _refusable is None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            _refusable = _passrights(b, 0)
            if _refusable:
                try:
                    socket.send_fds(a, [b"?"], [a.fileno()])
                    _refusable = False  # the option is another one here
                except PermissionError:
                    pass
        finally:
            a.close()
            b.close()
    return _refusable


_generic_abi: bool | None = None  # SO_PASSPIDFD's number is known here (asked once)


def _passrights(sock: socket.socket, value: int) -> bool:
    global _generic_abi
    if _generic_abi is None:
        from .samehost_attest import SO_PASSPIDFD  # (it imports this module)
        _generic_abi = SO_PASSPIDFD is not None
    if not _generic_abi:  # another architecture's numbers
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, value)
    except OSError:  # ENOPROTOOPT (Linux < 6.16), or a closed socket
        return False
    return True
