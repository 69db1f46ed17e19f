"""What the engine keeps per registered cache and per link (SEMANTICS.md §2.1, §2.3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .fabric import KIND_BLOCKS, KIND_MIX, PeerHandle, RemoteCache
from .memory import Region, RegionTable

__all__ = ["CacheEntry", "Entity", "retire_all"]

_NO_REGIONS = RegionTable(())  # what an unregistered entry keeps: no regions, no leases
_NO_REGIONS.close(threading.Event())


class _Unserved:
    """The token of a view on a cache registered with ``remote_accessible=False`` (CANN's Python
    package, PYPKG.md §4.1 step 5): listed in the peer's snapshot, never leased (no regions)."""

    __slots__ = ()
    table = _NO_REGIONS
    regions: list[Region] = []

    def acquire(self) -> bool:
        return False

    def release(self) -> None:  # pragma: no cover - never acquired
        pass


_UNSERVED = _Unserved()


class CacheEntry:
    """A registered cache on its owner (SEMANTICS.md §2.1).

    The C++ face registers MIX entries (``B = N = shape[0]``); CANN's Python package registers
    CACHE (``B = shape[0]``, ``N = 0``) or BLOCKS (``B = 1``, ``N = shape[0]``, ``S = T / N``)
    entries with a per-cache ``remote_accessible`` flag (docs/spec/PYPKG.md §4.1 step 6).
    ``keys`` are the ``(req_id, model_id, batch position)`` identities of the owner's key map
    that point at this entry now (published with it; PYPKG.md §4.1).
    """

    __slots__ = ("cache_id", "n", "T", "B", "S", "ragged", "placement", "addrs", "regions", "table",
                 "owners", "_lock", "registered", "_drains", "_drains_done", "kind", "N",
                 "remote_accessible", "keys", "_view")

    def __init__(self, cache_id: int, n: int, T: int, B: int, placement: int,
                 addrs: Sequence[int], owners: tuple[object, ...], kind: int = KIND_MIX,
                 num_blocks: int = 0, remote_accessible: bool = True) -> None:
        self.cache_id = cache_id
        self.n = n
        self.T = T
        self.B = B
        self.kind = kind
        self.N = num_blocks if kind == KIND_BLOCKS else (B if kind == KIND_MIX else 0)
        self.remote_accessible = remote_accessible
        self.keys: list[tuple[int, int, int]] = []
        rows = self.N if kind == KIND_BLOCKS else B
        self.S = T // rows if rows else 0
        self.ragged = self.S == 0 or T % self.S != 0
        self.placement = placement
        self.addrs = tuple(addrs)
        self.regions = [Region(a, T, owners) for a in self.addrs]
        self.table = RegionTable(self.regions)  # the same regions in C memory (kvdd.sim._fastpath)
        self.owners = owners
        self._lock = threading.Lock()  # registered and the drains
        self.registered = True
        self._drains: list[Callable[[], object]] = []  # one-sided readers' lease tables (fabric)
        self._drains_done: threading.Event | None = None  # set once retire() ran the drains
        self._view: RemoteCache | None = None  # remote_view() while ``keys`` is empty

    @property
    def inflight(self) -> int:
        """Transfers holding this cache right now (local and remote leases)."""
        return self.table.inflight

    def remote_view(self) -> RemoteCache:
        """What a peer linking now is told of this cache (every link's snapshot asks, for each
        cache: made once while no key points here, as every field but ``keys`` is fixed)."""
        if not self.keys:
            view = self._view
            if view is None:
                view = self._view = self._make_view()
            return view
        return self._make_view()

    def _make_view(self) -> RemoteCache:
        token: object = self if self.remote_accessible else _UNSERVED
        return RemoteCache(self.cache_id, self.n, self.T, self.B, self.S, self.ragged, token,
                           self.kind, self.N, self.remote_accessible, tuple(self.keys))

    # the lease count lives in the region table: changed in C with the GIL held (atomic without a
    # lock), which the compiled transfer path uses directly (kvdd.sim._fastpath)
    def acquire(self) -> bool:
        """Take a lease for a transfer; False once unregistered."""
        return self.table.acquire()

    def release(self) -> None:
        """End a lease taken by :meth:`acquire` (wakes an unregister waiting for the last one)."""
        self.table.release()

    def add_drain(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` when this cache is unregistered, after new leases are refused (one-sided
        same-host readers: revoke); when ``fn`` returns a callable, ``wait(start)``, it is called
        once every drain of the unregister ran, with the ``time.monotonic()`` of that moment, and
        waits (for those readers' copies, bounded from ``start``: one unregister waits one bound
        however many tables revoke); False once unregistered."""
        with self._lock:
            if not self.registered:
                return False
            self._drains.append(fn)
            return True

    def remove_drain(self, fn: Callable[[], object]) -> None:
        with self._lock:
            if fn in self._drains:
                self._drains.remove(fn)

    def retire(self, timeout: float | None = None) -> bool:
        """Unregister: refuse new leases, then wait for in-flight transfers (§10 rule 5).  Any
        number of callers may wait (a second unregister of the id waits as the first does).

        Returns False when ``timeout`` (seconds) passed with leases still held."""
        return retire_all([self], timeout)

    def _revoke(self) -> tuple[threading.Event, threading.Event, list[Callable[[], object]] | None]:
        """Refuse new leases; ``(leases drained, drains done, drains to run)``: the drains only
        for the first caller (None for later ones, which wait for the first's)."""
        with self._lock:
            self.registered = False
            self._view = None  # (it refers to this entry: no cycle outlives the registration)
            drained = self.table.close(threading.Event())
            first = self._drains_done is None
            drains_done = self._drains_done = self._drains_done or threading.Event()
            drains, self._drains = self._drains, []
        return drained, drains_done, (drains if first else None)


def retire_all(entries: Sequence[CacheEntry], timeout: float | None = None,
               between: Callable[[float], object] | None = None) -> bool:
    """Retire ``entries`` (:meth:`CacheEntry.retire`) together: every drain of every entry runs
    first (no new copy of a one-sided reader starts on any of them), then their waits, all from
    one start, so the whole call waits for readers at most one bound, not one per entry or table.

    Parameters
    ----------
    entries : sequence of CacheEntry
        The caches (unregister: one; finalize: all).
    timeout : float or None
        Seconds to wait for leases and for another caller's drains (None: until they end).
    between : callable or None
        Called with the common start once every drain revoked, before the waits (finalize
        closes its links there, their tables revoked before this call: one start for all).

    Returns
    -------
    bool
        False when ``timeout`` passed with leases held or another caller's drains running.
    """
    states = [e._revoke() for e in entries]
    waits: list[Callable[[float], object]] = []
    try:
        for _drained, _done, drains in states:
            for fn in drains or ():  # one-sided copies and idle remote leases: no new copy
                w = fn()
                if callable(w):
                    waits.append(w)
        start = time.monotonic()
        if between is not None:
            between(start)
        for w in waits:  # (each bounded from the common start)
            w(start)
    finally:
        for _drained, done, drains in states:
            if drains is not None:
                done.set()
    # every caller waits for the first one's drains (a same-host reader's copy they revoke may
    # still read the memory), then for the leases
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for entry, (drained, drains_done, _drains) in zip(entries, states):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not drains_done.wait(left):
            ok = False
            continue
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not drained.wait(left):
            ok = False
            continue
        entry.regions = []
        entry.table = _NO_REGIONS
    return ok


@dataclass
class Entity:
    """A link entity: this instance's handle on one peer (keyed per SEMANTICS.md §2.3)."""

    peer: PeerHandle
    address: tuple[str, int]
    lock: threading.Lock = field(default_factory=threading.Lock)  # per-link serialization
    broken: bool = False  # §10 rule 8: a transfer timed out
