"""The listening socket of one instance (``llm.ListenIpInfo``, SEMANTICS.md §10 rule 6).

A real TCP socket, registered for in-process lookup.  One thread per listener runs a selector over
the listening socket and every connection that has not authenticated yet: each gets
``PREAUTH_TIMEOUT_S`` from accept to complete the challenge-response (:mod:`.auth`), frames of at
most ``MAX_AUTH`` bytes, and no state outside this loop; at most ``MAX_PREAUTH`` such connections
exist (a new one evicts the oldest), so idle or dripping connections cannot starve legitimate ones.
An authenticated connection moves to a thread of its own for its link or unlink request
(:func:`.handshake.serve_session`; at most ``MAX_HELLO_THREADS`` at a time).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import threading
import time
import weakref
from collections import OrderedDict

from ...status import Status
from .auth import (NONCE_BYTES, SecretError, Session, channel_binding, load_secret, mac,
                   session_key)
from .handshake import auth_refusal, mode_mismatch, serve_session, transcript_of
from .logutil import warn_limited
from .protocol import LinkOwner
from .registry import norm_ip, register, unregister
from .wire import (F_AUTH_CHALLENGE, F_AUTH_HELLO, F_AUTH_OK, F_AUTH_PROOF, HDR,
                   MAX_HELLO_THREADS, MAX_PREAUTH, PREAUTH_TIMEOUT_S, ProtocolError,
                   VersionMismatch, check_header, frame, version_refusal)

logger = logging.getLogger(__name__)

__all__ = ["Listener"]

_READING_HELLO, _READING_PROOF, _DRAINING = 0, 1, 2


class _PreAuth:
    """A connection that has not authenticated yet (lives only in the listener's loop)."""

    __slots__ = ("sock", "deadline", "stage", "buf", "ftype", "need", "nonce_i", "nonce_a",
                 "key", "auth_off", "t0", "peer")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = time.monotonic() + PREAUTH_TIMEOUT_S
        self.stage = _READING_HELLO
        self.buf = bytearray()
        self.ftype = -1  # the frame being read (-1: its header)
        self.need = HDR.size
        self.nonce_i = b""
        self.nonce_a = b""
        self.key = b""
        self.auth_off = False
        self.t0 = b""


class Listener:
    """A real listening TCP socket for one instance, registered for in-process lookup, with a
    selector thread authenticating connections from other processes and hosts."""

    def __init__(self, owner: LinkOwner, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port & 0xFFFF))  # upstream accepts ports up to 2**32-1; htons keeps 16 bits
            sock.listen(512)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.ip = norm_ip(ip)
        self.port: int = sock.getsockname()[1]
        self._owner = weakref.ref(owner)  # never keeps the instance alive (SEMANTICS.md §3.1)
        self.cluster_id = owner.cluster_id
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pre: OrderedDict[socket.socket, _PreAuth] = OrderedDict()  # oldest first
        self._hello_lock = threading.Lock()
        self._hellos = 0
        register(self.ip, self.port, owner)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kvdd-sim-listen {self.ip}:{self.port}")
        self._thread.start()

    @property
    def owner(self) -> LinkOwner | None:
        """The instance this listener serves, None once it is gone."""
        return self._owner()

    def stop_accepting(self) -> None:
        """Close the listening socket and stop the loop without taking any lock (safe in a
        finalizer, :mod:`kvdd.sim.reaper`): a new connection is refused from now on."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self) -> None:
        """Stop accepting (links already made stay until unlink / finalize)."""
        unregister(self.ip, self.port, self._owner())
        self.stop_accepting()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                timeout = 1.0
                if self._pre:
                    oldest = next(iter(self._pre.values()))
                    timeout = min(max(oldest.deadline - now, 0.0), 1.0)
                for key, _mask in self._sel.select(timeout):
                    if self._closed:
                        break
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        state: _PreAuth = key.data
                        self._step(state)
                self._expire(time.monotonic())
        except Exception:  # a bug: log it; new links to this instance then fail
            logger.exception("kvdd fabric: the listener on %s:%d failed", self.ip, self.port)
        finally:
            for state in list(self._pre.values()):
                self._drop(state)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and friends: free a slot, do not spin
                warn_limited(logger, "accept", "kvdd fabric: accept on %s:%d failed: %s",
                             self.ip, self.port, exc)
                if self._pre:
                    self._drop(next(iter(self._pre.values())))
                else:
                    time.sleep(0.01)
                return
            if len(self._pre) >= MAX_PREAUTH:  # evict the oldest unauthenticated connection
                self._drop(next(iter(self._pre.values())))
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            state = _PreAuth(conn, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))
            self._pre[conn] = state
            self._sel.register(conn, selectors.EVENT_READ, state)

    def _expire(self, now: float) -> None:
        while self._pre:
            state = next(iter(self._pre.values()))
            if state.deadline > now:
                return
            self._drop(state)

    def _drop(self, state: _PreAuth) -> None:
        self._pre.pop(state.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(state.sock)
        with contextlib.suppress(OSError):
            state.sock.close()

    def _refuse(self, state: _PreAuth, data: bytes, why: str) -> None:
        """Send ``data`` (a refusal the peer can parse), then discard its input until it closes
        or its deadline passes (closing with unread input would reset the refusal away)."""
        warn_limited(logger, "refused", "kvdd fabric: refused a connection from %s: %s",
                     state.peer, why)
        try:
            state.sock.send(data)
            state.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(state)
            return
        state.stage = _DRAINING

    # -- one connection's state machine -------------------------------------------------------------
    def _step(self, state: _PreAuth) -> None:
        try:
            if state.stage == _DRAINING:
                if not state.sock.recv(65536):
                    self._drop(state)
                return
            chunk = state.sock.recv(state.need - len(state.buf))
            if not chunk:
                self._drop(state)
                return
            state.buf += chunk
            if len(state.buf) < state.need:
                return
            if state.ftype < 0:
                self._header(state)
            else:
                self._frame(state)
        except BlockingIOError:
            return
        except VersionMismatch as exc:
            self._refuse(state, version_refusal(exc.version, exc.ftype), str(exc))
        except (OSError, ProtocolError) as exc:
            logger.debug("kvdd fabric: connection from %s dropped: %s", state.peer, exc)
            self._drop(state)

    def _header(self, state: _PreAuth) -> None:
        ftype, _req, length = check_header(state.buf)
        expected = F_AUTH_HELLO if state.stage == _READING_HELLO else F_AUTH_PROOF
        if ftype != expected:
            raise ProtocolError(f"frame type {ftype} before authentication")
        state.ftype = ftype
        state.buf = bytearray()
        state.need = length
        if length == 0:
            self._frame(state)

    def _frame(self, state: _PreAuth) -> None:
        payload = bytes(state.buf)
        state.buf = bytearray()
        state.ftype = -1
        state.need = HDR.size
        if state.stage == _READING_HELLO:
            self._on_hello(state, payload)
        else:
            self._on_proof(state, payload)

    def _on_hello(self, state: _PreAuth, hello: bytes) -> None:
        if len(hello) != NONCE_BYTES + 1:
            raise ProtocolError("malformed authentication hello")
        try:
            secret = load_secret()
        except SecretError as exc:
            warn_limited(logger, "secret", "kvdd fabric: cannot authenticate links to %s:%d: %s",
                         self.ip, self.port, exc)
            self._refuse(state, auth_refusal(Status.LLM_LINK_FAILED,
                                             "the peer has no usable fabric secret (see its log)"),
                         str(exc))
            return
        peer_off = bool(hello[NONCE_BYTES])
        if peer_off != secret.auth_off:
            self._refuse(state, auth_refusal(Status.LLM_LINK_FAILED, mode_mismatch(peer_off)),
                         "KVDD_FABRIC_AUTH differs")
            return
        state.nonce_i = hello[:NONCE_BYTES]
        state.nonce_a = secrets.token_bytes(NONCE_BYTES)
        state.key = secret.key
        state.auth_off = secret.auth_off
        challenge = state.nonce_a + bytes([int(secret.auth_off)])
        state.t0 = transcript_of(hello, challenge)
        data = frame(F_AUTH_CHALLENGE, 0, challenge)
        if state.sock.send(data) != len(data):
            raise ProtocolError("the peer does not read")
        state.stage = _READING_PROOF

    def _on_proof(self, state: _PreAuth, proof: bytes) -> None:
        expected = mac(state.key, "initiator", state.nonce_i, state.nonce_a, state.t0)
        if not hmac.compare_digest(proof, expected):
            self._refuse(state, auth_refusal(
                Status.LLM_LINK_FAILED,
                "authentication failed: the two sides hold different fabric secrets; set the "
                "same KVDD_FABRIC_SECRET (or KVDD_FABRIC_SECRET_FILE) on both sides "
                "(`kvdd fabric-secret` makes one)"), "wrong secret")
            return
        t1 = hashlib.sha256(state.t0 + proof).digest()
        answer = mac(state.key, "acceptor", state.nonce_i, state.nonce_a, t1)
        data = frame(F_AUTH_OK, 0, answer)
        if state.sock.send(data) != len(data):
            raise ProtocolError("the peer does not read")
        transcript = hashlib.sha256(t1 + answer).digest()
        session = Session(session_key(state.key, state.nonce_i, state.nonce_a, transcript),
                          transcript, False, self.cluster_id, 0, "", state.auth_off,
                          channel_binding(state.sock, initiator=False))
        conn = state.sock
        self._pre.pop(conn, None)
        self._sel.unregister(conn)
        with self._hello_lock:
            busy = self._hellos >= MAX_HELLO_THREADS
            if not busy:
                self._hellos += 1
        if busy:
            warn_limited(logger, "busy", "kvdd fabric: %d handshakes in progress on %s:%d; "
                         "closing a new one", MAX_HELLO_THREADS, self.ip, self.port)
            conn.close()
            return
        conn.setblocking(True)
        threading.Thread(target=self._serve, args=(conn, session), daemon=True,
                         name="kvdd-sim-handshake").start()

    def _serve(self, conn: socket.socket, session: Session) -> None:
        keep = False
        try:
            owner = self._owner()
            if owner is not None:  # else the instance was dropped: the connection closes
                keep = serve_session(owner, conn, session)
            del owner
        except (OSError, ProtocolError) as exc:  # malformed, truncated, too slow
            logger.debug("kvdd fabric: handshake ended: %s", exc)
        except Exception:  # a bug: log it; the connection closes
            logger.exception("kvdd fabric: handshake failed")
        finally:
            with self._hello_lock:
                self._hellos -= 1
            if not keep:
                with contextlib.suppress(OSError):
                    conn.close()
