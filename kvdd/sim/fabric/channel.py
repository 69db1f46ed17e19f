"""One link's TCP connection: serving the peer's requests, and this end's requests.

Both ends run the same :class:`Channel`.  On the comm backend the connection serves both
directions (the acceptor's entity for the initiator uses it too); on hixl only the initiator has
an entity.

*Receiving.*  One thread at a time reads the socket (through the connection's buffered
:class:`~.rx.Rx`) and handles every frame it reads, whatever it is for: the *leader*.  A caller
that sent a request leads until its own reply is in, so a small call costs the caller no thread
hand-off (it sends, reads its answer itself, and returns); frames for other waiters or requests of
the peer that arrive meanwhile are handled on the way.  A caller whose reply another leader reads
is woken by it.  The connection has no thread of its own: when no caller was active for
:data:`IDLE_S` its socket is watched by the fabric's reactor (:mod:`~.reactor`) and a pool thread
leads when bytes arrive (the peer's requests, the connection's end), reading only as far as they
have arrived (a frame that is not all there yet is left half-read, :data:`~.rx.Steps`, and
finished by the next leader); while callers are active it leaves the socket to them, and at once
takes it when a leader leaves bytes behind.
*Sending.*  ``send_lock`` orders whole frames; the connection's queue of jobs (:mod:`~.tx`)
answers queued requests and sends READ data, on the pool, without blocking; a receiving leader
answers a small request with a non-blocking send when the connection is free (the rest goes to
the queue, counted in its bounds; whoever sends next sends that rest first: ``_tail``), and so
is a LEASE on a cache.

Leases (SEMANTICS.md §10 rule 5 across processes, :mod:`~.leases`): a transfer first asks the
owner for a lease on the remote cache; the owner checks the cache is still registered (else
LLM_KV_CACHE_NOT_EXIST) and counts it in flight, so unregister / unlink / finalize wait for it.
A lease ends when the reader releases it, when the reader's connection closes, or when it
expires: ``SyncKvCacheWaitTime`` of the reader (announced in the handshake, capped by the owner)
plus a grace; if the owner is still moving bytes for it then, the connection is closed.  Small
transfers (:mod:`~.small`) take one round trip: LEASE_READ / LEASE_WRITE, served by the leader
inline with the same checks and statuses, the cache held only around the copy (a one-run
LEASE_READ by compiled code: :meth:`~.rx.Rx.serve_lease_read`).

This end's requests (registering, sending, waiting and leading) are :class:`~.calls.Calls`, and
the queue of what it sends without a caller is :class:`~.tx.Sender`: mixins of :class:`Channel`
in their own modules.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Mapping

from ..._native._small import serve_one_run
from ...status import PARAM_INVALID, S_OK, Status
from .. import faults
from ..faults import injections as _injections
from .calls import Calls
from .endpoints import add_endpoint, close_channels, close_endpoint, discard_endpoint, take_endpoint
from .leases import Lease, LeaseTable
from .logutil import warn_limited
from .protocol import LinkOffer, LinkOwner, PeerHandle, ServedCache, Snapshot
from .reactor import REACTOR
from .rx import ALL, Goodbye, Pending, Rx, Sink, Steps
from .serving import serve_write_steps
from .small import serve_small_read, serve_small_write_steps
from .tx import Sender
from .watch import IDLE_S, Watch
from .watchdog import WATCHDOG, DeadlineGuard
from .wire import (CLOSE_LINGER_S, F_CLOSE_HANDLE, F_DATA, F_DONE, F_GOODBYE, F_LEASE,
                   F_LEASE_READ, F_LEASE_REPLY, F_LEASE_WRITE, F_PING, F_PONG, F_READ, F_RELEASE,
                   F_WRITE, HDR, MAGIC, PROTOCOL_VERSION, SMALL_BYTES, ProtocolError, Reader,
                   frame)

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Pending", "Sink", "take_endpoint", "close_channels", "close_endpoint",
           "IDLE_S"]

_WHOLE = 4096  # a payload up to this is read once all of it arrived; longer ones as they come


class GoneOwner:
    """Stands for an instance that was dropped (SEMANTICS.md §3.1) on the connections it had: it
    serves nothing, as a finalized instance (its teardown closes them soon)."""

    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 0
    initialized = False

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id

    def snapshot_for_link(self) -> Snapshot:
        return {}, {}

    def serve_link(self, peer: LinkOffer, force_link: bool,
                   make_handle: Callable[[], PeerHandle]) -> tuple[int, str, Snapshot | None]:
        return Status.LLM_LINK_FAILED, "the instance was destroyed", None

    def peer_unlinked(self, peer_cluster_id: int) -> int:
        return S_OK


class Channel(Calls, Sender, Watch):
    """One end of a link's TCP connection: serves the peer's requests on ``owner``'s caches and
    carries this end's requests (see the module docstring)."""

    def __init__(self, sock: socket.socket, owner: LinkOwner, label: str) -> None:
        self.sock = sock
        # held weakly: a connection never keeps its instance alive (SEMANTICS.md §3.1)
        self._owner = weakref.ref(owner)
        self._gone = GoneOwner(owner.cluster_id)
        self.label = label
        self.served: Mapping[int, ServedCache] = {}  # our caches visible to the peer over this link
        self.peer_wait_ms = 1000
        self.send_lock = threading.Lock()
        self.rx = Rx(sock)
        self.leases = LeaseTable(self)
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._sink_lock = threading.Lock()  # held while DATA goes into a caller's sink
        self._guard = DeadlineGuard(self._waiting, self.kill)  # closes it when a request is late
        self._req_ids = 0
        self._leader: object | None = None  # who reads the socket now (a Pending, a pool thread)
        self._waiters = 0  # callers waiting on _rx_cv (for their reply or to lead)
        self._active = 0  # callers with a request in progress
        self._last_active = 0.0
        self._rx_cv = threading.Condition(self._lock)
        self._watch_init()
        self._tail: bytes | None = None  # the unsent rest of a frame (under send_lock)
        self._tx_init()
        self._closing = False
        self._closed_wr = threading.Event()  # the sending side sent FIN (after GOODBYE, if asked)
        self.dead = threading.Event()
        self.peer_finalized = False
        self.local_user = False  # our PeerHandle on the peer uses this connection
        self.peer_user = False  # the peer's PeerHandle on us uses it
        self._started = False
        self._pid = os.getpid()
        self._reactor = REACTOR
        self._fd = -1
        self._running = threading.Event()  # set by start(): the socket may be read from then
        self.on_dead: Callable[[], None] | None = None  # the listener's link count (gate.py)

    @property
    def owner(self) -> LinkOwner:
        """The instance whose caches this connection serves (a :class:`GoneOwner` once dropped)."""
        owner = self._owner()
        return self._gone if owner is None else owner

    def _here(self) -> bool:
        """In the process that started the connection (a forked child only inherited it)."""
        return self._pid == os.getpid()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve the connection (reads on the pool from now on).  OSError when it was closed
        before it started (the peer's unlink can come before the acceptor's worker gets here)."""
        if self.sock.fileno() < 0:
            raise OSError(errno.EBADF, "the connection was closed before it started")
        self.sock.settimeout(None)
        with contextlib.suppress(OSError):  # (not TCP: a socket pair in tests)
            # both ends: a small frame (a reply, a READ's DONE after its DATA) never waits for
            # the ACK of what went before it (Nagle), which the peer may delay
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fd = self.sock.fileno()
        if fd < 0:  # (closed by another thread meanwhile)
            raise OSError(errno.EBADF, "the connection was closed before it started")
        add_endpoint(self.owner, self)
        self._pid = os.getpid()
        self._fd = fd
        self._reactor.add(fd, self)
        with self._lock:
            self._started = True
            self._running.set()
            if self.dead.is_set():
                return
            self._bg_poke_locked()
            if self._jobs:
                self._tx_kick_locked()

    def kill(self) -> None:
        """Abort the connection (errors, deadlines): both directions stop at once.  Nothing in a
        forked child: the socket is its parent's connection too."""
        if self._started and not self._here():
            return
        with contextlib.suppress(OSError):  # already closed: nothing to abort
            self.sock.shutdown(socket.SHUT_RDWR)
        if not self._started:
            self._on_dead()
            return
        self._bg_find_end()

    def close(self, goodbye: bool = False) -> None:
        """Close gracefully: optional GOODBYE, then FIN; the receiving side drains until the
        peer closes (at most CLOSE_LINGER_S).  Nothing in a forked child (the parent's
        connection)."""
        if self._started and not self._here():
            return
        with self._lock:
            if self._closing or self.dead.is_set():
                return
            self._closing = True
        if not self._started:
            self._on_dead()
            return
        self._queue_close(goodbye)
        WATCHDOG.schedule(CLOSE_LINGER_S, self.kill)
        if goodbye:  # finalize returns once the peers have been told (or the link is dead)
            self._closed_wr.wait(CLOSE_LINGER_S)

    def release_local_user(self) -> None:
        """Our handle is closed: tell the peer; close when neither side uses the connection."""
        with self._lock:
            if not self.local_user:
                return
            self.local_user = False
            unused = not self.peer_user
        if unused:
            self.close()
        else:
            self.send_oneway(F_CLOSE_HANDLE, b"")

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None:
        return self.leases.forget(lease_id, revoked)

    def _peer_released(self) -> None:
        with self._lock:
            self.peer_user = False
            unused = not self.local_user
        for lease in self.leases.take_all():
            lease.drop()
        if unused:
            self.close()

    def _on_dead(self) -> None:
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
            self._running.set()  # nobody waits for a start that will not come
            pending = list(self._pending.values())
            for p in pending:
                if not p.done:  # a request that has its DONE keeps it (the first DONE decides)
                    p.failed = True
                    p.done = True
            self._rx_cv.notify_all()
            self._jobs.clear()
            self._jobs.append(None)
            self._tx_wake_dead()
            half, self._rxs = (self._rxs, None) if self._leader is None else (None, self._rxs)
        if half is not None:  # a half-read frame lets go of what it holds (a WRITE's lease)
            half.close()
        for lease in self.leases.take_all(close=True):  # a dead reader releases at once
            lease.drop()
        self._closed_wr.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a caller blocked in send or recv
        if self._started:
            self._reactor.remove(self._fd, self)
        with contextlib.suppress(OSError):
            self.sock.close()
        discard_endpoint(self._owner(), self)
        hook = self.on_dead
        if hook is not None:
            try:
                hook()
            except Exception:  # a bug: log it; the connection is closed anyway
                logger.exception("kvdd fabric %s: the end-of-link hook failed", self.label)

    def _fail(self, exc: BaseException) -> None:
        """Reading failed (the leader's exception): the connection ends."""
        if isinstance(exc, Goodbye):
            # the peer finalized: our handle on it (a stale entity) now finds no cache (§10
            # rule 2); requests in flight end now
            self.peer_finalized = True
            self._peer_released()
        elif isinstance(exc, OSError):  # the peer closed or died, or we closed
            logger.debug("kvdd fabric %s: connection ends: %s", self.label, exc)
        elif isinstance(exc, (ProtocolError, struct.error)):  # the peer broke the protocol
            warn_limited(logger, "protocol", "kvdd fabric %s: closing the link: %s", self.label, exc)
            with contextlib.suppress(OSError):  # abort (RST): nothing queued for it is sent
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif isinstance(exc, Exception):  # a bug: log it; transfers get LLM_TIMEOUT
            logger.exception("kvdd fabric %s: receiving failed", self.label, exc_info=exc)
        self._on_dead()

    # -- receiving: frames ----------------------------------------------------------------------------
    def _frame(self) -> None:
        """Read one frame and handle it, blocking (a leader; it first finishes a frame a pool
        thread left half-read)."""
        steps = self._rxs
        if steps is None:
            steps = self._frame_steps()
            next(steps)
        else:
            self._rxs = None
        try:
            while True:
                steps.send(ALL)
        except StopIteration:
            pass

    def _frame_steps(self) -> Steps[None]:
        """Read one frame and handle it, as far as its bytes have arrived (:data:`~.rx.Steps`)."""
        yield HDR.size
        ftype, req, length = self.rx.header()
        if ftype == F_DATA:
            yield from self._data_steps(req, length)
            return
        payload = yield from self._payload_steps(length)
        if ftype in (F_LEASE_REPLY, F_DONE, F_PONG):
            with self._lock:
                p = self._pending.get(req)
                if p is None and req and (self._req_ids - req) & 0xFFFFFFFF < 1 << 31:
                    # a request of ours that has its answer (its caller may have returned): a
                    # second reply (DONE after DONE) breaks the link; the first one stands.  (A
                    # reply to an id never used is dropped, as before.)
                    raise ProtocolError(f"a second reply to request {req}")
                if p is not None:
                    if p.done and not p.failed:  # the first reply decides; more is a violation
                        raise ProtocolError("a second reply to one request")
                    p.reply = payload
                    p.done = True
                    if self._waiters and p is not self._leader:
                        self._rx_cv.notify_all()
        elif ftype == F_LEASE_READ:
            if not _injections.armed:  # the one-run request compiled (small.py's twin), else:
                answer = serve_one_run(payload, req, self.leases.grant_small, self.owner,
                                       self.served, SMALL_BYTES, PARAM_INVALID, MAGIC,
                                       PROTOCOL_VERSION)
                self._answer(req, answer if answer is not None else serve_small_read(
                    self.owner, self._grant_small, req, payload))
            elif any(inj.serve for inj in faults.active()):  # slow server
                self._enqueue(ftype, req, payload)
            else:
                self._answer(req, serve_small_read(self.owner, self._grant_small, req, payload))
        elif ftype == F_LEASE and len(payload) == 8 and not _injections.armed:
            # a lease on a cache (a few dict look-ups): answered at once, as a LEASE_READ is
            self._answer(req, frame(F_LEASE_REPLY, req, self.leases.grant(
                self.owner, self.served, payload, self.peer_wait_ms, req)))
        elif ftype in (F_LEASE, F_READ, F_PING):
            self._enqueue(ftype, req, payload)
        elif ftype == F_LEASE_WRITE:
            answer = yield from serve_small_write_steps(self.owner, self._grant_small, self.rx,
                                                        req, payload)
            self._answer(req, answer)
        elif ftype == F_WRITE:
            status = yield from serve_write_steps(self.leases, self.owner, self.rx, req, payload)
            self._enqueue(F_DONE, req, status)
        elif ftype == F_RELEASE:
            lease_id = Reader(payload).u("Q")
            lease = self.leases.forget(lease_id)
            if lease is not None:
                lease.drop()
        elif ftype == F_CLOSE_HANDLE:
            self._peer_released()
        elif ftype == F_GOODBYE:
            raise Goodbye()
        else:
            raise ProtocolError(f"unexpected frame type {ftype} on a link")

    def _payload_steps(self, length: int) -> Steps[bytes]:
        """A payload of a checked length: read whole once it arrived (up to _WHOLE bytes), else
        piece by piece as it comes (memory grows with the bytes that arrived, as for a blocking
        read: a peer announcing 4 MiB and sending 1 byte costs 1 byte)."""
        if length == 0:
            return b""
        avail = yield min(length, _WHOLE)
        if avail >= length:
            return self.rx.exact(length)
        buf = bytearray()
        while True:
            buf += self.rx.exact(min(length - len(buf), avail))  # there: no wait
            if len(buf) == length:
                return bytes(buf)
            avail = yield 1

    def _data_steps(self, req: int, length: int) -> Steps[None]:
        """DATA for a pending READ: into its sink (unless its caller gave up), as it arrives."""
        with self._lock:
            p = self._pending.get(req)
        if p is None or p.sink is None:
            raise ProtocolError("DATA without a pending read")
        if p.done and not p.failed:
            raise ProtocolError("DATA after the request's DONE")
        sink = p.sink
        left = length
        while True:
            avail = yield 1 if left else 0
            take = min(left, avail)
            with self._sink_lock:
                if p.cancelled:
                    self.rx.discard(take)
                else:
                    if take < length and left == length and length > sink.left:
                        raise ProtocolError("more DATA than the transfer holds")  # as the sink
                    sink.recv(self.rx, take)
            left -= take
            if not left:
                return

    def _grant_resolving_owner(self, _owner: object, served: Mapping[int, ServedCache],
                               cache_id: int) -> tuple[int, ServedCache | None]:
        return self.leases.grant_small(self.owner, served, cache_id)

    def _grant_small(self, cache_id: int) -> tuple[int, ServedCache | None]:
        return self.leases.grant_small(self.owner, self.served, cache_id)
