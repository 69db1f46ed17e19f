"""One link's TCP connection: the owner's leases, serving the peer's requests, this end's requests.

Both ends run the same :class:`Channel`: a reader thread (parses every frame, receives DATA into
memory directly), a worker thread (answers requests, sends READ data) and the callers' threads
(send requests, wait for the reply with the deadline ``llm.SyncKvCacheWaitTime``).  On the comm
backend the connection serves both directions (the acceptor's entity for the initiator uses it
too); on hixl only the initiator has an entity.

Leases (SEMANTICS.md §10 rule 5 across processes): a transfer first asks the owner for a lease on
the remote cache; the owner checks the cache is still registered (else LLM_KV_CACHE_NOT_EXIST) and
counts it in the entry's in-flight count, so unregister / unlink / finalize wait for it.  A lease
ends when the reader releases it, when the reader's connection closes (a dead reader releases at
once), or when it expires: ``SyncKvCacheWaitTime`` of the reader (announced in the handshake,
capped by the owner) plus a grace; if the owner's server is still moving bytes for it then, the
connection is closed.  The reader never touches remote memory past its own deadline, which is
earlier.

Small transfers (at most SMALL_BYTES in SMALL_MAX_RUNS tensors x runs) take one round trip: a
LEASE_READ / LEASE_WRITE names the cache instead of a lease, and the owner's reader thread serves
it inline: the same checks and statuses as LEASE then READ / WRITE, the cache held (counted in
flight) only around the copy out of (into) it, so that lease covers exactly this one transfer.
The reader never blocks on sending: it answers with a non-blocking send when the connection is
free, else the rest goes to the worker (counted in the queue bounds) and whoever sends next on
the connection sends it first (``_tail``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ...status import NOT_EXIST, S_OK, TIMEOUT, Status
from .. import faults
from .protocol import LinkOwner, ServedCache
from .leases import Lease
from .logutil import warn_limited
from .serving import RunPlan, check_request
from .small import serve_small_read, serve_small_write
from .streams import Cursor, Layout, send_stream
from .watchdog import WATCHDOG
from .wire import (CLOSE_LINGER_S, F_CLOSE_HANDLE, F_DATA, F_DONE, F_GOODBYE, F_LEASE,
                   F_LEASE_READ, F_LEASE_REPLY, F_LEASE_WRITE, F_PING, F_PONG, F_READ, F_RELEASE, F_WRITE, LEASE_GRACE_MS,
                   MAX_JOBS, MAX_LEASE_MS, MAX_LEASES, MAX_QUEUED_BYTES, ProtocolError, Reader,
                   decode_request, discard, frame, read_header, recv_exact)

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Pending", "take_endpoint", "close_channels", "close_endpoint"]


MAX_DISCARD = 1 << 40  # bytes of a refused WRITE read and dropped before the connection is closed
MAX_REVOKED = 256  # revoked lease ids remembered per connection
_J_SEND = -1  # worker job: send this end's own frame (RELEASE, CLOSE_HANDLE)
_J_CLOSE = -2  # worker job: (GOODBYE and) FIN, after every frame queued before
_J_REPLY = 101  # worker job: send an answer the reader prepared (counted in the queue bounds)
_J_FLUSH = 102  # worker job: send the rest of an answer the reader began (``_tail``)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)

class Pending:
    __slots__ = ("req", "event", "lock", "reply", "cursor", "cancelled", "failed")

    def __init__(self, req: int, cursor: Cursor | None) -> None:
        self.req = req
        self.event = threading.Event()
        self.lock = threading.Lock()  # held by the reader while it writes into the caller's memory
        self.reply: bytes | None = None
        self.cursor = cursor
        self.cancelled = False
        self.failed = False


_endpoint_lock = threading.Lock()
_endpoints: weakref.WeakKeyDictionary[LinkOwner, set[Channel]] = weakref.WeakKeyDictionary()


def take_endpoint(owner: LinkOwner) -> list[Channel]:
    """Finalize, first half: the connections of ``owner`` (to close once its caches are retired;
    until then they keep serving lease releases)."""
    with _endpoint_lock:
        return list(_endpoints.pop(owner, ()))


def close_channels(chans: Sequence[Channel]) -> None:
    """Finalize, second half: tell every connected peer (GOODBYE) and close the connections."""
    for chan in chans:
        chan.close(goodbye=True)


def close_endpoint(owner: LinkOwner) -> None:
    """GOODBYE to every peer connected to ``owner`` and close those connections."""
    close_channels(take_endpoint(owner))


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
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._jobs: deque[tuple[int, int, bytes | bytearray | int] | None] = deque()
        self._jobs_cv = threading.Condition(self._lock)
        self._queued_jobs = 0  # the peer's requests waiting for the worker
        self._queued_bytes = 0
        self._revoked: set[int] = set()  # lease ids revoked by an unregister (answered NOT_EXIST)
        self._revoked_order: deque[int] = deque()
        self._tail: bytes | None = None  # the unsent rest of a frame (under send_lock)
        self._closing = False
        self._closed_wr = threading.Event()  # the worker sent FIN (after GOODBYE, if asked)
        self.dead = threading.Event()
        self.peer_finalized = False
        self.local_user = False  # our PeerHandle on the peer uses this connection
        self.peer_user = False  # the peer's PeerHandle on us uses it
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.sock.settimeout(None)
        with _endpoint_lock:
            _endpoints.setdefault(self.owner, set()).add(self)
        self._started = True
        threading.Thread(target=self._reader, name=f"kvdd-sim-rx {self.label}", daemon=True).start()
        threading.Thread(target=self._worker, name=f"kvdd-sim-tx {self.label}", daemon=True).start()

    def kill(self) -> None:
        """Abort the connection (errors, deadlines): both directions stop at once."""
        with contextlib.suppress(OSError):  # already closed: nothing to abort
            self.sock.shutdown(socket.SHUT_RDWR)
        if not self._started:
            self._on_dead()

    def close(self, goodbye: bool = False) -> None:
        """Close gracefully: optional GOODBYE, then FIN; the reader drains until the peer closes
        (at most CLOSE_LINGER_S)."""
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

    def _peer_released(self) -> None:
        with self._lock:
            self.peer_user = False
            unused = not self.local_user
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            lease.drop()
        if unused:
            self.close()

    def _on_dead(self) -> None:
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
            leases = list(self._leases.values())
            self._leases.clear()
            pending = list(self._pending.values())
            self._jobs.clear()
            self._jobs.append(None)
            self._jobs_cv.notify_all()
        for lease in leases:  # a dead reader releases its leases at once
            lease.drop()
        for p in pending:
            p.failed = True
            p.event.set()
        self._closed_wr.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked in send
        with contextlib.suppress(OSError):
            self.sock.close()
        with _endpoint_lock:
            chans = _endpoints.get(self.owner)
            if chans is not None:
                chans.discard(self)

    # -- the reader thread ------------------------------------------------------------------------
    def _reader(self) -> None:
        sock = self.sock
        try:
            while True:
                ftype, req, length = read_header(sock)
                if ftype == F_DATA:
                    self._recv_data(req, length)
                    continue
                payload = recv_exact(sock, length)
                if ftype in (F_LEASE_REPLY, F_DONE, F_PONG):
                    with self._lock:
                        p = self._pending.get(req)
                    if p is not None:
                        p.reply = bytes(payload)
                        p.event.set()
                elif ftype in (F_LEASE, F_READ, F_PING):
                    self._enqueue(ftype, req, payload)
                elif ftype == F_LEASE_READ:
                    if any(inj.serve for inj in faults.active()):  # a slow server: worker's job
                        self._enqueue(ftype, req, payload)
                    else:
                        self._answer(req, serve_small_read(self.owner, self._grant_small, req, payload))
                elif ftype == F_LEASE_WRITE:
                    self._answer(req, serve_small_write(self.owner, self._grant_small, self.sock, req,
                                                         payload))
                elif ftype == F_WRITE:
                    self._serve_write(req, payload)
                elif ftype == F_RELEASE:
                    lease_id = Reader(payload).u("Q")
                    lease = self.forget_lease(lease_id)
                    if lease is not None:
                        lease.drop()
                elif ftype == F_CLOSE_HANDLE:
                    self._peer_released()
                elif ftype == F_GOODBYE:
                    # The peer finalized: it serves nothing more.  Our handle on it (a stale
                    # entity) now finds no cache (§10 rule 2); requests in flight end now.
                    self.peer_finalized = True
                    self._peer_released()
                    return
                else:
                    raise ProtocolError(f"unexpected frame type {ftype} on a link")
        except OSError as exc:  # the peer closed or died, or we closed
            logger.debug("kvdd fabric %s: connection ends: %s", self.label, exc)
        except (ProtocolError, struct.error) as exc:  # an authenticated peer broke the protocol
            warn_limited(logger, "protocol", "kvdd fabric %s: closing the link: %s", self.label, exc)
        except Exception:  # a bug: log it; the connection ends and transfers get LLM_TIMEOUT
            logger.exception("kvdd fabric %s: reader failed", self.label)
        finally:
            self._on_dead()

    def _enqueue(self, ftype: int, req: int, payload: bytes | bytearray | int) -> None:
        """Queue a request of the peer for the worker: at most MAX_JOBS requests and
        MAX_QUEUED_BYTES of their payloads wait; a peer sending more (one that does not read our
        answers) loses its connection."""
        size = 0 if isinstance(payload, int) else len(payload)
        with self._lock:
            if self._queued_jobs >= MAX_JOBS or self._queued_bytes + size > MAX_QUEUED_BYTES:
                raise ProtocolError(f"too many queued requests ({self._queued_jobs}, "
                                    f"{self._queued_bytes} bytes)")
            self._queued_jobs += 1
            self._queued_bytes += size
            self._jobs.append((ftype, req, payload))
            self._jobs_cv.notify()

    def _recv_data(self, req: int, length: int) -> None:
        """DATA for our pending READ: straight into the caller's memory (unless it gave up)."""
        with self._lock:
            p = self._pending.get(req)
        if p is None or p.cursor is None:
            raise ProtocolError("DATA without a pending read")
        with p.lock:
            if p.cancelled:
                discard(self.sock, length)
            else:
                p.cursor.recv(self.sock, length)

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None:
        with self._lock:
            if revoked and lease_id in self._leases:
                self._revoked.add(lease_id)
                self._revoked_order.append(lease_id)
                if len(self._revoked_order) > MAX_REVOKED:
                    self._revoked.discard(self._revoked_order.popleft())
            return self._leases.pop(lease_id, None)

    def _check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                    length: np.ndarray) -> tuple[int, Lease | None]:
        """The server's checks of a READ/WRITE: a live lease of this connection on a visible,
        registered cache, tensors and byte ranges inside it (kvdd rule 1), within MAX_RUNS."""
        with self._lock:
            lease = self._leases.get(lease_id)
            revoked = lease_id in self._revoked
        if lease is None or not lease.use():
            # revoked: the owner unregistered the cache while the lease sat unused (§10 rule 5);
            # otherwise only an expired (or forged) lease gets here
            return (NOT_EXIST if revoked else TIMEOUT), None
        entry = lease.entry
        status = check_request(entry.n, entry.T, tensors, off, length)
        if status != S_OK:
            lease.unuse()
            return status, None
        return S_OK, lease

    def _serve_write(self, req: int, payload: bytes | bytearray) -> None:
        """A WRITE and its DATA frames, received by the reader straight into the owner's cache.

        A WRITE refused for its lease (revoked, expired) has its DATA discarded and is answered
        with the status; one refused for its runs or size ends the connection (a correct peer
        never sends one: its engine ran the same checks)."""
        lease_id, tensors, off, length = decode_request(payload)
        status, lease = self._check_runs(lease_id, tensors, off, length)
        if lease is None:
            if status == Status.LLM_PARAM_INVALID or np.any(length < 0):
                raise ProtocolError(f"refused WRITE (status {status:#x})")
            total = int(length.sum()) * len(tensors)
            if total > MAX_DISCARD:
                raise ProtocolError("refused WRITE of too many bytes")
            while total > 0:  # the peer sends the data anyway: read it into nothing
                ftype, freq, n = read_header(self.sock)
                if ftype != F_DATA or freq != req or n > total:
                    raise ProtocolError("WRITE data expected")
                discard(self.sock, n)
                total -= n
            self._enqueue(F_DONE, req, status)
            return
        try:
            plan = RunPlan(lease.entry.regions, tensors, off, length)
            faults.on_serve(self.owner, "write", plan.total)
            plan.receive(self.sock, req, read_header)
        finally:
            lease.unuse()
        self._enqueue(F_DONE, req, status)

    # -- the worker thread ------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._jobs:
                        self._jobs_cv.wait()
                    job = self._jobs.popleft()
                    if job is not None and job[0] > 0:
                        self._queued_jobs -= 1
                        self._queued_bytes -= 0 if isinstance(job[2], int) else len(job[2])
                if job is None:
                    return
                ftype, req, payload = job
                if ftype == F_LEASE:
                    assert not isinstance(payload, int)
                    self._send(F_LEASE_REPLY, req, self._serve_lease(payload))
                elif ftype == F_READ:
                    assert not isinstance(payload, int)
                    self._serve_read(req, payload)
                elif ftype == F_LEASE_READ:
                    assert not isinstance(payload, int)
                    self._send_raw(serve_small_read(self.owner, self._grant_small, req, payload))
                elif ftype in (_J_REPLY, _J_SEND):
                    assert not isinstance(payload, int)
                    self._send_raw(payload)
                elif ftype == _J_FLUSH:
                    self._send_raw(b"")
                elif ftype == F_DONE:
                    assert isinstance(payload, int)
                    self._send(F_DONE, req, struct.pack("<I", payload))
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
                    return  # the reader drains until the peer closes too
        except OSError as exc:  # the connection ends; the owner's leases are dropped by the reader
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
        """Send the rest of a frame the reader began (call with send_lock held)."""
        tail, self._tail = self._tail, None
        if tail:
            self.sock.sendall(tail)

    def _answer(self, req: int, data: bytes) -> None:
        """The reader's answer to a small request, never blocking: a non-blocking send when no
        other thread is sending; what does not fit is the worker's (counted in the queue
        bounds, so a peer that does not read its answers loses its connection)."""
        if self.send_lock.acquire(blocking=False):
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

    def _serve_lease(self, payload: bytes | bytearray) -> bytes:
        r = Reader(payload)
        cache_id = r.u("Q")
        r.end()
        owner = self.owner
        faults.on_serve(owner, "lease")  # serve=1 fault injections: a slow server
        entry = self.served.get(cache_id)
        if not owner.initialized or entry is None:  # finalized, or not visible over this link
            return struct.pack("<IQ", NOT_EXIST, 0)
        with self._lock:
            if len(self._leases) >= MAX_LEASES:
                return struct.pack("<IQ", Status.LLM_FAILED, 0)
        if not entry.acquire():  # unregistered (§10 rule 2)
            return struct.pack("<IQ", NOT_EXIST, 0)
        lease = Lease(next(self._lease_ids), entry, self)
        with self._lock:
            if self.dead.is_set():
                lease.drop()
                return struct.pack("<IQ", TIMEOUT, 0)
            self._leases[lease.lease_id] = lease
        ms = min(self.peer_wait_ms, MAX_LEASE_MS) + LEASE_GRACE_MS
        lease.timer = WATCHDOG.schedule(ms / 1000.0, lease.expire)
        revoke = lease.revoke_soon  # an unregister revokes the lease (after a grace)
        if not entry.add_drain(revoke):  # unregistered meanwhile
            revoke()
        else:
            with lease.lock:
                keep = not lease.dropped
                if keep:
                    lease.unwatch = functools.partial(entry.remove_drain, revoke)
            if not keep:  # dropped meanwhile (released, expired, connection died)
                entry.remove_drain(revoke)
        return struct.pack("<IQ", S_OK, lease.lease_id)

    def _serve_read(self, req: int, payload: bytes | bytearray) -> None:
        lease_id, tensors, off, length = decode_request(payload)
        status, lease = self._check_runs(lease_id, tensors, off, length)
        if lease is None:
            self._send(F_DONE, req, struct.pack("<I", status))
            return
        try:
            plan = RunPlan(lease.entry.regions, tensors, off, length)
            faults.on_serve(self.owner, "read", plan.total)
            with self.send_lock:
                self._flush_tail()
                plan.send(self.sock, req)
                self.sock.sendall(frame(F_DONE, req, struct.pack("<I", S_OK)))
        finally:
            lease.unuse()

    def _grant_small(self, cache_id: int) -> tuple[int, ServedCache | None]:
        """The lease checks of a LEASE_READ / LEASE_WRITE, in the order and with the statuses of
        a LEASE: ``(S_OK, entry)`` with the entry acquired (release it after the copy)."""
        entry = self.served.get(cache_id)
        if not self.owner.initialized or entry is None:  # finalized, or not visible here
            return NOT_EXIST, None
        with self._lock:
            if len(self._leases) >= MAX_LEASES:
                return Status.LLM_FAILED, None
        if not entry.acquire():  # unregistered (§10 rule 2)
            return NOT_EXIST, None
        return S_OK, entry

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

    def request(self, ftype: int, payload: bytes, deadline: float,
                cursor: Cursor | None = None, data: Layout | None = None) -> bytes | None:
        """Send a request (and WRITE data) and wait for its reply until ``deadline``.

        None when the peer did not answer in time (the connection is then closed: the link is
        broken) or the connection died."""
        if self.dead.is_set():
            return None
        req = next(self._req_ids) & 0xFFFFFFFF
        p = Pending(req, cursor)
        with self._lock:
            self._pending[req] = p
        try:
            left = deadline - time.monotonic()
            if left <= 0 or not self.send_lock.acquire(timeout=left):
                return None
            guard = WATCHDOG.schedule(deadline - time.monotonic(), self.kill)
            try:
                self._flush_tail()
                self.sock.sendall(frame(ftype, req, payload))
                if data is not None:
                    send_stream(self.sock, req, data)
            except OSError:
                self.kill()
                return None
            finally:
                WATCHDOG.cancel(guard)
                self.send_lock.release()
            if not p.event.wait(max(deadline - time.monotonic(), 0.0)):
                self.kill()  # silent peer: the link is broken; stop the reader touching our memory
                with p.lock:
                    p.cancelled = True
                return None
            if p.failed:
                with p.lock:
                    p.cancelled = True
                return None
            return p.reply
        finally:
            with self._lock:
                self._pending.pop(req, None)

