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
inline with the same checks and statuses, the cache held only around the copy.
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
from collections.abc import Mapping, Sequence

from ..._native._small import serve_one_run
from ...status import PARAM_INVALID, S_OK, Status
from .. import faults
from ..faults import injections as _injections
from .endpoints import add_endpoint, close_channels, close_endpoint, discard_endpoint, take_endpoint
from .leases import Lease, LeaseTable
from .logutil import warn_limited
from .protocol import LinkOwner, ServedCache
from .rx import Goodbye, Pending, Rx, Sink, Stage
from .serving import serve_read, serve_write
from .small import encode_one_run, serve_small_read, serve_small_write
from .streams import Layout, send_stream
from .watchdog import WATCHDOG, DeadlineGuard
from .wire import (CLOSE_LINGER_S, F_CLOSE_HANDLE, F_DATA, F_DONE, F_GOODBYE, F_LEASE,
                   F_LEASE_READ, F_LEASE_REPLY, F_LEASE_WRITE, F_PING, F_PONG, F_READ, F_RELEASE,
                   F_WRITE, HDR, MAGIC, MAX_JOBS, MAX_QUEUED_BYTES, PROTOCOL_VERSION,
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
_LEASE_READ_1 = struct.Struct("<2sBBIIQIIIqq")  # a LEASE_READ frame of one tensor and one run
_ONE_RUN_LEN = _LEASE_READ_1.size - HDR.size  # its payload: encode_one_run's layout
assert len(encode_one_run(0, 0, 0, 0)) == _ONE_RUN_LEN
_RECEIVER = object()  # the leader token of the receiver thread


class Channel:
    """One end of a link's TCP connection: serves the peer's requests on ``owner``'s caches and
    carries this end's requests (see the module docstring)."""

    def __init__(self, sock: socket.socket, owner: LinkOwner, label: str) -> None:
        self.sock = sock
        self.owner = owner
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
        discard_endpoint(self.owner, self)

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
                    while True:
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
                if p is not None:
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
        requests in flight (review 2, F3), and one that never reads is still cut off."""
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
        with self._sink_lock:
            if p.cancelled:
                self.rx.discard(length)
            else:
                p.sink.recv(self.rx, length)

    def _serve_write(self, req: int, payload: bytes) -> None:
        self._enqueue(F_DONE, req, serve_write(self.leases, self.owner, self.rx, req, payload))

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

    def request(self, ftype: int, payload: bytes, deadline: float, sink: Sink | None = None,
                data: Layout | None = None) -> bytes | None:
        """Send a request (and WRITE data) and wait for its reply until ``deadline``, reading
        the socket itself when no other thread does (see the module docstring).

        None when the peer did not answer in time (the connection is then closed: the link is
        broken) or the connection died."""
        p = self._submit(ftype, payload, deadline, sink, data)
        if p is None:
            return None
        try:
            if not self._await(p, deadline):
                self.kill()  # silent peer: the link is broken; stop others touching our memory
            if p.sink is not None or p.failed or not p.done:
                with self._sink_lock:  # no DATA reaches the sink once we return (§10 rule 5)
                    p.cancelled = True
            if p.failed or not p.done:
                return None
            reply = p.reply
            assert not isinstance(reply, int)
            return reply
        finally:
            self._retire(p)

    def read_small(self, cache_id: int, tensor: int, off: int, stage: Stage,
                   deadline: float) -> int | None:
        """One LEASE_READ of ``stage.size`` bytes at ``off`` of tensor ``tensor`` of the peer's
        cache ``cache_id``, landing in ``stage``: the status DONE carried, or None as for
        :meth:`request`.  The caller leading the receive side takes its own DATA and DONE
        through the compiled :meth:`~.rx.Rx.small_reply`; anything else on the connection goes
        through :meth:`_frame` as always.  When the connection is free (nobody sending, nobody
        reading) the caller takes the lead as it registers the request, before sending it.  No
        DATA reaches ``stage`` once this returns (``stage`` is full when DONE arrives; more
        DATA breaks the protocol)."""
        if self.dead.is_set():
            return None
        lead = False
        if self.send_lock.acquire(False):  # the common case: one lock section, then send
            try:
                with self._lock:
                    self._req_ids = req = (self._req_ids + 1) & 0xFFFFFFFF
                    p = Pending(req, deadline, stage)
                    self._pending[req] = p
                    self._active += 1
                    if self._leader is None and self._started:  # reading may begin
                        self._leader = p
                        lead = True
                guard = self._guard
                if guard.armed_until is None or guard.armed_until > deadline:
                    guard.arm(deadline)
                try:
                    if self._tail is not None:
                        self._flush_tail()
                    self.sock.sendall(_LEASE_READ_1.pack(
                        MAGIC, PROTOCOL_VERSION, F_LEASE_READ, req, _ONE_RUN_LEN, cache_id, 1,
                        1, tensor, off, stage.size))
                except OSError:
                    self.kill()
                    self._end_small(p, lead)
                    return None
            finally:
                self.send_lock.release()
        else:
            q = self._submit(F_LEASE_READ, encode_one_run(cache_id, tensor, off, stage.size),
                             deadline, stage, None)
            if q is None:
                return None
            p = q
        try:
            if lead:  # as _lead, for this request's own answer
                rx = self.rx
                try:
                    while not p.done:
                        status = rx.small_reply(req, stage)
                        if status >= 0:
                            p.reply = status
                            p.done = True
                            break
                        self._frame()  # something else came first
                except BaseException as exc:
                    self._fail(exc)
                    if not isinstance(exc, Exception):
                        raise
            elif not self._await(p, deadline):
                self.kill()
            if p.failed or not p.done:
                with self._sink_lock:
                    p.cancelled = True
                return None
            reply = p.reply
            if isinstance(reply, int):
                return reply
            if reply is None or len(reply) != 4:  # a malformed DONE: the link is broken
                self.kill()
                return None
            return int.from_bytes(reply, "little")
        finally:
            self._end_small(p, lead)

    def _end_small(self, p: Pending, lead: bool) -> None:
        """:meth:`_unlead` (when ``lead``) and :meth:`_retire` in one lock section."""
        with self._lock:
            if lead:
                self._leader = None
                if self._waiters:
                    self._rx_cv.notify_all()
                if self.rx.buffered:
                    self._bg_cv.notify()
            self._pending.pop(p.req, None)
            self._active -= 1
            self._last_active = time.monotonic()

    def _submit(self, ftype: int, payload: bytes, deadline: float, sink: Sink | None,
                data: Layout | None) -> Pending | None:
        """Register a request and send it (and its WRITE data); None when it was not sent."""
        if self.dead.is_set():
            return None
        with self._lock:
            self._req_ids = req = (self._req_ids + 1) & 0xFFFFFFFF
            p = Pending(req, deadline, sink)
            self._pending[req] = p
            self._active += 1
        guard = self._guard
        if guard.armed_until is None or guard.armed_until > deadline:  # else no lock needed
            guard.arm(deadline)
        sent = False
        try:
            if not self.send_lock.acquire(False):
                left = deadline - time.monotonic()
                if left <= 0 or not self.send_lock.acquire(timeout=left):
                    return None
            try:
                self._flush_tail()
                self.sock.sendall(frame(ftype, req, payload))
                if data is not None:
                    send_stream(self.sock, req, data)
            except OSError:
                self.kill()
                return None
            finally:
                self.send_lock.release()
            sent = True
            return p
        finally:
            if not sent:
                self._retire(p)

    def _retire(self, p: Pending) -> None:
        with self._lock:
            self._pending.pop(p.req, None)
            self._active -= 1
            self._last_active = time.monotonic()

    def _waiting(self) -> list[float]:
        """The deadlines of the requests still waiting (for the guard)."""
        with self._lock:
            return [p.deadline for p in self._pending.values() if not p.done]

    def _await(self, p: Pending, deadline: float) -> bool:
        """Wait for ``p``'s reply, leading the receive side when nobody does; False when the
        deadline passed first."""
        if not self._running.is_set():  # an acceptor's handle used before its handshake ended
            self._running.wait(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            while not p.done:
                if self._leader is None:
                    self._leader = p
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._rx_cv.wait(left)
                finally:
                    self._waiters -= 1
            else:
                return True
        return self._lead(p)

    def _lead(self, p: Pending) -> bool:
        """Read frames as the leader until ``p``'s reply is in (or the connection fails)."""
        try:
            sink = p.sink
            if type(sink) is Stage:  # a small READ: its own DATA and DONE in compiled code
                rx = self.rx
                while not p.done:
                    status = rx.small_reply(p.req, sink)
                    if status >= 0:
                        p.reply = status
                        p.done = True
                        break
                    self._frame()  # something else came first
            while not p.done:
                self._frame()
        except BaseException as exc:
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._unlead()
        return True
