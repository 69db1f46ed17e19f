"""The registered caches of one simulated instance (SEMANTICS.md §3.7, §3.8, §10 rules 3 and 5).

A :class:`CacheTable` hands out cache ids, keeps the cache table peers read (the last one that fit
1 MiB, §3.7 step 10), and lets any number of callers unregister a cache while transfers hold it
(§10 rule 5).  It shares its instance's lock; :class:`kvdd.sim.engine.SimBackend` owns one per
Initialize.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from ..status import FAILED, PARAM_INVALID, S_OK
from ..types import CacheDesc
from . import faults
from .checks import CACHE_TABLE_LIMIT, reject
from .entries import CacheEntry
from .fabric import RemoteCache
from .memory import first_inaccessible

__all__ = ["CacheTable", "Registrant"]


class Registrant(faults.hooks.FaultTarget, Protocol):
    """The instance registering a cache (the fault hook's target; it explains its failures)."""

    def last_error_detail(self) -> str | None: ...


class CacheTable:
    """The caches of one instance: ``caches`` (registered now), ``published`` (what peers read)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock  # the instance's lock
        self.next_cache_id = 1
        self.caches: dict[int, CacheEntry] = {}  # never rebound: the engine aliases it
        # §3.7 step 10: the cache table peers read, i.e. the last one that fit 1 MiB
        self.published: dict[int, CacheEntry] = {}
        self.retiring: dict[int, CacheEntry] = {}  # unregistering now (later callers wait too)
        # CANN's Python package (docs/spec/PYPKG.md §4.0, §4.1): key identity -> (cache id, batch
        # position); the req map is published with the entries, the prefix map never
        self.req_keys: dict[tuple[int, int], tuple[int, int]] = {}
        self.prefix_keys: dict[tuple[int, int], tuple[int, int]] = {}

    def register(self, cache_desc: CacheDesc, addrs: Sequence[int], owner: Registrant) -> int:
        """§3.7 steps 2-10 (the caller holds the lock and checked step 1): the new cache id."""
        if len(addrs) == 0:  # 2
            reject(PARAM_INVALID, "addrs is empty")
        if len(addrs) != cache_desc.num_tensors:  # 3
            reject(PARAM_INVALID, f"{len(addrs)} addrs but num_tensors={cache_desc.num_tensors}")
        for i, a in enumerate(addrs):  # 4
            if a == 0:
                reject(PARAM_INVALID, f"addrs[{i}] is 0")
        shape = cache_desc.shape  # 6
        if len(shape) == 0 or len(shape) >= 32:
            reject(PARAM_INVALID, f"shape must have 1..31 dims, has {len(shape)}")
        cache_id = self.next_cache_id  # 7: the id is consumed from here on
        self.next_cache_id += 1
        try:  # 8
            T = cache_desc.tensor_nbytes
        except ValueError as exc:
            reject(PARAM_INVALID, f"cannot size the tensors: {exc}")
        bad = first_inaccessible(addrs, T)  # 9 (kvdd rule 4)
        if bad >= 0:
            reject(FAILED, f"tensor {bad} at 0x{addrs[bad]:x} ({T} bytes) is not readable "
                   "and writable memory of this process")
        status = faults.on_register(owner)  # in place of the transport registration
        if status != S_OK:
            reject(status, owner.last_error_detail() or "the transport refused the registration")
        owners = tuple(getattr(addrs, "owners", ()))
        entry = CacheEntry(cache_id, len(addrs), T, shape[0] & 0xFFFFFFFF,
                           int(cache_desc.placement), addrs, owners)
        self.caches[cache_id] = entry  # 10
        table = self.publish()
        if table > CACHE_TABLE_LIMIT:
            reject(PARAM_INVALID, f"cache table would be {table} bytes (> 1 MiB); the cache stays "
                   "registered as upstream, but peers keep reading the last table that fit")
        return cache_id

    def take_id(self) -> int:
        """Consume the next cache id (the caller holds the lock): PYPKG.md §4.1 step 3."""
        cache_id = self.next_cache_id
        self.next_cache_id += 1
        return cache_id

    def insert(self, entry: CacheEntry, publish: bool = True) -> int:
        """Add an entry registered through CANN's Python package (the caller holds the lock and
        indexed its keys) and re-publish the table when ``publish``: PYPKG.md §4.1 step 7.
        Returns the table's size in bytes (0 when not published)."""
        self.caches[entry.cache_id] = entry
        return self.publish() if publish else 0

    def publish(self) -> int:
        """§3.7 step 10: re-serialize the cache table; peers read it only when it fits 1 MiB
        (else they keep the last one that fit).  Returns its size in bytes."""
        table = 24 + sum(64 + 8 * e.n + 24 * len(e.keys) for e in self.caches.values())
        if table <= CACHE_TABLE_LIMIT:
            self.published = dict(self.caches)
        return table

    def take(self, cache_id: int) -> CacheEntry | None:
        """§3.8 under the lock: stop offering ``cache_id`` (re-publishing the table) and return it,
        or the entry another thread is unregistering right now (to wait as it does), or None."""
        with self.lock:
            entry = self.caches.pop(cache_id, None)
            if entry is None:
                return self.retiring.get(cache_id)
            self.retiring[cache_id] = entry
            self.publish()
            return entry

    def retire(self, cache_id: int, entry: CacheEntry) -> None:
        """§3.8 without the lock: wait until no transfer holds ``entry`` (§10 rule 5)."""
        entry.retire()
        with self.lock:
            if self.retiring.get(cache_id) is entry:
                del self.retiring[cache_id]

    def all_entries(self) -> list[CacheEntry]:
        """Every cache still to retire at Finalize: registered and being unregistered."""
        with self.lock:
            return list(self.caches.values()) + list(self.retiring.values())

    def snapshot(self) -> tuple[dict[int, RemoteCache], dict[int, CacheEntry]]:
        """The caches a peer linking now may use: registered before the link (§10 rule 3), in the
        last cache table that fit 1 MiB (§3.7 step 10).  A cache registered with
        ``remote_accessible=False`` (CANN's Python package, PYPKG.md §4.1 step 5) is listed in the
        views but never served: the fabric cannot lease it to any peer."""
        with self.lock:
            entries = dict(self.published)
            views = {cid: e.remote_view() for cid, e in entries.items()}
        served = {cid: e for cid, e in entries.items() if e.remote_accessible}
        return views, served
