"""Files whose ``close`` waits as long as their maker likes, for the same-host closer tests.

* :class:`LingeringSocket`: a TCP socket with ``SO_LINGER`` whose peer never reads (its send
  buffer full): the *last* close of it waits the linger time for the FIN to be acknowledged (no
  privilege needed).  :meth:`LingeringSocket.release` resets the peer (the wait ends).
* :class:`FuseFile`: a file on a FUSE mount served by a thread of this process that never answers
  FLUSH: *every* close of it waits until the connection is aborted (:meth:`FuseFile.abort`).
  Needs the right to mount (root with /dev/fuse); :func:`fuse_mount_error` says why not.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import tempfile
import threading
import time


class LingeringSocket:
    def __init__(self, linger_s: int) -> None:
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (accepted: inherited)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(1)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.sock.connect(self._srv.getsockname())
        self._peer, _ = self._srv.accept()
        self.sock.setblocking(False)
        stalled = 0  # until the peer's window is closed and our send queue full
        while stalled < 3:
            try:
                self.sock.send(b"x" * 65536)
                stalled = 0
            except BlockingIOError:
                stalled += 1
                time.sleep(0.02)
        self.sock.setblocking(True)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))

    def fileno(self) -> int:
        return self.sock.fileno()

    def unsent(self) -> int:
        """Bytes still in the send queue (``SIOCOUTQ``): nonzero, the last close lingers."""
        buf = fcntl.ioctl(self.sock.fileno(), 0x5411, b"\0" * 4)  # SIOCOUTQ (TIOCOUTQ)
        return int(struct.unpack("i", buf)[0])

    def drop_own(self) -> None:
        """Close this copy (after sending it): the receiver's close is then the last."""
        self.sock.close()

    def release(self) -> None:
        """Reset the connection: a close waiting on the linger returns."""
        self._peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._peer.close()
        self._srv.close()
        self.sock.close()


# ---- a FUSE file that never answers FLUSH ------------------------------------------------------

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header (40 bytes)
_OUT = struct.Struct("<IiQ")  # fuse_out_header
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
FUSE_LOOKUP, FUSE_GETATTR, FUSE_OPEN, FUSE_RELEASE, FUSE_FLUSH, FUSE_INIT = 1, 3, 14, 18, 25, 26
FUSE_INTERRUPT, FUSE_FORGET, FUSE_BATCH_FORGET = 36, 2, 42


def _attr(ino: int, mode: int) -> bytes:
    return _ATTR.pack(ino, 4096, 8, 0, 0, 0, 0, 0, 0, mode, 1, os.getuid(), os.getgid(), 0,
                      4096, 0)


def fuse_mount_error() -> str:
    """'' when this process can mount a FUSE file system, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        f = FuseFile()
    except OSError as exc:
        return f"cannot mount FUSE here ({exc})"
    f.close()
    return ""


class FuseFile:
    """A mount with one regular file ``f`` (opened: :attr:`fd`) whose FLUSH is never answered."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.dir = tempfile.mkdtemp(prefix="kvdd-fuse-")
        self._dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = (f"fd={self._dev},rootmode=40000,user_id={os.getuid()},"
                f"group_id={os.getgid()}").encode()
        if self._libc.mount(b"kvdd-test", self.dir.encode(), b"fuse", 0, opts) != 0:
            err = ctypes.get_errno()
            os.close(self._dev)
            os.rmdir(self.dir)
            raise OSError(err, os.strerror(err))
        self.flushes = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.conn = os.minor(os.stat(self.dir).st_dev)  # /sys/fs/fuse/connections/<n>
        try:
            self._control()
            self.fd = os.open(os.path.join(self.dir, "f"), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self.close()
            raise

    def _control(self) -> None:
        """The connection's abort file (the only way to fail a FLUSH nobody answers, so that the
        file can be closed): the fuse control file system is mounted if it is not; OSError when
        neither is possible (nothing was opened yet: the mount goes without a FLUSH)."""
        abort = f"/sys/fs/fuse/connections/{self.conn}/abort"
        if not os.path.exists(abort):
            self._libc.mount(b"fusectl", b"/sys/fs/fuse/connections", b"fusectl", 0, None)
        if not os.path.exists(abort):
            raise OSError(errno.ENOENT, "no fuse control file system (fusectl) to abort a connection")

    def _reply(self, unique: int, body: bytes = b"", error: int = 0) -> None:
        try:
            os.write(self._dev, _OUT.pack(_OUT.size + len(body), -error, unique) + body)
        except OSError:
            pass

    def _serve(self) -> None:
        while True:
            try:
                req = os.read(self._dev, 1 << 17)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ENOENT):
                    continue
                return  # ENODEV: aborted / unmounted
            _len, op, unique, node, *_ = _IN.unpack_from(req)
            if op == FUSE_INIT:
                major, minor, readahead, _flags = struct.unpack_from("<IIII", req, _IN.size)
                out = struct.pack("<IIIIHHIIHHII", 7, 31, readahead, 0, 16, 12, 4096, 0, 1, 0,
                                  0, 0) + b"\0" * 24
                self._reply(unique, out)
            elif op == FUSE_LOOKUP:
                self._reply(unique, struct.pack("<QQQQII", 2, 0, 0, 0, 0, 0) +
                            _attr(2, 0o100600))
            elif op == FUSE_GETATTR:
                attr = _attr(1, 0o40700) if node == 1 else _attr(2, 0o100600)
                self._reply(unique, struct.pack("<QII", 0, 0, 0) + attr)
            elif op == FUSE_OPEN:
                self._reply(unique, struct.pack("<QIi", 1, 0, 0))
            elif op == FUSE_FLUSH:
                self.flushes += 1  # never answered
            elif op in (FUSE_INTERRUPT, FUSE_FORGET, FUSE_BATCH_FORGET):
                pass  # no answer expected
            elif op == FUSE_RELEASE:
                self._reply(unique)
            else:
                self._reply(unique, error=errno.ENOSYS)

    def abort(self) -> None:
        """Abort the connection: every waiting request (the FLUSHes) fails at once."""
        try:
            with open(f"/sys/fs/fuse/connections/{self.conn}/abort", "w") as f:
                f.write("1")
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass
        self._libc.umount2(self.dir.encode(), 2)  # MNT_DETACH
        os.close(self._dev)
        self._thread.join(2)
        os.rmdir(self.dir)
