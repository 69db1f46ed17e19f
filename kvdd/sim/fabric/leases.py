"""The owner's record of a peer's lease on one of its caches (SEMANTICS.md §10 rule 5).

A lease counts one in-flight transfer on the cache entry (``ServedCache.acquire``), so unregister,
unlink and finalize wait for it.  It ends when the reader releases it, when the reader's
connection dies, when it expires (the reader's own time limit, capped by the owner), or when the
owner unregisters the cache while no copy runs under it (revocation).
"""

from __future__ import annotations

import functools
import itertools
import struct
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from ...status import NOT_EXIST, S_OK, TIMEOUT, Status
from .. import faults
from .protocol import LinkOwner, ServedCache
from .serving import check_request
from .watchdog import WATCHDOG, Timer
from .wire import LEASE_GRACE_MS, MAX_LEASE_MS, MAX_LEASES, Reader

__all__ = ["Lease", "LeaseHolder", "LeaseResolver", "LeaseTable", "Resolved", "REVOKE_GRACE_S",
           "MAX_REVOKED"]

MAX_REVOKED = 256  # revoked lease ids remembered per connection

#: How long an unregistered cache's idle leases live on (a copy that starts in time completes).
REVOKE_GRACE_S = 1.0


class LeaseHolder(Protocol):
    """The connection a lease was granted on."""

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None: ...

    def kill(self) -> None: ...


class Lease:
    """The owner's record of a peer's lease on one of its caches."""

    __slots__ = ("lease_id", "entry", "chan", "users", "dropped", "released", "timer", "lock",
                 "unwatch", "on_served")

    def __init__(self, lease_id: int, entry: ServedCache, chan: LeaseHolder) -> None:
        self.lease_id = lease_id
        self.entry = entry
        self.chan = chan
        self.users = 0  # server threads moving bytes under this lease right now
        self.dropped = False
        self.released = False
        self.timer: Timer | None = None
        self.lock = threading.Lock()
        self.unwatch: Callable[[], None] | None = None  # cancels the revocation on unregister
        # a resolved lease's owner action once a READ under it was served (see LeaseResolver)
        self.on_served: Callable[[list[int]], None] | None = None

    def use(self) -> bool:
        with self.lock:
            if self.dropped:
                return False
            self.users += 1
            return True

    def unuse(self) -> None:
        with self.lock:
            self.users -= 1
            fin = self.dropped and self.users == 0 and not self.released
            if fin:
                self.released = True
                WATCHDOG.cancel(self.timer)  # (kept by a drop during the copy)
        if fin:
            self.entry.release()

    def drop(self) -> bool:
        """No new copy under this lease; the cache is released now, or when the copy in
        progress ends.  A copy in progress stays bounded by the lease's expiry (which closes
        the connection): a revocation or a RELEASE does not stop that clock.  Returns whether
        a copy is in progress (read with the drop, under the lease's lock: none starts after)."""
        with self.lock:
            busy = self.users > 0
            # a second drop is a no-op without this too (released, unwatch cleared, timer gone
            # or still needed by the copy in progress)
            if self.dropped:  # mutation: equivalent(skip)
                return busy
            self.dropped = True
            if self.users == 0:
                WATCHDOG.cancel(self.timer)
            fin = self.users == 0 and not self.released
            if fin:
                self.released = True
            unwatch, self.unwatch = self.unwatch, None
        if unwatch is not None:
            unwatch()
        if fin:
            self.entry.release()
        return busy

    def revoke_soon(self) -> None:
        """The owner unregisters the cache: revoke this lease after REVOKE_GRACE_S (a reader
        that got its lease just before starts its copy within that time and is waited for)."""
        with self.lock:
            if self.dropped:
                return
        WATCHDOG.schedule(REVOKE_GRACE_S, self.revoke)

    def revoke(self) -> None:
        """The owner unregisters the cache: no new copy starts under this lease (the peer's
        READ/WRITE gets LLM_KV_CACHE_NOT_EXIST); a copy in progress is waited for (§10 rule 5)."""
        self.chan.forget_lease(self.lease_id, revoked=True)
        self.drop()

    def expire(self) -> None:
        self.chan.forget_lease(self.lease_id)
        # (whether a copy runs is read as the lease is dropped: a server thread that found the
        # lease before it was forgotten either started its copy before, and is stopped, or
        # finds it dropped)
        if self.drop():  # a server thread is still moving bytes: stop it, the memory may go
            self.chan.kill()  # away now


class LeaseResolver(Protocol):
    """An owner that resolves a lease from a request of its own format (a LEASE whose cache id is
    0 followed by that request): CANN's Python package's two-sided pulls (PYPKG.md §4.4), whose
    source the owner looks up live in its own maps and checks before granting anything."""

    def resolve_lease(self, request: bytes) -> Resolved: ...


#: What :meth:`LeaseResolver.resolve_lease` answers: ``(status, entry to lease or None, bytes
#: returned to the requester after the lease id, action once a READ under the lease was served
#: (called with its tensor indices before its DONE) or None)``.
Resolved = tuple[int, ServedCache | None, bytes, Callable[[list[int]], None] | None]


class LeaseTable:
    """The leases one connection's peer holds on the owner's caches (LEASE, READ / WRITE checks,
    the lease checks of a small request), bounded by MAX_LEASES."""

    def __init__(self, holder: LeaseHolder) -> None:
        self._holder = holder
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._revoked: set[int] = set()  # lease ids revoked by an unregister (answered NOT_EXIST)
        self._revoked_order: deque[int] = deque()
        self._by_request: dict[int, int] = {}  # LEASE request id -> its lease (a chained READ's)
        self._closed = False

    def forget(self, lease_id: int, revoked: bool = False) -> Lease | None:
        with self._lock:
            if revoked and lease_id in self._leases:
                self._revoked.add(lease_id)
                self._revoked_order.append(lease_id)
                if len(self._revoked_order) > MAX_REVOKED:
                    self._revoked.discard(self._revoked_order.popleft())
            return self._leases.pop(lease_id, None)

    def take_all(self, close: bool = False) -> list[Lease]:
        """Every lease, forgotten (to drop); ``close``: the connection died, grant no more."""
        with self._lock:
            self._closed = self._closed or close
            leases = list(self._leases.values())
            self._leases.clear()
        return leases

    def grant(self, owner: LinkOwner, served: Mapping[int, ServedCache], payload: bytes,
              peer_wait_ms: int, req: int) -> bytes:
        """A LEASE request's answer (status, lease id); a granted lease is remembered by its
        request id ``req`` for a READ that names it (:meth:`chained`)."""
        r = Reader(payload)
        cache_id = r.u("Q")
        extra = b""
        on_served: Callable[[list[int]], None] | None = None
        if cache_id == 0 and len(payload) > 8:  # a lease the owner resolves (LeaseResolver)
            faults.on_serve(owner, "lease")
            status, entry, extra, on_served = self._resolve(owner, bytes(r.take(len(payload) - 8)))
            if entry is None:
                return struct.pack("<IQ", status, 0) + extra
        else:
            r.end()
            faults.on_serve(owner, "lease")  # serve=1 fault injections: a slow server
            status, entry = self.grant_small(owner, served, cache_id)
            if entry is None:
                return struct.pack("<IQ", status, 0)
        lease = Lease(next(self._ids), entry, self._holder)
        lease.on_served = on_served
        with self._lock:
            if self._closed:
                lease.drop()
                return struct.pack("<IQ", TIMEOUT, 0)
            self._leases[lease.lease_id] = lease
            by_req = self._by_request
            if len(by_req) >= MAX_LEASES:  # bounded: the oldest names are forgotten
                del by_req[next(iter(by_req))]
            by_req[req] = lease.lease_id
        ms = min(peer_wait_ms, MAX_LEASE_MS) + LEASE_GRACE_MS
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
        return struct.pack("<IQ", S_OK, lease.lease_id) + extra

    def _resolve(self, owner: LinkOwner, request: bytes) -> Resolved:
        """A resolved lease's checks: the owner resolves it (an owner that cannot resolves
        nothing: LLM_KV_CACHE_NOT_EXIST), then the checks of :meth:`grant_small` on its entry."""
        resolve = getattr(owner, "resolve_lease", None)
        if not owner.initialized or resolve is None:
            return NOT_EXIST, None, b"", None
        status, entry, extra, on_served = resolve(request)
        # the resolver (kvdd.sim.pypkg.twosided.resolve) gives an entry exactly when its status
        # is S_OK, so "and" decides as "or" does
        if status != S_OK or entry is None:  # mutation: equivalent(or -> and)
            return (status if status != S_OK else NOT_EXIST), None, extra, None
        if len(self._leases) >= MAX_LEASES:
            return Status.LLM_FAILED, None, b"", None
        if not entry.acquire():  # unregistered meanwhile (§10 rule 2)
            return NOT_EXIST, None, b"", None
        return S_OK, entry, extra, on_served

    def grant_small(self, owner: LinkOwner, served: Mapping[int, ServedCache],
                    cache_id: int) -> tuple[int, ServedCache | None]:
        """The lease checks, in the order and with the statuses of a LEASE: ``(S_OK, entry)``
        with the entry acquired (release it after the copy)."""
        entry = served.get(cache_id)
        if not owner.initialized or entry is None:  # finalized, or not visible over this link
            return NOT_EXIST, None
        if len(self._leases) >= MAX_LEASES:
            return Status.LLM_FAILED, None
        if not entry.acquire():  # unregistered (§10 rule 2)
            return NOT_EXIST, None
        return S_OK, entry

    def chained(self, req: int) -> int:
        """The lease granted to LEASE request ``req`` of this connection (forgotten now), 0 when
        it was refused or is unknown."""
        with self._lock:
            return self._by_request.pop(req, 0)

    def check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                   length: np.ndarray) -> tuple[int, Lease | None]:
        """The checks of a READ/WRITE: a live lease of this connection on a visible, registered
        cache, tensors and byte ranges inside it (kvdd rule 1), within MAX_RUNS."""
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
