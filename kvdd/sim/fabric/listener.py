"""The listening socket of one instance (``llm.ListenIpInfo``, SEMANTICS.md §10 rule 6).

A real TCP socket, registered for in-process lookup.  One thread per listener runs a selector over
the listening socket and every connection that is not a link yet, in three bounded tables
(docs/security.md, *Bounds*):

* *not authenticated* (at most ``MAX_PREAUTH``, ``MAX_PREAUTH_PER_SOURCE`` per address): each gets
  ``PREAUTH_TIMEOUT_S`` from accept to complete the challenge-response (:mod:`.auth`), frames of at
  most ``MAX_AUTH`` bytes, and no state outside this loop;
* *authenticated, sending its hello* (at most ``MAX_POSTAUTH``, ``MAX_POSTAUTH_PER_SOURCE`` per
  address, ``MAX_HELLO_BUFFERED`` bytes in all): the whole hello within ``HELLO_TIMEOUT_S``, read here
  without a thread, then handed to the fixed pool of handshake workers (:mod:`.gate`);
* *answered, closing* (at most ``MAX_DRAINING``): read and discarded until the peer closes, at most
  ``LINGER_S`` (so closing does not reset the reply away).

A full table, or a source at its share, evicts rather than refuses (:class:`.admission.FairTable`:
from the sources with the most entries, the oldest idle entry among them first), so floods of cheap
connections cannot keep a legitimate initiator out; a connection that did not bring a whole
authentication hello (an initiator sends it in one write) and would only evict an entry of its own
address is closed at accept, before it costs a place or a registration.  The secret is read once and cached (:func:`.auth.load_secret`
checks the file with one ``lstat`` per hello).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import selectors
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque

from . import announce
from .admission import FairTable, source_of
from .auth import Session
from .gate import HandshakeGate
from .listener_auth import (AUTH_HELLO_BYTES, READING_HELLO, PreAuth, answer_hello, answer_proof,
                            whole_hello)
from .logutil import warn_limited
from .protocol import LinkOwner
from .registry import norm_ip, register, unregister
from .wire import (F_HELLO_LINK, F_HELLO_UNLINK, HDR, HELLO_TIMEOUT_S, LINGER_S, MAX_DRAINING,
                   MAX_HELLO_BUFFERED, MAX_POSTAUTH, MAX_POSTAUTH_PER_SOURCE, MAX_PREAUTH,
                   MAX_PREAUTH_PER_SOURCE, ProtocolError, VersionMismatch, check_header,
                   version_refusal)

logger = logging.getLogger(__name__)

__all__ = ["Listener", "ACCEPT_BATCH", "BACKLOG"]

ACCEPT_BATCH = 32  # connections accepted per turn of the loop (then the others are served)
BACKLOG = 4096  # the kernel's queue of connections not accepted yet (capped by somaxconn)
DEFER_ACCEPT_S = 1  # TCP_DEFER_ACCEPT: the kernel holds a connection that sent nothing (seconds)
_DEFER: int | None = getattr(socket, "TCP_DEFER_ACCEPT", None)  # Linux
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_MMAP_HELLO = 1 << 16  # hellos of at least this many bytes are read into an anonymous mapping


class _Hello:
    """An authenticated connection whose link or unlink hello is being read."""

    __slots__ = ("sock", "peer", "source", "session", "deadline", "head", "ftype", "body", "got")

    def __init__(self, state: PreAuth, session: Session) -> None:
        self.sock: socket.socket = state.sock
        self.peer = state.peer
        self.source = state.source
        self.session = session
        self.deadline = time.monotonic() + HELLO_TIMEOUT_S
        self.head = bytearray()
        self.ftype = -1
        self.body: bytearray | mmap.mmap = bytearray()
        self.got = 0


class _Draining:
    __slots__ = ("sock", "deadline")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + LINGER_S


_State = PreAuth | _Hello | _Draining


class Listener:
    """A real listening TCP socket for one instance, registered for in-process lookup, with a
    selector thread admitting and authenticating connections from other processes and hosts."""

    def __init__(self, owner: LinkOwner, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if _DEFER is not None:  # a connection reaches accept() only with its first bytes
                sock.setsockopt(socket.IPPROTO_TCP, _DEFER, DEFER_ACCEPT_S)
            # (inherited by accepted connections: a frame leaves at once, not after an ACK)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((ip, port & 0xFFFF))  # upstream accepts ports up to 2**32-1; htons keeps 16 bits
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self._ipv4 = family == socket.AF_INET  # the address is its own source (admission.py)
        self.ip = norm_ip(ip)
        self.port: int = sock.getsockname()[1]
        self._owner = weakref.ref(owner)  # never keeps the instance alive (SEMANTICS.md §3.1)
        self._owner_id = id(owner)
        self.cluster_id = owner.cluster_id
        self._closed = False
        self.accepted = 0  # connections accepted (diagnostics)
        self.dropped = 0  # of them closed at accept: closed already, or silent without room
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pre: FairTable[PreAuth] = FairTable(MAX_PREAUTH, MAX_PREAUTH_PER_SOURCE)
        self._post: FairTable[_Hello] = FairTable(MAX_POSTAUTH, MAX_POSTAUTH_PER_SOURCE)
        self._buffered = 0  # hello bytes announced by the connections in ``_post``
        self._drain: OrderedDict[_Draining, None] = OrderedDict()
        self._handback: deque[socket.socket] = deque()  # answered by a worker: to drain
        self.gate = HandshakeGate(self._owner, self._finish, f"{self.ip}:{self.port}")
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
        finalizer, :mod:`kvdd.sim.reaper`): a new connection is refused from now on; the loop
        closes what it holds and stops the handshake workers as it ends."""
        self._closed = True
        self._wake()
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

    def held(self) -> dict[str, int]:
        """How many connections each table holds now, and the links accepted (diagnostics)."""
        return {"preauth": len(self._pre), "hello": len(self._post), "draining": len(self._drain),
                "hello_bytes": self._buffered, "links": self.gate.links(),
                "accepted": self.accepted, "dropped": self.dropped}

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _finish(self, conn: socket.socket) -> None:
        """A worker answered ``conn`` (not a link): FIN now, read until the peer closes."""
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
        self._handback.append(conn)
        self._wake()

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                timeout = self._next_deadline() - time.monotonic()
                events = self._sel.select(min(max(timeout, 0.0), 1.0))
                accept = False
                for key, _mask in events:  # connections in progress before new ones
                    if self._closed:
                        break
                    if key.fileobj is self.sock:
                        accept = True
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif not self._current(key):
                        continue  # closed by an earlier event of this batch (evicted)
                    else:
                        try:
                            self._step(key.data)
                        except Exception:  # a bug: log it, drop that connection, go on
                            logger.exception("kvdd fabric: a connection to %s:%d failed",
                                             self.ip, self.port)
                            self._drop(key.data)
                while self._handback:
                    self._add_drain(self._handback.popleft())
                if accept and not self._closed:
                    self._accept()
                self._expire(time.monotonic())
        except Exception:  # a bug: log it; new links to this instance then fail
            logger.exception("kvdd fabric: the listener on %s:%d failed", self.ip, self.port)
        finally:
            for pre in self._pre.items():
                self._drop(pre)
            for hello in self._post.items():
                self._drop(hello)
            for drain in list(self._drain):
                self._drop(drain)
            while self._handback:
                with contextlib.suppress(OSError):
                    self._handback.popleft().close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()
            self.gate.close()
            announce.closed(self._owner_id)  # (what was kept for its next links)

    def _current(self, key: selectors.SelectorKey) -> bool:
        """Whether ``key`` (an event of this turn) is still its connection's registration: an
        earlier event of the same turn may have closed it (eviction) or given it a new state."""
        try:
            return self._sel.get_key(key.fileobj).data is key.data
        except (KeyError, ValueError):  # unregistered, or closed (fileno -1)
            return False

    def _next_deadline(self) -> float:
        soonest = time.monotonic() + 1.0
        for oldest in (self._pre.oldest(), self._post.oldest(), next(iter(self._drain), None)):
            if oldest is not None and oldest.deadline < soonest:
                soonest = oldest.deadline
        return soonest

    def _step(self, state: _State) -> None:
        if isinstance(state, PreAuth):
            self._step_pre(state)
        elif isinstance(state, _Hello):
            self._step_hello(state)
        else:
            try:
                if state.sock.recv(65536):
                    return
            except BlockingIOError:
                return
            except OSError:
                pass  # reset: done
            self._drop(state)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and friends: free a slot, do not spin
                if self._closed:
                    return
                warn_limited(logger, "accept", "kvdd fabric: accept on %s:%d failed: %s",
                             self.ip, self.port, exc)
                victim = next(iter(self._drain), None) or self._pre.oldest()
                if victim is not None:
                    self._drop(victim)
                else:
                    time.sleep(0.01)
                return
            self.accepted += 1
            source = addr[0] if self._ipv4 else source_of(addr)
            try:  # what the connection sent during the kernel's deferral
                first: bytes | None = conn.recv(AUTH_HELLO_BYTES, _DONTWAIT)
            except BlockingIOError:
                first = None
            except OSError:
                first = b""
            mine = self._pre.count(source)
            if first == b"" or (not whole_hello(first) and (
                    mine >= MAX_PREAUTH_PER_SOURCE
                    or (len(self._pre) >= MAX_PREAUTH and mine >= self._pre.largest()))):
                # closed already, or without a whole authentication hello (sent in one write
                # by every initiator) while it would evict an entry of its own address (at its
                # share, or the table full and its address among the largest): closed at once,
                # before it costs a place or a registration
                self.dropped += 1
                conn.close()
                continue
            conn.setblocking(False)
            state = PreAuth(conn, addr, source)
            for old in self._pre.add(state, source):  # fair eviction (admission.py)
                self._close(old)
            try:
                while first and state in self._pre and state.stage == READING_HELLO:
                    piece = state.need - len(state.buf)  # (the hello came with the connection)
                    self._step_pre(state, first[:piece])
                    first = first[piece:]
            except Exception:  # a bug: log it, drop that connection, go on
                logger.exception("kvdd fabric: a connection to %s:%d failed", self.ip, self.port)
                self._drop(state)
            if state not in self._pre:  # refused, malformed or dropped: done with
                continue
            try:
                self._sel.register(conn, selectors.EVENT_READ, state)
            except (OSError, ValueError):
                self._drop(state)

    def _expire(self, now: float) -> None:
        for table in (self._pre, self._post):
            while True:
                oldest = table.oldest()
                if oldest is None or oldest.deadline > now:
                    break
                self._drop(oldest)
        while self._drain:
            oldest_d = next(iter(self._drain))
            if oldest_d.deadline > now:
                break
            self._drop(oldest_d)

    def _close(self, state: _State) -> None:
        """Close a connection already removed from its table (evicted)."""
        if isinstance(state, _Hello):
            self._buffered -= len(state.body)
            state.body = bytearray()  # counted once, however often it is closed
            announce.abandon(state.session)  # (once: a no-op for a session already forgotten)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(state.sock)
        with contextlib.suppress(OSError):
            state.sock.close()

    def _drop(self, state: _State) -> None:
        if isinstance(state, PreAuth):
            self._pre.remove(state)
        elif isinstance(state, _Hello):
            self._post.remove(state)
        else:
            self._drain.pop(state, None)
        self._close(state)

    def _add_drain(self, conn: socket.socket) -> None:
        while len(self._drain) >= MAX_DRAINING:
            self._drop(next(iter(self._drain)))
        state = _Draining(conn)
        try:
            conn.setblocking(False)
            self._sel.register(conn, selectors.EVENT_READ, state)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                conn.close()
            return
        self._drain[state] = None

    def _refuse(self, state: PreAuth, data: bytes, why: str) -> None:
        """Send ``data`` (a refusal the peer can parse), then discard its input until it closes
        or LINGER_S passes (closing with unread input would reset the refusal away)."""
        warn_limited(logger, "refused", "kvdd fabric: refused a connection from %s: %s",
                     state.peer, why)
        self._pre.remove(state)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(state.sock)
        try:
            state.sock.send(data)
            state.sock.shutdown(socket.SHUT_WR)
        except OSError:
            with contextlib.suppress(OSError):
                state.sock.close()
            return
        self._add_drain(state.sock)

    # -- before authentication ---------------------------------------------------------------------
    def _step_pre(self, state: PreAuth, chunk: bytes | None = None) -> None:
        """Read (or take ``chunk``: what came with the connection) towards the frame in progress;
        from the socket, a frame's payload in the turn of its header (they come together)."""
        from_socket = chunk is None
        try:
            while True:
                if chunk is None:
                    chunk = state.sock.recv(state.need - len(state.buf))
                if not chunk:
                    self._drop(state)
                    return
                state.buf += chunk
                if len(state.buf) < state.need:
                    return
                if state.ftype < 0:
                    self._header(state)
                    more = from_socket and state.ftype >= 0  # (a payload follows its header)
                else:
                    self._frame(state)
                    more = False
                if not more:
                    break
                chunk = None
        except BlockingIOError:
            return
        except VersionMismatch as exc:
            self._refuse(state, version_refusal(exc.version, exc.ftype), str(exc))
        except (OSError, ProtocolError) as exc:
            logger.debug("kvdd fabric: connection from %s dropped: %s", state.peer, exc)
            self._drop(state)

    def _header(self, state: PreAuth) -> None:
        ftype, _req, length = check_header(state.buf)
        if ftype != state.expected():
            raise ProtocolError(f"frame type {ftype} before authentication")
        state.ftype = ftype
        state.buf = bytearray()
        state.need = length
        if length == 0:
            self._frame(state)

    def _frame(self, state: PreAuth) -> None:
        payload = bytes(state.buf)
        state.buf = bytearray()
        state.ftype = -1
        state.need = HDR.size
        session: Session | None = None
        if state.stage == READING_HELLO:
            data, why = answer_hello(state, payload, f"{self.ip}:{self.port}")
        else:
            data, why, session = answer_proof(state, payload, self.cluster_id)
        if why is not None:
            self._refuse(state, data, why)
            return
        try:
            if state.sock.send(data) != len(data):
                raise ProtocolError("the peer does not read")
        except BaseException:
            if session is not None:
                announce.abandon(session)
            raise
        if session is None:
            self._pre.progressed(state)  # evicted after those of its source still in their hello
            return
        self._pre.remove(state)
        hello = _Hello(state, session)
        for old in self._post.add(hello, hello.source):  # fair eviction (admission.py)
            self._close(old)
        self._sel.modify(state.sock, selectors.EVENT_READ, hello)
        self._step_hello(hello)  # the hello may have come with the proof

    # -- authenticated: the link or unlink hello ---------------------------------------------------
    def _step_hello(self, state: _Hello) -> None:
        try:
            if state.ftype < 0:
                chunk = state.sock.recv(HDR.size - len(state.head))
                if not chunk:
                    self._drop(state)
                    return
                if not state.head:
                    self._post.progressed(state)
                state.head += chunk
                if len(state.head) < HDR.size:
                    return
                ftype, _req, length = check_header(state.head)
                if ftype not in (F_HELLO_LINK, F_HELLO_UNLINK):
                    raise ProtocolError(f"frame type {ftype} instead of a hello")
                if ftype == F_HELLO_UNLINK:  # (an unlink uses no announcement)
                    announce.abandon(state.session)
                self._reserve(state, length)
                state.ftype = ftype
            while state.got < len(state.body):
                n = state.sock.recv_into(memoryview(state.body)[state.got:])
                if not n:
                    self._drop(state)
                    return
                state.got += n
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as exc:  # (a version mismatch here: the peer lied)
            logger.debug("kvdd fabric: hello from %s dropped: %s", state.peer, exc)
            self._drop(state)
            return
        self._post.remove(state)
        self._buffered -= len(state.body)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(state.sock)
        if not self.gate.submit(state.sock, state.session, state.ftype, state.body, state.source):
            warn_limited(logger, "busy", "kvdd fabric: too many hellos waiting on %s:%d; closing "
                         "one from %s", self.ip, self.port, state.peer)
            announce.abandon(state.session)
            with contextlib.suppress(OSError):
                state.sock.close()

    def _reserve(self, state: _Hello, length: int) -> None:
        """Room for a hello of ``length`` bytes: beyond MAX_HELLO_BUFFERED in all, the
        connections holding the biggest announced hellos are closed first (possibly this one)."""
        while self._buffered + length > MAX_HELLO_BUFFERED:
            biggest = max((h for h in self._post.items() if h.body), key=lambda h: len(h.body),
                          default=None)
            if biggest is None or len(biggest.body) < length:
                raise ProtocolError(f"no room for a hello of {length} bytes")
            self._drop(biggest)
        # a big hello gets pages of its own, returned to the system when it is done (from the
        # heap, hellos allocated here and freed by the workers would keep the process's RSS up)
        state.body = bytearray(length) if length < _MMAP_HELLO else mmap.mmap(-1, length)
        self._buffered += length
