"""The owner's record of a peer's lease on one of its caches (SEMANTICS.md §10 rule 5).

A lease counts one in-flight transfer on the cache entry (``ServedCache.acquire``), so unregister,
unlink and finalize wait for it.  It ends when the reader releases it, when the reader's
connection dies, when it expires (the reader's own time limit, capped by the owner), or when the
owner unregisters the cache while no copy runs under it (revocation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from .protocol import ServedCache
from .watchdog import WATCHDOG, Timer

__all__ = ["Lease", "LeaseHolder", "REVOKE_GRACE_S"]

#: How long an unregistered cache's idle leases live on (a copy that starts in time completes).
REVOKE_GRACE_S = 1.0


class LeaseHolder(Protocol):
    """The connection a lease was granted on."""

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None: ...

    def kill(self) -> None: ...


class Lease:
    """The owner's record of a peer's lease on one of its caches."""

    __slots__ = ("lease_id", "entry", "chan", "users", "dropped", "released", "timer", "lock",
                 "unwatch")

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
        if fin:
            self.entry.release()

    def drop(self) -> None:
        with self.lock:
            if self.dropped:
                return
            self.dropped = True
            WATCHDOG.cancel(self.timer)
            fin = self.users == 0 and not self.released
            if fin:
                self.released = True
            unwatch, self.unwatch = self.unwatch, None
        if unwatch is not None:
            unwatch()
        if fin:
            self.entry.release()

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
        with self.lock:
            busy = self.users > 0
        self.chan.forget_lease(self.lease_id)
        self.drop()
        if busy:  # a server thread is still moving bytes: stop it, the memory may go away now
            self.chan.kill()
