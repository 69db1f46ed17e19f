"""The acceptor's side of the same-host proof: this process's AF_UNIX endpoint.

One endpoint per process (:func:`endpoint`, abstract namespace, ``SOCK_SEQPACKET``).  A session
goes through three steps here, all from the acceptor's handshake: :meth:`Endpoint.expect` (the
authentication answer announced the endpoint, :func:`.samehost.announcement`), :meth:`~Endpoint.bind`
(the link's table and callbacks, while its reply is made) and :meth:`~Endpoint.decide` (the reply is
sent, the table made: the proof may be answered), or :meth:`~Endpoint.abandon` (no link uses it).
The initiator connects and proves (:func:`.samehost.start_proof`) as soon as it is authenticated,
while its link hello is being served.  Per connection, in this order:

1. accept; a connection of another uid (its kernel credentials, ``SO_PEERCRED``) is closed before
   any other work (no socket object, no read);
2. the initiator's hello: the kernel's pidfd of its sender is attested (:func:`.samehost_attest.attest`,
   same uid), the session it names is claimed (each once, only an expected one), its HMAC proof
   checked; then, once the link is decided too (whichever of the two comes second answers, on its
   own thread: the rendezvous), our lease table is attached to the proven initiator (the caller's
   ``on_proven``) and goes with our proof;
3. the initiator's table, from the same process, after our reply, checked; the caller's ``on_link``
   runs.  That ends the exchange: nothing is sent back (the initiator's link call does not wait
   for this step).

The accept thread serves step 2 itself when the hello is already there (it never waits for it:
the initiator sends it as soon as it is connected), so a link does not wait for a thread
hand-off while the initiator is waiting for our reply; everything that waits for the peer runs
on up to ``MAX_SETUPS`` proof workers, kept for ``PROOF_IDLE_S`` after their last proof.  At most
``MAX_SETUPS`` connections are being proven at once (a connection waits for the link decision at
most until its session expires, then each message within ``SETUP_TIMEOUT_S``) and ``MAX_PENDING``
sessions wait (each at most ``PENDING_TTL_S``, and only while the acceptor's handshake lasts:
an abandoned session's connection is shut down at once).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

from .logutil import warn_limited
from .samehost import (M_FINAL, M_HELLO, M_REPLY, SETUP_TIMEOUT_S, LinkCallback,
                       ProvenCallback, SameHostLink, SessionKeys, TableFactory, max_slots,
                       proof_of, recv_message, send_message, session_id)
from .samehost_attest import SameHostRefused, attest, close_fd, pass_pidfd, same_sender
from .samehost_close import (accept_files, close_file, close_socket, close_stranger,
                             refuse_files, wait_room)

logger = logging.getLogger(__name__)

__all__ = ["Endpoint", "endpoint", "MAX_SETUPS", "MAX_PENDING", "PENDING_TTL_S", "PROOF_IDLE_S"]

MAX_SETUPS = 16  # AF_UNIX connections being proven at once, per process
MAX_PENDING = 256  # sessions waiting for their initiator, per process
PENDING_TTL_S = 10.0  # a session not claimed within this is forgotten
PROOF_IDLE_S = 10.0  # a proof worker without a proof this long ends
_ACCEPT_FATAL = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})  # the socket is closed
_ACCEPT_RETRY_S = 0.01  # after a failed accept (out of fds): the wait before the next


@dataclass
class _Pending:
    """One expected session, from the authentication answer until its proof ended."""

    session: SessionKeys
    expires: float
    make_table: TableFactory | None = None  # bound with the link reply
    on_link: LinkCallback | None = None
    on_proven: ProvenCallback | None = None
    proof: _Proof | None = None  # the connection that claimed it (each session once)
    verified: bool = False  # that connection proved the session key
    decided: bool = False  # the link was made and its reply sent: the proof may be answered
    forgotten: bool = False
    replied: threading.Event = field(default_factory=threading.Event)  # our proof and table sent


@dataclass
class _Proof:
    """One connection being proven, between its messages."""

    conn: socket.socket
    pending: _Pending | None = None
    link: SameHostLink | None = None
    attached: bool = False
    closed: bool = False  # (under ``lock``: no send or shutdown on a closed, reused fd number)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Endpoint:
    """This process's AF_UNIX (abstract namespace, SOCK_SEQPACKET) listener for same-host proofs.

    Only sessions announced through :meth:`expect` are accepted, each once; everything else is
    closed after at most one message (see the module docstring for the bounds)."""

    def __init__(self) -> None:
        self.name = b"\0kvdd-sh-%d-%s" % (os.getpid(), secrets.token_hex(12).encode())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(self.name)
        pass_pidfd(self._sock)  # inherited by accepted sockets: a hello is attested from the start
        refuse_files(self._sock)  # inherited too: no file before the initiator proved the key
        # a short queue: a same-uid initiator blocked in connect() (prove) is woken by every
        # accept and takes a freed place at once, instead of waiting behind thousands of
        # another uid's queued connects
        self._sock.listen(64)
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._slots = threading.BoundedSemaphore(MAX_SETUPS)
        self._work_cv = threading.Condition(threading.Lock())
        self._proofs: deque[tuple[_Proof, bool]] = deque()  # (proof, its hello served) for workers
        self._workers = 0
        self._idle = 0
        self._pid = os.getpid()
        self._proving = 0  # connections holding one of the MAX_SETUPS slots
        threading.Thread(target=self._accept_loop, name="kvdd-samehost-endpoint",
                         daemon=True).start()

    def held(self) -> dict[str, int]:
        """Sessions expected now, of them those an initiator proved already, and connections
        being proven (diagnostics)."""
        with self._lock:
            return {"pending": len(self._pending), "proving": self._proving,
                    "proven": sum(p.verified for p in self._pending.values())}

    def room(self) -> bool:
        """Whether another session may be expected now (fewer than MAX_PENDING wait)."""
        with self._lock:
            return len(self._pending) < MAX_PENDING

    def expect(self, session: SessionKeys) -> bool:
        """Wait for the initiator of ``session`` (announced in the authentication answer); False
        when too many wait already, or that session is expected already."""
        now = time.monotonic()
        sid = session_id(session)
        with self._lock:
            stale = [k for k, p in self._pending.items() if p.expires < now and p.proof is None]
            dropped = [self._pending.pop(k) for k in stale]
            ok = len(self._pending) < MAX_PENDING and sid not in self._pending
            if ok:
                self._pending[sid] = _Pending(session, now + PENDING_TTL_S)
        for p in dropped:
            self._forget(p)
        return ok

    def bind(self, session: SessionKeys, make_table: TableFactory, on_proven: ProvenCallback,
             on_link: LinkCallback) -> bool:
        """The link of an expected ``session`` is being made: how to make our table, whom to
        tell before it goes to the proven peer and once the peer's table came
        (:func:`.samehost.accept`); False when that session is not expected (never, expired,
        abandoned) or bound already."""
        with self._lock:
            p = self._pending.get(session_id(session))
            if p is None or p.make_table is not None or p.forgotten:
                return False
            p.make_table, p.on_link, p.on_proven = make_table, on_link, on_proven
            return True

    def decide(self, session: SessionKeys) -> None:
        """The bound link was made and its reply sent: answer the proof now if it came already
        (on the caller's thread), else as soon as it comes (on the endpoint's)."""
        with self._lock:
            p = self._pending.get(session_id(session))
            if p is None or p.decided or p.make_table is None:
                return
            p.decided = True
            now = p.verified
        if now:
            self._reply(p)

    def abandon(self, session: SessionKeys) -> None:
        """No link will use ``session`` (refused, an unlink, its connection gone): forget it, and
        shut down a connection that claimed it (its worker ends it).  Nothing once decided."""
        with self._lock:
            p = self._pending.get(session_id(session))
            if p is None or p.decided:
                return
            del self._pending[session_id(session)]
            proof = p.proof
        if proof is None:
            self._forget(p)
        else:
            _shutdown(proof)

    def _accept_loop(self) -> None:
        """Abstract names are reachable from any uid: a connection of another uid is closed
        right after accept, by its kernel credentials (``SO_PEERCRED``), before any other work
        (no socket object, no read), so that the queue drains faster than strangers fill it."""
        assert _xproc is not None
        peer_cred, uid, close = _xproc.peer_cred, os.getuid(), close_stranger
        accept: Callable[[], tuple[int, object]] = getattr(self._sock, "_accept")  # the fd only
        while True:
            if not wait_room(1.0):  # files of peers still closing: accept no more meanwhile
                continue
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
            with self._lock:
                self._proving += 1
            proof = _Proof(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd))
            try:
                proof.conn.settimeout(0.0)  # only if it is there already: never wait here
                self._hello(proof)
            except BlockingIOError:  # not yet: a worker waits for it
                proof.conn.settimeout(SETUP_TIMEOUT_S)
                self._hand_over(proof, False)
            except (OSError, SameHostRefused, struct.error) as exc:
                self._end(proof, exc)
            except Exception as exc:  # a bug: log it; the accept loop goes on
                logger.exception("kvdd same-host endpoint: a proof failed")
                self._end(proof, exc)
            else:
                self._hand_over(proof, True)

    def _hand_over(self, proof: _Proof, hello_done: bool) -> None:
        """Give a connection (holding one of the MAX_SETUPS slots) to a proof worker: an idle
        one, else a new one (at most MAX_SETUPS in all, else the first to finish takes it); a
        worker that cannot start leaves it to the running ones, or, with none running, ends it
        (that link uses TCP)."""
        with self._work_cv:
            self._proofs.append((proof, hello_done))
            if len(self._proofs) <= self._idle or self._workers >= MAX_SETUPS:
                self._work_cv.notify()  # (all busy: the first to finish takes it)
                return
            try:
                threading.Thread(target=self._work, name="kvdd-samehost-proof",
                                 daemon=True).start()
            except RuntimeError as exc:
                warn_limited(logger, "samehost-thread", "kvdd same-host endpoint: %s", exc)
                if self._workers:
                    return
                self._proofs.pop()
                failed: Exception = exc
            else:
                self._workers += 1
                return
        self._end(proof, failed)

    def _work(self) -> None:
        """A proof worker: serves the connections handed over, one at a time; ends after
        PROOF_IDLE_S without one."""
        while True:
            with self._work_cv:
                while not self._proofs:
                    self._idle += 1
                    try:
                        woken = self._work_cv.wait(PROOF_IDLE_S)
                    finally:
                        self._idle -= 1
                    if not woken and not self._proofs:
                        self._workers -= 1
                        return
                proof, hello_done = self._proofs.popleft()
            try:
                if not hello_done:
                    self._hello(proof)
                self._final(proof)
            except (OSError, SameHostRefused, struct.error) as exc:
                self._end(proof, exc)
            except Exception as exc:  # a bug: log it; the slot and the worker go on (TCP link)
                logger.exception("kvdd same-host endpoint: a proof failed")
                self._end(proof, exc)
            else:
                self._end(proof, None)

    def _claim(self, sid: bytes, proof: _Proof) -> _Pending:
        """The expected session ``sid``, now claimed by ``proof`` (each session once)."""
        with self._lock:
            p = self._pending.get(sid)
            if p is None or p.expires < time.monotonic():
                raise SameHostRefused("no session of this process has that transcript")
            if p.proof is not None:
                raise SameHostRefused("that session is being proven by another connection")
            p.proof = proof
            proof.pending = p
            return p

    def _hello(self, proof: _Proof) -> None:
        """Step 2: the initiator's hello (BlockingIOError, nothing changed, when it has not
        come and the socket does not wait), then our reply if the link is decided already."""
        conn = proof.conn
        pass_pidfd(conn)  # (inherited from the listening socket already; harmless)
        body, fd, sender = recv_message(conn, M_HELLO, 64)
        conn.settimeout(SETUP_TIMEOUT_S)
        close_file(fd)
        pid, uid, pidfd = attest(sender)  # the process that sent the initiator's proof
        proof.link = SameHostLink(pid, uid, pidfd)
        pending = self._claim(body[:32], proof)
        if not hmac.compare_digest(body[32:], proof_of(pending.session, b"initiator")):
            raise SameHostRefused("the connecting process does not hold the session key")
        accept_files(conn)  # the initiator proved the key: its lease table may come
        with self._lock:
            pending.verified = True
            now = pending.decided
        if now:
            self._reply(pending)

    def _reply(self, pending: _Pending) -> None:
        """Our proof and lease table to the proven initiator, once both its proof came and the
        link was decided (exactly one of the two threads gets here, :meth:`decide`)."""
        proof = pending.proof
        assert proof is not None and pending.make_table is not None
        fd = -1
        try:
            fd, slots = pending.make_table()
            if fd < 0:  # closed meanwhile (the session was given up on another thread)
                raise SameHostRefused("the link's lease table was closed before our answer")
            assert proof.link is not None
            if pending.on_proven is None or not pending.on_proven(proof.link):
                raise SameHostRefused("our lease table is not served to that reader")
            with proof.lock:
                if proof.closed:
                    return
                send_message(proof.conn, M_REPLY, proof_of(pending.session, b"acceptor") +
                             struct.pack("<I", slots), fd)
            pending.replied.set()
        except (OSError, SameHostRefused) as exc:  # its worker ends the connection
            logger.info("kvdd same-host endpoint: could not answer a proof: %s", exc)
            _shutdown(proof)
        finally:
            close_fd(fd)

    def _final(self, proof: _Proof) -> None:
        """Step 3: the initiator's table, from the process attested at its hello, after our
        reply (the connection waits for the link decision until its session expires); the last
        message of the exchange."""
        link, pending = proof.link, proof.pending
        assert link is not None and pending is not None
        proof.conn.settimeout(max(pending.expires - time.monotonic(), 0.0) + SETUP_TIMEOUT_S)
        body, fd, sender = recv_message(proof.conn, M_FINAL, 4)
        (slots,) = struct.unpack("<I", body)
        link.table_fd, link.table_slots = fd, slots
        same_sender(sender, link.peer_pid)
        if not pending.replied.wait(SETUP_TIMEOUT_S):
            raise SameHostRefused("the initiator sent its table before our proof")
        if fd < 0 or slots > max_slots():
            raise SameHostRefused("the initiator sent no usable lease table")
        if not link.alive():
            raise SameHostRefused("the peer process exited during the proof")
        assert pending.on_link is not None
        pending.on_link(link)
        proof.attached = True

    def _end(self, proof: _Proof, failed: BaseException | None) -> None:
        """Close a connection and free its slot; a failed proof gives its session up."""
        if failed is not None:
            logger.info("kvdd same-host endpoint: refused a connection: %s", failed)
            if proof.link is not None and not proof.attached:
                proof.link.close()
        p = proof.pending
        if p is not None:
            with self._lock:
                if self._pending.get(session_id(p.session)) is p:
                    del self._pending[session_id(p.session)]
            if not proof.attached:
                self._forget(p)
        with proof.lock:
            proof.closed = True
            close_socket(proof.conn)  # (files the peer queued in it are closed off this thread)
        with self._lock:
            self._proving -= 1
        self._slots.release()

    def _forget(self, p: _Pending) -> None:
        """A session given up: its table (if made) closed, its caller told (``on_link(None)``)."""
        with self._lock:
            if p.forgotten:
                return
            p.forgotten = True
            on_link = p.on_link
        if on_link is None:
            return
        try:
            on_link(None)
        except Exception:
            logger.exception("kvdd same-host: a session's give-up callback failed")


def _shutdown(proof: _Proof) -> None:
    """End a connection's exchange from another thread (its worker then ends it)."""
    with proof.lock:
        if not proof.closed:
            with contextlib.suppress(OSError):
                proof.conn.shutdown(socket.SHUT_RDWR)


_endpoint_lock = threading.Lock()
_endpoint: Endpoint | None = None


def endpoint() -> Endpoint:
    """This process's endpoint, started on first use (and again in a forked child)."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None or _endpoint._pid != os.getpid():
            _endpoint = Endpoint()
        return _endpoint
