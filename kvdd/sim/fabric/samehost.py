"""Kernel-attested identity for the same-host data path (the link extension ``"samehost"``).

kvdd reads or writes another process's memory (``pread`` / ``pwrite`` on its ``/proc/<pid>/mem``)
only when the *kernel* says which process is at the other end of an authenticated session, never
because of anything a peer claims (pids, addresses, nonces: a peer can relay or replay all of them).

How a link gets the path
------------------------
1. An acceptor that can use ``process_vm_*`` (:func:`availability`) announces, after the MAC of
   its authentication answer, its hints (version, uid, boot id) and the abstract AF_UNIX name of
   its :class:`~.samehost_endpoint.Endpoint` (:func:`announcement`), which expects the session from
   then on (:func:`expect`).  An initiator on the same boot with the same uid offers the extension
   in its link hello (:func:`offer`: the same hints, used to decline early) and, once the hello
   left, connects to that name and sends its proof (:func:`start_proof`).  The acceptor binds the
   session to the link it makes and lets the endpoint answer once its reply is sent
   (:meth:`~.samehost_endpoint.Endpoint.bind`, :meth:`~.samehost_endpoint.Endpoint.decide`).
2. On the AF_UNIX socket both sides prove that they hold the session's key (HMAC-SHA256 over the
   session transcript with distinct role labels; the acceptor finds the session by the
   transcript's hash, which it learned in step 1, and uses it once; :func:`finish_proof`).  Identity comes from the kernel, for *the message that carries the proof*:
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
   (a sealed memfd: :mod:`.samehost_path`; ahead of time, off the proof's round trips), attaches it
   to the proven peer (from then on an unregister waits for the peer's copies), and only then
   passes it over the socket with SCM_RIGHTS.  So the table is the last message each side needs:
   the acceptor's comes with its proof, the initiator's ends the exchange, and no side waits for
   an acknowledgement (an acceptor's transfer that starts while the initiator's table is on its
   way waits for it: :class:`~.samehost_link.SameHostPath`).

A fake peer that authenticated and announces another process's endpoint gets nothing: that process
holds no session with this transcript (it refuses at once), and cannot produce the proof.  A fake
peer that runs the endpoint itself is attested as itself: the path then reads its own memory.

Under Yama ``ptrace_scope >= 1`` ``process_vm_*`` between unrelated processes is not permitted and
the path is not offered (TCP; ``kvdd doctor`` says so): kvdd never calls ``PR_SET_PTRACER``, which
would grant the peer full ptrace.  ``KVDD_SIM_XPROC=tcp`` turns the path off.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .samehost_endpoint import Endpoint
from .samehost_attest import (SameHostRefused, attest, close_fd, pass_pidfd, pidfd_passing,
                              recv_msg)
from .samehost_close import accept_files, close_file, close_socket, refuse_files, room

logger = logging.getLogger(__name__)


__all__ = ["EXTENSION", "ENV_XPROC", "SessionKeys", "SameHostLink", "SameHostRefused",
           "LinkCallback", "TableFactory", "availability", "offer", "accept", "prove", "endpoint",
           "announcement", "expect", "announced_name", "start_proof", "finish_proof", "same_host",
           "ptrace_scope", "boot_id", "proof_of", "session_id", "send_message", "recv_message",
           "max_slots", "M_HELLO", "M_REPLY", "M_FINAL", "SETUP_TIMEOUT_S", "ProvenCallback"]

#: The link extension's name in the authenticated hello / hello-reply.
EXTENSION = "samehost"
#: Environment variable selecting the same-host data path: ``auto`` (default) or ``tcp``.
ENV_XPROC = "KVDD_SIM_XPROC"

_PROTO = b"kvdd-samehost/2"
_VERSION = 2  # in the hints: sides of other versions do not try the path (TCP)
MAX_MSG = 512  # bytes of one message on the AF_UNIX socket (SOCK_SEQPACKET)
SETUP_TIMEOUT_S = 2.0  # a proof exchange must complete within this
M_HELLO, M_REPLY, M_FINAL = b"H", b"R", b"F"

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
    #: The initiator's proof socket, shut and refusing files, closed with the link (its close
    #: goes to the closer thread, which need not be woken on the link's path).
    proof_sock: socket.socket | None = field(default=None, repr=False)
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

    def keep_socket(self, sock: socket.socket) -> bool:
        """Hold the finished proof's socket until :meth:`close` (False: closed already)."""
        with self._lock:
            if self._closed:
                return False
            self.proof_sock = sock
            return True

    def close(self) -> None:
        """Close the pidfd, the memory and the table fd (mappings made from it stay valid)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.pidfd, self.mem_fd):
                if fd >= 0:
                    os.close(fd)
            close_file(self.table_fd)  # the peer's file: never waits (.samehost_close)
            self.pidfd = self.table_fd = self.mem_fd = -1
            sock, self.proof_sock = self.proof_sock, None
        if sock is not None:
            close_socket(sock)  # (files the peer queued in it are closed off this thread)


# ---- can this process use the path at all ---------------------------------------------------------


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_BOOT_ID = boot_id()


_SCOPE_TTL_S = 1.0  # a ptrace_scope read is reused this long (a /proc/sys lookup costs ~50 µs,
#                    and every authentication answer and link hello asks)
_scope: tuple[float, int | None] = (-_SCOPE_TTL_S, None)


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (None: Yama absent), read at most once a second (it
    may change while the process runs)."""
    global _scope
    now = time.monotonic()
    if now - _scope[0] < _SCOPE_TTL_S:
        return _scope[1]
    try:
        fd = os.open("/proc/sys/kernel/yama/ptrace_scope", os.O_RDONLY | os.O_CLOEXEC)
        try:
            value: int | None = int(os.read(fd, 64).strip())
        finally:
            os.close(fd)
    except (OSError, ValueError):
        value = None
    _scope = (now, value)
    return value


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
    return True, _AVAILABLE % os.getuid()


_AVAILABLE = ("copies through the peer's /proc/<pid>/mem (kvdd.empty memory: through a mapping of "
              "it) between processes of uid %d on this boot, identity by SCM_PIDFD of the proof")


class LinkCallback(Protocol):
    """Called with the proven link (or None: the proof never came)."""

    def __call__(self, link: SameHostLink | None) -> None: ...


class ProvenCallback(Protocol):
    """The acceptor's: called with the proven initiator before this side's table goes to it
    (attach the table's owner side now); False: the table is not served (no reply: TCP)."""

    def __call__(self, link: SameHostLink) -> bool: ...


class TableFactory(Protocol):
    """Gives ``(fd, slots)`` of this side's lease table (the caller closes the fd)."""

    def __call__(self) -> tuple[int, int]: ...


# ---- the hello extension ----------------------------------------------------------------------------

_OFFER = struct.Struct("<BI36s")  # version, uid, boot id


_hints: tuple[int, bytes] = (-1, b"")  # (uid, the hints of that uid): made once per uid


def _our_hints() -> bytes:
    global _hints
    uid = os.getuid()
    if _hints[0] != uid:
        _hints = (uid, _OFFER.pack(_VERSION, uid, _BOOT_ID.encode()[:36]))
    return _hints[1]


def offer() -> bytes:
    """The initiator's extension payload (b"" when the path is unavailable: do not offer)."""
    if not availability()[0]:
        return b""
    return _our_hints()


def same_host(payload: bytes) -> bool:
    """Whether ``payload`` is the hints of :func:`offer` made on this boot by this uid."""
    return len(payload) == _OFFER.size and payload == _our_hints()


def announcement() -> bytes:
    """The acceptor's same-host announcement for its authentication answer (``AUTH_OK``): the
    hints of :func:`offer` and the name of this process's endpoint, or b"" (the path is
    unavailable here, or the endpoint already waits for ``MAX_PENDING`` sessions: TCP)."""
    if not availability()[0]:
        return b""
    from .samehost_endpoint import endpoint  # (it serves the messages of this module)
    ep = endpoint()
    if not ep.room():
        return b""
    return _our_hints() + ep.name


def expect(session: SessionKeys) -> bool:
    """Make the endpoint wait for the initiator of ``session`` (announced in its authentication
    answer); False when too many wait already (its proof is then refused: TCP)."""
    from .samehost_endpoint import endpoint
    return endpoint().expect(session)


def accept(peer_offer: bytes, session: SessionKeys, make_table: TableFactory,
           on_proven: ProvenCallback, on_link: LinkCallback) -> bytes:
    """Expect ``session``, bind it and let its proof be answered at once (:func:`expect`,
    :meth:`~.samehost_endpoint.Endpoint.bind`, :meth:`~.samehost_endpoint.Endpoint.decide`):
    the announcement, or b"" (declined).  The link handshake makes these three steps apart
    (announced at authentication, bound with the link reply, decided once it is sent).

    ``make_table()`` gives ``(fd, slots)`` of this side's lease table when the initiator has
    proven itself (the fd is closed once sent); ``on_proven(link)`` runs right after it, before
    the table is sent (so the caller attaches the owner side of its table before the peer can use
    it); ``on_link(link)`` runs on the endpoint's thread once the initiator's table came
    (``link.table_fd``), or ``on_link(None)`` when it never does."""
    if not peer_offer or not same_host(peer_offer):
        return b""
    reply = announcement()
    if not reply or not expect(session):
        return b""
    from .samehost_endpoint import endpoint
    ep = endpoint()
    ep.bind(session, make_table, on_proven, on_link)
    ep.decide(session)
    return reply


# ---- messages -------------------------------------------------------------------------------------


def _binding(session: SessionKeys) -> bytes:
    """The link connection's endpoints as the kernel shows them to this side, when the session
    carries them (``channel``: initiator address, acceptor address), so that a relay holding the
    shared secret, which can give two sessions one transcript, still gets two bindings."""
    value = getattr(session, "channel", b"")
    return value if isinstance(value, bytes) else b""


def proof_of(session: SessionKeys, role: bytes) -> bytes:
    msg = _PROTO + b" " + role + b"\0" + session.transcript + b"\0" + _binding(session)
    return hmac.new(session.key, msg, hashlib.sha256).digest()


def session_id(session: SessionKeys) -> bytes:
    return hashlib.sha256(_PROTO + b" session\0" + session.transcript).digest()


def send_message(sock: socket.socket, kind: bytes, body: bytes = b"", fd: int = -1) -> None:
    msg = _PROTO + kind + body
    if fd >= 0:
        socket.send_fds(sock, [msg], [fd])
    else:
        sock.sendall(msg)


def recv_message(sock: socket.socket, kind: bytes, size: int) -> tuple[bytes, int, int]:
    """One message of ``kind`` with a body of exactly ``size`` bytes, the fd it carried (-1) and
    the pidfd of the process that sent it (-1 unless ``SO_PASSPIDFD`` is on).

    Any other message, an extra fd, or a truncated message: SameHostRefused (every fd
    received is closed unless returned)."""
    data, fds, pidfd = recv_msg(sock, MAX_MSG)
    fd = fds[0] if fds else -1
    ok = (len(fds) <= 1 and len(data) == len(_PROTO) + 1 + size and
          data.startswith(_PROTO + kind))
    if not ok:
        for extra in fds:
            close_file(extra)
        close_fd(pidfd)
        raise SameHostRefused("unexpected message during the same-host proof" if data else
                              "the peer closed the AF_UNIX socket during the proof")
    return data[len(_PROTO) + 1:], fd, pidfd


# ---- the initiator --------------------------------------------------------------------------------


def announced_name(announced: bytes) -> bytes:
    """The endpoint name of an acceptor's announcement (its authentication answer, or
    :func:`accept`'s reply); raises SameHostRefused (with the reason) when it is not usable here."""
    if len(announced) <= _OFFER.size or not same_host(announced[:_OFFER.size]):
        raise SameHostRefused("the acceptor declined the same-host path")
    name = announced[_OFFER.size:]
    if not name.startswith(b"\0kvdd-sh-") or len(name) > 64:
        raise SameHostRefused("malformed same-host endpoint name")
    return name


def start_proof(announced: bytes, session: SessionKeys,
                timeout_s: float = SETUP_TIMEOUT_S) -> socket.socket:
    """The initiator's first step: connect to the endpoint the acceptor announced and send our
    proof of the session key (its hello).  The acceptor answers once it has both our proof and
    its link decision; :func:`finish_proof` takes it from there.  Raises SameHostRefused."""
    if not room():  # files of peers still closing (.samehost_close): take none more
        raise SameHostRefused("too many files of same-host peers are still closing")
    name = announced_name(announced)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        pass_pidfd(sock)
        refuse_files(sock)  # no file from the acceptor before we connected to its endpoint
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
        accept_files(sock)  # its reply carries its lease table
        try:
            send_message(sock, M_HELLO, session_id(session) + proof_of(session, b"initiator"))
        except OSError as exc:
            raise SameHostRefused(f"same-host proof failed: {exc}") from None
    except BaseException:
        close_socket(sock)  # (files the acceptor queued are closed off this thread)
        raise
    return sock


def _within(sock: socket.socket, deadline: float | None) -> None:
    """Bound the socket's next wait by ``deadline`` (``time.monotonic()``; None: no more than
    the timeout it has); past it, SameHostRefused (the link goes on over TCP)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise SameHostRefused("the link's timeout passed during the same-host proof")
    sock.settimeout(min(left, SETUP_TIMEOUT_S))


def finish_proof(sock: socket.socket, session: SessionKeys, own: tuple[int, int],
                 attach: LinkCallback, activate: LinkCallback | None = None,
                 deadline: float | None = None) -> SameHostLink:
    """The initiator's second step, on the socket of :func:`start_proof` (closed here, or by
    the link it proved: :meth:`SameHostLink.keep_socket`): the acceptor's proof and lease table
    (attached to us by the acceptor before it was sent), then ours (``own``: ``(fd, slots)``, sent
    only once the acceptor proved itself; the caller closes the fd), which ends the exchange.

    ``attach(link)`` runs once the acceptor proved itself, before our table is handed over;
    ``activate(link)`` (our reads of the acceptor) right after it is handed over, while the
    acceptor attaches it.  The wait for the acceptor ends by ``deadline`` (the link call's, in
    ``time.monotonic()``) too.  Returns the proven link; raises SameHostRefused (with the
    reason) when the path is not used."""
    own_fd, own_slots = own
    link: SameHostLink | None = None
    kept = False
    try:
        _within(sock, deadline)
        body, fd, sender = recv_message(sock, M_REPLY, 36)
        try:
            pid, uid, pidfd = attest(sender)  # the process that sent the acceptor's proof
        except BaseException:
            close_file(fd)
            raise
        link = SameHostLink(pid, uid, pidfd, fd, 0)
        proof, (slots,) = body[:32], struct.unpack("<I", body[32:])
        if not hmac.compare_digest(proof, proof_of(session, b"acceptor")):
            raise SameHostRefused("the process at the announced endpoint does not hold the "
                                  "session key (a relayed or spoofed endpoint)")
        if fd < 0 or slots > max_slots():
            raise SameHostRefused("the acceptor sent no usable lease table")
        link.table_slots = slots
        attach(link)
        send_message(sock, M_FINAL, struct.pack("<I", own_slots), own_fd)
        if activate is not None:
            activate(link)
        if not link.alive():
            raise SameHostRefused("the peer process exited during the proof")
        # the exchange is over (the acceptor sends nothing more): no file or byte more can be
        # queued, and the socket is closed with the link, off this call's path
        refuse_files(sock)
        sock.shutdown(socket.SHUT_RDWR)
        kept = link.keep_socket(sock)
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
        if not kept:
            close_socket(sock)  # (files the acceptor queued are closed off this thread)


def prove(reply: bytes, session: SessionKeys, make_table: TableFactory,
          attach: LinkCallback, activate: LinkCallback | None = None,
          timeout_s: float = SETUP_TIMEOUT_S) -> SameHostLink:
    """The initiator's whole proof at once (:func:`start_proof`, then ``make_table()`` (our lease
    table, made while the acceptor checks our proof), then :func:`finish_proof`) against an
    acceptor that answers it at once (:func:`accept`).  Returns the proven link; raises
    SameHostRefused (with the reason) when the path is not used."""
    sock = start_proof(reply, session, timeout_s)
    own_fd = -1
    try:
        try:
            own = make_table()
        except BaseException:
            close_socket(sock)
            raise
        own_fd = own[0]
        return finish_proof(sock, session, own, attach, activate)
    finally:
        close_fd(own_fd)


def max_slots() -> int:
    return _xproc.LEASE_MAX_SLOTS if _xproc is not None else 0




def endpoint() -> Endpoint:
    """This process's endpoint (:func:`.samehost_endpoint.endpoint`)."""
    from .samehost_endpoint import endpoint as current
    return current()
