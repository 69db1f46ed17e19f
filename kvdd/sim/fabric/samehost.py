"""Kernel-attested identity for the same-host data path (the link extension ``"samehost"``).

kvdd reads or writes another process's memory (``pread`` / ``pwrite`` on its ``/proc/<pid>/mem``)
only when the *kernel* says which process is at the other end of an authenticated session, never
because of anything a peer claims (pids, addresses, nonces: a peer can relay or replay all of them).

How a link gets the path
------------------------
1. In the authenticated hello the initiator offers the extension (:func:`offer`: version, boot id,
   uid: hints only, used to decline early).  An acceptor on the same boot with the same uid that can
   use ``process_vm_*`` (:func:`availability`) answers with the abstract AF_UNIX name of its
   :class:`Endpoint` (:func:`accept`) and expects the session there (:meth:`Endpoint.expect`).
2. The initiator connects to that name (:func:`prove`); on the AF_UNIX socket both sides prove
   that they hold the session's key (HMAC-SHA256 over the session transcript with distinct role
   labels; the acceptor finds the session by the transcript's hash, which it learned in step 1,
   and uses it once).  Identity comes from the kernel, for *the message that carries the proof*:
   both sockets have ``SO_PASSPIDFD`` on (Linux >= 6.5), so the kernel attaches to each received
   message a pidfd (``SCM_PIDFD``) on the process that *sent* it.  Each side takes the pidfd that
   came with the peer's HMAC proof (the initiator's hello, the acceptor's reply), reads its pid
   (``/proc/self/fdinfo``) and uid (``/proc/<pid>/status``, confirmed by the pidfd being still alive
   afterwards), requires the uid to equal its own, and holds that pidfd for the link's life
   (the reader opens the peer's ``/proc/<pid>/mem`` once, then checks through the pidfd that
   the peer had not exited, so the file is bound to the attested address space: every copy goes
   through it, and a pid reused by a later process is never read or written).  ``SO_PEERCRED`` is not
   used for identity: it names the process that called ``listen()`` / ``connect()``, which need
   not be the one answering (the pid-reuse attack); ``SCM_CREDENTIALS`` alone is not either (a
   sender with CAP_SYS_ADMIN chooses its pid).  Without ``SO_PASSPIDFD`` the path is not offered.
3. Each side, as the owner of the caches it serves over the link, creates the link's lease table
   (a sealed memfd: :mod:`.samehost_path`) and passes it over the socket with SCM_RIGHTS.

A fake peer that authenticated and announces another process's endpoint gets nothing: that process
holds no session with this transcript (it refuses at once), and cannot produce the proof.  A fake
peer that runs the endpoint itself is attested as itself: the path then reads its own memory.

Under Yama ``ptrace_scope >= 1`` ``process_vm_*`` between unrelated processes is not permitted and
the path is not offered (TCP; ``kvdd doctor`` says so): kvdd never calls ``PR_SET_PTRACER``, which
would grant the peer full ptrace.  ``KVDD_SIM_XPROC=tcp`` turns the path off.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

from .logutil import warn_limited
from .samehost_attest import (SameHostRefused, attest, pass_pidfd, pidfd_passing,
                              recv_msg, same_sender)

logger = logging.getLogger(__name__)

_ACCEPT_FATAL = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})  # the socket is closed
_ACCEPT_RETRY_S = 0.01  # after a failed accept (out of fds): the wait before the next

__all__ = ["EXTENSION", "ENV_XPROC", "SessionKeys", "SameHostLink", "SameHostRefused", "Endpoint",
           "availability", "offer", "accept", "prove", "endpoint", "ptrace_scope", "boot_id"]

#: The link extension's name in the authenticated hello / hello-reply.
EXTENSION = "samehost"
#: Environment variable selecting the same-host data path: ``auto`` (default) or ``tcp``.
ENV_XPROC = "KVDD_SIM_XPROC"

_PROTO = b"kvdd-samehost/1"
_VERSION = 1
MAX_MSG = 512  # bytes of one message on the AF_UNIX socket (SOCK_SEQPACKET)
SETUP_TIMEOUT_S = 2.0  # a proof exchange must complete within this
MAX_SETUPS = 16  # AF_UNIX connections being proven at once, per process
MAX_PENDING = 256  # sessions waiting for their initiator, per process
PENDING_TTL_S = 10.0  # a session not claimed within this is forgotten
PROOF_IDLE_S = 10.0  # a proof worker without a proof this long ends
_M_HELLO, _M_REPLY, _M_FINAL, _M_ACK = b"H", b"R", b"F", b"K"

class SessionKeys(Protocol):
    """What the proof needs of an authenticated session (the handshake's ``Session``)."""

    @property
    def key(self) -> bytes: ...

    @property
    def transcript(self) -> bytes: ...

    @property
    def initiator(self) -> bool: ...


@dataclass
class SameHostLink:
    """One link's proven same-host identity: the peer process, held by a pidfd.

    ``table_fd`` is the peer's lease table (sealed memfd, checked by :func:`.samehost_path.check_table_fd`) with
    ``table_slots`` slots, or -1; ``own`` is whatever :class:`Endpoint` / :func:`prove` were given
    for this side's own table (returned to the caller untouched)."""

    peer_pid: int
    peer_uid: int
    pidfd: int
    table_fd: int = -1
    table_slots: int = 0
    #: The peer's ``/proc/<pid>/mem`` (:func:`open_memory`), or -1: the reader's copies go
    #: through it, so they reach the attested address space and no other.
    mem_fd: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = False

    def alive(self) -> bool:
        """True while the peer process has not exited (checked through the pidfd)."""
        with self._lock:
            if self._closed:
                return False
            assert _xproc is not None
            return _xproc.pidfd_alive(self.pidfd)

    def open_memory(self) -> int:
        """Open the peer's memory for the reader's copies (``/proc/<pid>/mem``, proven by the
        pidfd to belong to the attested process: :func:`kvdd._native._xproc.mem_open`); the link
        owns the fd.  Raises SameHostRefused when the peer exited or the kernel refuses."""
        assert _xproc is not None
        with self._lock:
            if self._closed:
                raise SameHostRefused("the same-host link is closed")
            if self.mem_fd < 0:
                try:
                    self.mem_fd = _xproc.mem_open(self.peer_pid, self.pidfd)
                except OSError as exc:
                    raise SameHostRefused(f"cannot open the peer's memory ({exc})") from None
            return self.mem_fd

    def close(self) -> None:
        """Close the pidfd, the memory and the table fd (mappings made from it stay valid)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.pidfd, self.table_fd, self.mem_fd):
                if fd >= 0:
                    os.close(fd)
            self.pidfd = self.table_fd = self.mem_fd = -1


# ---- can this process use the path at all ---------------------------------------------------------


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_BOOT_ID = boot_id()


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (None: Yama absent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


_self_check: tuple[bool, str] | None = None


def _kernel_check() -> tuple[bool, str]:
    """pidfd_open and process_vm_readv work in this process (checked once)."""
    global _self_check
    if _self_check is None:
        assert _xproc is not None
        probe = secrets.token_bytes(16)
        buf = bytearray(probe)
        try:
            fd = _xproc.pidfd_open(os.getpid())
            os.close(fd)
        except OSError as exc:
            _self_check = (False, f"pidfd_open is not available ({exc.strerror}; Linux >= 5.3)")
            return _self_check
        try:
            import ctypes
            addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            ok = _xproc.pvm_read_bytes(os.getpid(), addr, len(buf)) == probe
            _self_check = (ok, "" if ok else "process_vm_readv returned other bytes")
        except OSError as exc:
            _self_check = (False, f"process_vm_readv is refused here ({exc.strerror}; seccomp?)")
            return _self_check
        try:  # the data path copies through /proc/<pid>/mem (it names the peer's memory)
            pidfd = _xproc.pidfd_open(os.getpid())
            try:
                os.close(_xproc.mem_open(os.getpid(), pidfd))
            finally:
                os.close(pidfd)
        except OSError as exc:
            _self_check = (False, f"/proc/<pid>/mem cannot be opened ({exc.strerror}; "
                                  "a restricted /proc?)")
    return _self_check


def availability() -> tuple[bool, str]:
    """Whether links from this process may use the same-host path, and why (for ``kvdd doctor``)."""
    if _xproc is None:
        return False, "kvdd._native._xproc is not built: same-host links use TCP"
    mode = os.environ.get(ENV_XPROC, "auto").strip().lower() or "auto"
    if mode == "tcp":
        return False, f"{ENV_XPROC}=tcp: same-host links use TCP"
    if not _BOOT_ID:
        return False, "no /proc/sys/kernel/random/boot_id: same-host links use TCP"
    ok, why = _kernel_check()
    if not ok:
        return False, why + ": same-host links use TCP"
    ok, why = pidfd_passing()
    if not ok:
        return False, why + ": same-host links use TCP"
    scope = ptrace_scope()
    if scope is not None and scope >= 1:
        return False, (f"Yama ptrace_scope={scope} forbids process_vm_readv between unrelated "
                       "processes (kvdd does not grant ptrace with PR_SET_PTRACER): same-host "
                       "links use TCP")
    return True, (f"one-sided copies through /proc/<pid>/mem between processes of uid "
                  f"{os.getuid()} on this boot, identity by SCM_PIDFD of the proof message")


# ---- the hello extension ----------------------------------------------------------------------------

_OFFER = struct.Struct("<BI36s")  # version, uid, boot id


def offer() -> bytes:
    """The initiator's extension payload (b"" when the path is unavailable: do not offer)."""
    if not availability()[0]:
        return b""
    return _OFFER.pack(_VERSION, os.getuid(), _BOOT_ID.encode()[:36])


def _same_host(payload: bytes) -> bool:
    if len(payload) != _OFFER.size:
        return False
    version, uid, boot = _OFFER.unpack(payload)
    return bool(version == _VERSION and uid == os.getuid() and boot == _BOOT_ID.encode()[:36])


def accept(peer_offer: bytes, session: SessionKeys, make_table: _TableFactory,
           on_link: _LinkCallback) -> bytes:
    """The acceptor's answer to an offer: the endpoint name, or b"" (declined: TCP).

    ``make_table()`` gives ``(fd, slots)`` of this side's lease table when the initiator has
    proven itself (the fd is closed once sent); ``on_link(link)`` runs on the endpoint's thread
    after that, before the initiator is told the proof succeeded (so the caller can attach the
    owner side of its table before the peer can use it), or ``on_link(None)`` when it never does."""
    if not peer_offer or not availability()[0] or not _same_host(peer_offer):
        return b""
    ep = endpoint()
    if not ep.expect(session, make_table, on_link):
        return b""
    return _OFFER.pack(_VERSION, os.getuid(), _BOOT_ID.encode()[:36]) + ep.name


# ---- messages -------------------------------------------------------------------------------------


def _binding(session: SessionKeys) -> bytes:
    """The link connection's endpoints as the kernel shows them to this side, when the session
    carries them (``channel``: initiator address, acceptor address), so that a relay holding the
    shared secret, which can give two sessions one transcript, still gets two bindings."""
    value = getattr(session, "channel", b"")
    return value if isinstance(value, bytes) else b""


def _proof(session: SessionKeys, role: bytes) -> bytes:
    msg = _PROTO + b" " + role + b"\0" + session.transcript + b"\0" + _binding(session)
    return hmac.new(session.key, msg, hashlib.sha256).digest()


def _sid(session: SessionKeys) -> bytes:
    return hashlib.sha256(_PROTO + b" session\0" + session.transcript).digest()


def _send(sock: socket.socket, kind: bytes, body: bytes = b"", fd: int = -1) -> None:
    msg = _PROTO + kind + body
    if fd >= 0:
        socket.send_fds(sock, [msg], [fd])
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket, kind: bytes, size: int) -> tuple[bytes, int, int]:
    """One message of ``kind`` with a body of exactly ``size`` bytes, the fd it carried (-1) and
    the pidfd of the process that sent it (-1 unless ``SO_PASSPIDFD`` is on).

    Any other message, an extra fd, or a truncated message: SameHostRefused (every fd
    received is closed unless returned)."""
    data, fds, pidfd = recv_msg(sock, MAX_MSG)
    fd = fds[0] if fds else -1
    ok = (len(fds) <= 1 and len(data) == len(_PROTO) + 1 + size and
          data.startswith(_PROTO + kind))
    if not ok:
        for extra in fds + [pidfd]:
            _close_fd(extra)
        raise SameHostRefused("unexpected message during the same-host proof" if data else
                              "the peer closed the AF_UNIX socket during the proof")
    return data[len(_PROTO) + 1:], fd, pidfd


def _close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


# ---- the initiator --------------------------------------------------------------------------------


def prove(reply: bytes, session: SessionKeys, make_table: _TableFactory,
          attach: _LinkCallback, activate: _LinkCallback | None = None,
          timeout_s: float = SETUP_TIMEOUT_S) -> SameHostLink:
    """The initiator's side: connect to the endpoint the acceptor announced, run the proof.

    ``make_table()`` gives ``(fd, slots)`` of this side's lease table (made while the acceptor
    checks our proof, sent only once it proved itself, closed here); ``attach(link)`` runs once
    the acceptor proved itself, before our table is handed over; ``activate(link)`` (our reads
    of the acceptor) right after it is handed over, while the acceptor attaches it.  Returns the proven link; raises SameHostRefused (with the reason) when the path is not
    used."""
    own_fd = -1
    try:
        if len(reply) <= _OFFER.size or not _same_host(reply[:_OFFER.size]):
            raise SameHostRefused("the acceptor declined the same-host path")
        name = reply[_OFFER.size:]
        if not name.startswith(b"\0kvdd-sh-") or len(name) > 64:
            raise SameHostRefused("malformed same-host endpoint name")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        link: SameHostLink | None = None
        try:
            pass_pidfd(sock)
            # a blocking connect bounded by SO_SNDTIMEO: the kernel waits for room in the
            # endpoint's queue (woken by each accept) rather than failing while another uid's
            # connects fill it (the endpoint closes those at once)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
            try:
                sock.connect(name)
            except OSError as exc:
                raise SameHostRefused(f"cannot reach the same-host endpoint ({exc})") from None
            sock.settimeout(timeout_s)
            _send(sock, _M_HELLO, _sid(session) + _proof(session, b"initiator"))
            # our table is made while the acceptor checks our proof (it is sent only once the
            # acceptor proved itself; caches unregistered before it is attached are revoked then)
            own_fd, own_slots = make_table()
            body, fd, sender = _recv(sock, _M_REPLY, 36)
            try:
                pid, uid, pidfd = attest(sender)  # the process that sent the acceptor's proof
            except BaseException:
                _close_fd(fd)
                raise
            link = SameHostLink(pid, uid, pidfd, fd, 0)
            proof, (slots,) = body[:32], struct.unpack("<I", body[32:])
            if not hmac.compare_digest(proof, _proof(session, b"acceptor")):
                raise SameHostRefused("the process at the announced endpoint does not hold the "
                                      "session key (a relayed or spoofed endpoint)")
            if fd < 0 or slots > _max_slots():
                raise SameHostRefused("the acceptor sent no usable lease table")
            link.table_slots = slots
            attach(link)
            _send(sock, _M_FINAL, struct.pack("<I", own_slots), own_fd)
            if activate is not None:
                activate(link)
            _body, extra, sender = _recv(sock, _M_ACK, 0)
            _close_fd(extra)
            same_sender(sender, pid)
            if not link.alive():
                raise SameHostRefused("the peer process exited during the proof")
            return link
        except (OSError, struct.error) as exc:
            if link is not None:
                link.close()
            raise SameHostRefused(f"same-host proof failed: {exc}") from None
        except SameHostRefused:
            if link is not None:
                link.close()
            raise
        finally:
            sock.close()
    finally:
        _close_fd(own_fd)


def _max_slots() -> int:
    return _xproc.LEASE_MAX_SLOTS if _xproc is not None else 0


# ---- the acceptor's endpoint ----------------------------------------------------------------------


class _LinkCallback(Protocol):
    def __call__(self, link: SameHostLink | None) -> None: ...


class _TableFactory(Protocol):
    def __call__(self) -> tuple[int, int]: ...


@dataclass
class _Pending:
    session: SessionKeys
    make_table: _TableFactory
    on_link: _LinkCallback
    expires: float
    table_fd: int = -1


class Endpoint:
    """This process's AF_UNIX (abstract namespace, SOCK_SEQPACKET) listener for same-host proofs.

    Only sessions announced through :meth:`expect` are accepted, each once; everything else is
    closed after at most one message.  At most MAX_SETUPS proofs run at once (each within
    SETUP_TIMEOUT_S) and MAX_PENDING sessions wait (each at most PENDING_TTL_S)."""

    def __init__(self) -> None:
        self.name = b"\0kvdd-sh-%d-%s" % (os.getpid(), secrets.token_hex(12).encode())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(self.name)
        pass_pidfd(self._sock)  # inherited by accepted sockets: a hello is attested from the start
        # a short queue: a same-uid initiator blocked in connect() (prove) is woken by every
        # accept and takes a freed place at once, instead of waiting behind thousands of
        # another uid's queued connects
        self._sock.listen(64)
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._slots = threading.BoundedSemaphore(MAX_SETUPS)
        # proofs are served by up to MAX_SETUPS worker threads that stay for PROOF_IDLE_S after
        # their last proof (a link does not pay for starting a thread)
        self._work_cv = threading.Condition(threading.Lock())
        self._conns: deque[socket.socket] = deque()
        self._workers = 0
        self._idle = 0
        self._pid = os.getpid()
        threading.Thread(target=self._accept_loop, name="kvdd-samehost-endpoint",
                         daemon=True).start()

    def expect(self, session: SessionKeys, make_table: _TableFactory,
               on_link: _LinkCallback) -> bool:
        """Wait for the initiator of ``session``; False when too many wait already."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, p in self._pending.items() if p.expires < now]
            dropped = [self._pending.pop(k) for k in stale]
            ok = len(self._pending) < MAX_PENDING
            if ok:
                self._pending[_sid(session)] = _Pending(session, make_table, on_link,
                                                        now + PENDING_TTL_S)
        for p in dropped:
            _forget(p)
        return ok

    def _accept_loop(self) -> None:
        """Abstract names are reachable from any uid: a connection of another uid is closed
        right after accept, by its kernel credentials (``SO_PEERCRED``), before any other work
        (no socket object, no read), so that the queue drains faster than strangers fill it."""
        assert _xproc is not None
        peer_cred, uid, close = _xproc.peer_cred, os.getuid(), os.close
        accept: Callable[[], tuple[int, object]] = getattr(self._sock, "_accept")  # the fd only
        while True:
            try:
                fd, _ = accept()
            except OSError as exc:
                if self._sock.fileno() < 0 or exc.errno in _ACCEPT_FATAL:  # closed
                    logger.warning("kvdd same-host endpoint stopped: %s", exc)
                    return
                # out of fds or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), or a connection
                # aborted in the queue: the endpoint stays; a link meanwhile may use TCP
                warn_limited(logger, "samehost-accept", "kvdd same-host endpoint: accept "
                             "failed: %s", exc)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            try:
                same_uid = peer_cred(fd)[1] == uid
            except OSError:
                same_uid = False
            if not same_uid or not self._slots.acquire(blocking=False):
                close(fd)  # another user, or too many proofs at once: that link uses TCP
                continue
            self._hand_over(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd))

    def _hand_over(self, conn: socket.socket) -> None:
        """Give an accepted connection (holding one of the MAX_SETUPS slots) to a proof worker:
        an idle one, else a new one (at most one per slot); a worker that cannot start leaves it
        to the running ones, or, with none running, closes it (that link uses TCP)."""
        with self._work_cv:
            self._conns.append(conn)
            if len(self._conns) <= self._idle:
                self._work_cv.notify()
                return
            try:
                threading.Thread(target=self._work, name="kvdd-samehost-proof",
                                 daemon=True).start()
            except RuntimeError as exc:
                warn_limited(logger, "samehost-thread", "kvdd same-host endpoint: %s", exc)
                if self._workers:
                    return
                self._conns.pop()
            else:
                self._workers += 1
                return
        self._slots.release()
        conn.close()

    def _work(self) -> None:
        """A proof worker: serves the connections handed over, one at a time; ends after
        PROOF_IDLE_S without one."""
        while True:
            with self._work_cv:
                while not self._conns:
                    self._idle += 1
                    try:
                        woken = self._work_cv.wait(PROOF_IDLE_S)
                    finally:
                        self._idle -= 1
                    if not woken and not self._conns:
                        self._workers -= 1
                        return
                conn = self._conns.popleft()
            self._serve(conn)

    def _claim(self, sid: bytes) -> _Pending | None:
        with self._lock:
            p = self._pending.pop(sid, None)
        if p is not None and p.expires < time.monotonic():
            _forget(p)
            return None
        return p

    def _serve(self, conn: socket.socket) -> None:
        pending: _Pending | None = None
        link: SameHostLink | None = None
        attached = False
        try:
            conn.settimeout(SETUP_TIMEOUT_S)
            pass_pidfd(conn)  # (inherited from the listener already; harmless)
            body, fd, sender = _recv(conn, _M_HELLO, 64)
            _close_fd(fd)
            pid, uid, pidfd = attest(sender)  # the process that sent the initiator's proof
            link = SameHostLink(pid, uid, pidfd)
            pending = self._claim(body[:32])
            if pending is None:
                raise SameHostRefused("no session of this process has that transcript")
            if not hmac.compare_digest(body[32:], _proof(pending.session, b"initiator")):
                raise SameHostRefused("the connecting process does not hold the session key")
            pending.table_fd, slots = pending.make_table()
            _send(conn, _M_REPLY, _proof(pending.session, b"acceptor") +
                  struct.pack("<I", slots), pending.table_fd)
            _close_fd(pending.table_fd)
            pending.table_fd = -1
            body, fd, sender = _recv(conn, _M_FINAL, 4)
            (slots,) = struct.unpack("<I", body)
            link.table_fd, link.table_slots = fd, slots
            same_sender(sender, pid)
            if fd < 0 or slots > _max_slots():
                raise SameHostRefused("the initiator sent no usable lease table")
            if not link.alive():
                raise SameHostRefused("the peer process exited during the proof")
            pending.on_link(link)
            attached = True
            _send(conn, _M_ACK)
        except (OSError, SameHostRefused, struct.error) as exc:
            logger.info("kvdd same-host endpoint: refused a connection: %s", exc)
            if link is not None and not attached:
                link.close()
            if pending is not None and not attached:
                _forget(pending)
        finally:
            conn.close()
            self._slots.release()


def _forget(p: _Pending) -> None:
    _close_fd(p.table_fd)
    p.table_fd = -1
    try:
        p.on_link(None)
    except Exception:
        logger.exception("kvdd same-host: a session's give-up callback failed")


_endpoint_lock = threading.Lock()
_endpoint: Endpoint | None = None


def endpoint() -> Endpoint:
    """This process's endpoint, started on first use (and again in a forked child)."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None or _endpoint._pid != os.getpid():
            _endpoint = Endpoint()
        return _endpoint
