"""One link's TCP connection: serving the peer's requests, and this end's requests.

Both ends run the same :class:`Channel`.  On the comm backend the connection serves both
directions (the acceptor's entity for the initiator uses it too); on hixl only the initiator has
an entity.

*Receiving.*  One thread at a time reads the socket (through the connection's buffered
:class:`~.rx.Rx`) and handles every frame it reads, whatever it is for: the *leader*.  A caller
that sent a request leads until its own reply is in, so a small call costs the caller no thread
hand-off (it sends, reads its answer itself, and returns); frames for other waiters or requests of
the peer that arrive meanwhile are handled on the way.  A caller whose reply another leader reads
is woken by it.  The connection's receiver thread leads when no caller was active for
:data:`IDLE_S` (it then waits in ``recv``: the peer's requests, the connection's end, and the
first reply of a caller arriving meanwhile); while callers are active it leaves the socket to
them, looking again after :data:`IDLE_S`, then less and less often while they stay busy (at
most every :data:`IDLE_MAX_S`: a peer's request arriving just after a burst of calls waits that
long at most), and at once when a leader leaves bytes behind.
*Sending.*  ``send_lock`` orders whole frames; a worker thread answers queued requests and sends
READ data; a receiving leader answers a small request with a non-blocking send when the
connection is free (the rest goes to the worker, counted in the queue bounds; whoever sends next
sends that rest first: ``_tail``).

Leases (SEMANTICS.md §10 rule 5 across processes, :mod:`~.leases`): a transfer first asks the
owner for a lease on the remote cache; the owner checks the cache is still registered (else
LLM_KV_CACHE_NOT_EXIST) and counts it in flight, so unregister / unlink / finalize wait for it.
A lease ends when the reader releases it, when the reader's connection closes, or when it
expires: ``SyncKvCacheWaitTime`` of the reader (announced in the handshake, capped by the owner)
plus a grace; if the owner is still moving bytes for it then, the connection is closed.  Small
transfers (:mod:`~.small`) take one round trip: LEASE_READ / LEASE_WRITE, served by the leader
inline with the same checks and statuses, the cache held only around the copy (a one-run
LEASE_READ by compiled code: :meth:`~.rx.Rx.serve_lease_read`).

This end's requests (registering, sending, waiting and leading) are :class:`~.calls.Calls`, a
mixin of :class:`Channel` in its own module.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from ..._native._small import serve_one_run
from ...status import PARAM_INVALID, S_OK, Status
from .. import faults
from ..faults import injections as _injections
from .calls import Calls
from .endpoints import add_endpoint, close_channels, close_endpoint, discard_endpoint, take_endpoint
from .leases import Lease, LeaseTable
from .logutil import warn_limited
from .protocol import LinkOffer, LinkOwner, PeerHandle, ServedCache, Snapshot
from .rx import Goodbye, Pending, Rx, Sink
from .serving import serve_read, serve_write
from .small import serve_small_read, serve_small_write
from .watchdog import WATCHDOG, DeadlineGuard
from .wire import (CLOSE_LINGER_S, F_CLOSE_HANDLE, F_DATA, F_DONE, F_GOODBYE, F_LEASE,
                   F_LEASE_READ, F_LEASE_REPLY, F_LEASE_WRITE, F_PING, F_PONG, F_READ, F_RELEASE,
                   F_WRITE, MAGIC, MAX_JOBS, MAX_QUEUED_BYTES, PROTOCOL_VERSION,
                   SMALL_BYTES, ProtocolError, Reader, decode_request, frame)

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Pending", "Sink", "take_endpoint", "close_channels", "close_endpoint",
           "IDLE_S", "IDLE_MAX_S"]

IDLE_S = 0.001  # the receiver thread leaves the socket to callers active within this (seconds)
IDLE_MAX_S = 0.008  # the longest it sleeps while callers keep the socket busy (seconds)
_J_SEND = -1  # worker job: send this end's own frame (RELEASE, CLOSE_HANDLE)
_J_CLOSE = -2  # worker job: (GOODBYE and) FIN, after every frame queued before
_J_REPLY = 101  # worker job: send an answer the reader prepared (counted in the queue bounds)
_J_FLUSH = 102  # worker job: send the rest of an answer the reader began (``_tail``)
ANSWER_CHARGE = 4096  # queue bytes a prepared answer counts as, at least (2,048 fit the bound)


def _charge(ftype: int, payload: bytes | bytearray | int) -> tuple[int, int]:
    """What a queued job counts in the bounds: (requests, bytes)."""
    if ftype in (_J_REPLY, _J_FLUSH):
        return 0, max(len(payload) if not isinstance(payload, int) else 0, ANSWER_CHARGE)
    return 1, 0 if isinstance(payload, int) else len(payload)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_RECEIVER = object()  # the leader token of the receiver thread


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


class Channel(Calls):
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
        self._leader: object | None = None  # who reads the socket now (a Pending, _RECEIVER)
        self._waiters = 0  # callers waiting on _rx_cv (for their reply or to lead)
        self._active = 0  # callers with a request in progress
        self._last_active = 0.0
        self._rx_cv = threading.Condition(self._lock)
        self._bg_cv = threading.Condition(self._lock)
        self._jobs: deque[tuple[int, int, bytes | bytearray | int] | None] = deque()
        self._jobs_cv = threading.Condition(self._lock)
        self._queued_jobs = 0  # the peer's requests waiting for the worker
        self._queued_bytes = 0
        self._tail: bytes | None = None  # the unsent rest of a frame (under send_lock)
        self._closing = False
        self._closed_wr = threading.Event()  # the worker sent FIN (after GOODBYE, if asked)
        self.dead = threading.Event()
        self.peer_finalized = False
        self.local_user = False  # our PeerHandle on the peer uses this connection
        self.peer_user = False  # the peer's PeerHandle on us uses it
        self._started = False
        self._running = threading.Event()  # set by start(): the socket may be read from then
        self.on_dead: Callable[[], None] | None = None  # the listener's link count (gate.py)

    @property
    def owner(self) -> LinkOwner:
        """The instance whose caches this connection serves (a :class:`GoneOwner` once dropped)."""
        owner = self._owner()
        return self._gone if owner is None else owner

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.sock.settimeout(None)
        add_endpoint(self.owner, self)
        self._started = True
        self._running.set()
        threading.Thread(target=self._receiver, name=f"kvdd-sim-rx {self.label}", daemon=True).start()
        threading.Thread(target=self._worker, name=f"kvdd-sim-tx {self.label}", daemon=True).start()

    def kill(self) -> None:
        """Abort the connection (errors, deadlines): both directions stop at once."""
        with contextlib.suppress(OSError):  # already closed: nothing to abort
            self.sock.shutdown(socket.SHUT_RDWR)
        if not self._started:
            self._on_dead()

    def close(self, goodbye: bool = False) -> None:
        """Close gracefully: optional GOODBYE, then FIN; the receiver drains until the peer
        closes (at most CLOSE_LINGER_S)."""
        with self._lock:
            if self._closing or self.dead.is_set():
                return
            self._closing = True
        if not self._started:
            self._on_dead()
            return
        with self._lock:  # after the frames already queued (CLOSE_HANDLE, RELEASE)
            self._jobs.append((_J_CLOSE, int(goodbye), b""))
            self._jobs_cv.notify()
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
            self._bg_cv.notify_all()
            self._jobs.clear()
            self._jobs.append(None)
            self._jobs_cv.notify_all()
        for lease in self.leases.take_all(close=True):  # a dead reader releases at once
            lease.drop()
        self._closed_wr.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked in send
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

    # -- receiving ------------------------------------------------------------------------------
    def _unlead(self) -> None:
        with self._lock:
            self._leader = None
            if self._waiters:
                self._rx_cv.notify_all()
            if self.rx.buffered:
                self._bg_cv.notify()

    def _receiver(self) -> None:
        """The receiver thread: leads while no caller is active (see the module docstring); it
        then waits in ``recv`` itself (a caller arriving meanwhile gets its first reply from it)."""
        try:
            while True:
                with self._lock:
                    wait = IDLE_S
                    while True:
                        if self.dead.is_set():
                            return
                        if self._leader is None and not self._waiters and (
                                self.rx.buffered or not self._active
                                and time.monotonic() - self._last_active >= IDLE_S):
                            break
                        self._bg_cv.wait(wait)
                        # callers keep the socket busy: look less often (up to IDLE_MAX_S)
                        wait = min(wait * 2, IDLE_MAX_S)
                    self._leader = _RECEIVER
                try:
                    rx = self.rx
                    # the compiled read blocks until a frame comes: it gets no reference to the
                    # owner (that would keep a dropped instance alive, §3.1); the grant resolves
                    # the owner when a request arrives
                    grant = self._grant_resolving_owner
                    while True:
                        got = None if _injections.armed else rx.serve_lease_read(
                            grant, None, self.served, SMALL_BYTES, PARAM_INVALID)
                        if got is not None:  # a one-run LEASE_READ, served in compiled code
                            self._answer(*got)
                        else:
                            self._frame()
                        # keep leading while it would take the lead again; read without the lock
                        # (a caller arriving meanwhile finds its reply read by this leader, as
                        # when it arrives just after the check)
                        if (self._waiters or self.dead.is_set() or not (
                                rx.buffered or not self._active
                                and time.monotonic() - self._last_active >= IDLE_S)):
                            break
                finally:
                    self._unlead()
        except BaseException as exc:
            self._fail(exc)

    def _frame(self) -> None:
        """Read one frame and handle it (the leader only)."""
        ftype, req, length = self.rx.header()
        if ftype == F_DATA:
            self._recv_data(req, length)
            return
        payload = self.rx.exact(length)
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
        elif ftype in (F_LEASE, F_READ, F_PING):
            self._enqueue(ftype, req, payload)
        elif ftype == F_LEASE_WRITE:
            self._answer(req, serve_small_write(self.owner, self._grant_small, self.rx, req,
                                                payload))
        elif ftype == F_WRITE:
            self._serve_write(req, payload)
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

    def _enqueue(self, ftype: int, req: int, payload: bytes | bytearray | int) -> None:
        """Queue work for the worker: at most MAX_JOBS requests of the peer and MAX_QUEUED_BYTES
        wait; a peer sending more (one that does not read our answers) loses its connection.
        Answers already prepared (small replies waiting for the send side) count in the bytes
        only, each as at least ANSWER_CHARGE: a peer that reads, only late, may have many small
        requests in flight, and one that never reads is still cut off."""
        jobs, size = _charge(ftype, payload)
        with self._lock:
            if (self._queued_jobs + jobs > MAX_JOBS
                    or self._queued_bytes + size > MAX_QUEUED_BYTES):
                raise ProtocolError(f"too many queued requests ({self._queued_jobs}, "
                                    f"{self._queued_bytes} bytes)")
            self._queued_jobs += jobs
            self._queued_bytes += size
            self._jobs.append((ftype, req, payload))
            self._jobs_cv.notify()

    def _recv_data(self, req: int, length: int) -> None:
        """DATA for a pending READ: into its sink (unless its caller gave up)."""
        with self._lock:
            p = self._pending.get(req)
        if p is None or p.sink is None:
            raise ProtocolError("DATA without a pending read")
        if p.done and not p.failed:
            raise ProtocolError("DATA after the request's DONE")
        with self._sink_lock:
            if p.cancelled:
                self.rx.discard(length)
            else:
                p.sink.recv(self.rx, length)

    def _serve_write(self, req: int, payload: bytes) -> None:
        self._enqueue(F_DONE, req, serve_write(self.leases, self.owner, self.rx, req, payload))

    def _grant_resolving_owner(self, _owner: object, served: Mapping[int, ServedCache],
                               cache_id: int) -> tuple[int, ServedCache | None]:
        return self.leases.grant_small(self.owner, served, cache_id)

    def _grant_small(self, cache_id: int) -> tuple[int, ServedCache | None]:
        return self.leases.grant_small(self.owner, self.served, cache_id)

    # -- the worker thread ------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._jobs:
                        self._jobs_cv.wait()
                    job = self._jobs.popleft()
                    if job is not None and job[0] > 0:
                        jobs, size = _charge(job[0], job[2])
                        self._queued_jobs -= jobs
                        self._queued_bytes -= size
                if job is None:
                    return
                ftype, req, payload = job
                if isinstance(payload, int):  # F_DONE of a WRITE
                    self._send(F_DONE, req, struct.pack("<I", payload))
                elif ftype == F_LEASE:
                    self._send(F_LEASE_REPLY, req, self.leases.grant(
                        self.owner, self.served, bytes(payload), self.peer_wait_ms))
                elif ftype == F_READ:
                    self._serve_read(req, payload)
                elif ftype == F_LEASE_READ:
                    self._send_raw(serve_small_read(self.owner, self._grant_small, req,
                                                    bytes(payload)))
                elif ftype in (_J_REPLY, _J_SEND):
                    self._send_raw(payload)
                elif ftype == _J_FLUSH:
                    self._send_raw(b"")
                elif ftype == F_PING:
                    self._send(F_PONG, req, b"")
                elif ftype == _J_CLOSE:
                    try:
                        with self.send_lock:
                            self._flush_tail()
                            if req:
                                self.sock.sendall(frame(F_GOODBYE, 0))
                            self.sock.shutdown(socket.SHUT_WR)
                    finally:
                        self._closed_wr.set()
                    return  # the receiver drains until the peer closes too
        except OSError as exc:  # the connection ends; the owner's leases are dropped on its end
            logger.debug("kvdd fabric %s: send failed: %s", self.label, exc)
            self.kill()
        except Exception:  # a bug: log it; the connection ends (transfers get LLM_TIMEOUT)
            logger.exception("kvdd fabric %s: worker failed", self.label)
            self.kill()

    def _send(self, ftype: int, req: int, payload: bytes | bytearray) -> None:
        self._send_raw(frame(ftype, req, payload))

    def _send_raw(self, data: bytes | bytearray) -> None:
        with self.send_lock:
            self._flush_tail()
            if data:
                self.sock.sendall(data)

    def _flush_tail(self) -> None:
        """Send the rest of a frame a leader began (call with send_lock held)."""
        tail, self._tail = self._tail, None
        if tail:
            self.sock.sendall(tail)

    def _answer(self, req: int, data: bytes) -> None:
        """A leader's answer to a small request, never blocking: a non-blocking send when no
        other thread is sending; what does not fit is the worker's (counted in the queue
        bounds, so a peer that does not read its answers loses its connection)."""
        if self.send_lock.acquire(False):
            try:
                if self._tail is None:
                    try:
                        sent = self.sock.send(data, _DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    if sent == len(data):
                        return
                    if sent:  # nobody may send before the rest of this frame
                        self._tail = data[sent:]
                        self._enqueue(_J_FLUSH, req, self._tail)
                        return
            finally:
                self.send_lock.release()
        self._enqueue(_J_REPLY, req, data)

    def _serve_read(self, req: int, payload: bytes | bytearray) -> None:
        with self.send_lock:
            self._flush_tail()
            serve_read(self.leases, self.owner, self.sock, req, payload)

    # -- requests of this end -----------------------------------------------------------------------
    def send_oneway(self, ftype: int, payload: bytes) -> None:
        """A frame with no reply (RELEASE, CLOSE_HANDLE), sent by the worker thread: the caller
        never waits behind a long transfer the worker is sending in the other direction (a
        RELEASE that comes late only keeps a lease until it arrives or expires)."""
        if self.dead.is_set():
            return
        with self._lock:
            if not self._closing:
                self._jobs.append((_J_SEND, 0, frame(ftype, 0, payload)))
                self._jobs_cv.notify()
