"""Fair admission of connections a listener holds before they become links.

A listener keeps connections that have not authenticated yet, and authenticated ones still sending
their link or unlink hello, in tables of bounded size (:mod:`.listener`).  When a table is full, or
a source has its share, something must go; :class:`FairTable` chooses what, so that a flood of cheap
connections cannot keep a legitimate one out:

* the victim comes from the *sources with the most entries* (an address: IPv4, or the /64 of an
  IPv6 address, :func:`source_of`), or from the new entry's own source when that source is at its
  share, never from a source with fewer entries;
* among those sources, an entry that has not made progress yet (*idle*: for a connection not
  authenticated, one that has not sent a whole authentication hello; for an authenticated one, one
  that has not sent a byte of its link hello) goes before one that did, and the oldest goes first
  (idle entries by the time they were added, progressed ones by the time they progressed), across
  every source tied for the most entries: a flood from many addresses holding one entry each
  evicts its own idle entries, never a legitimate entry that progressed while one of them is idle.

A legitimate initiator sends each message as soon as it can, so it is idle for at most one round
trip, and it is evicted only by a flood that makes more connections progress as far as it did than
the table holds within that round trip (or, from its own address, than that source's share).
Every operation is O(log n): the sources are bucketed by their number of entries, and each bucket
keeps two heaps of its sources, by their oldest idle entry and by their oldest progressed one
(stale heap records are skipped when met and the heaps rebuilt when they hold mostly stale ones).
"""

from __future__ import annotations

import heapq
import ipaddress
from collections import OrderedDict
from collections.abc import Hashable
from itertools import count
from typing import Generic, TypeVar

__all__ = ["FairTable", "source_of"]

T = TypeVar("T", bound=Hashable)


def source_of(address: object) -> str:
    """The fairness source of a peer address (``accept``'s tuple): the IPv4 address, the /64 of an
    IPv6 address (an IPv4-mapped one counts as its IPv4 address), ``"local"`` otherwise."""
    if not isinstance(address, tuple) or not address:
        return "local"
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return str(address[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class _Group(Generic[T]):
    """The entries of one source: idle ones by the time they were added, progressed ones by the
    time they progressed (entry -> that time), oldest first."""

    __slots__ = ("idle", "busy")

    def __init__(self) -> None:
        self.idle: OrderedDict[T, int] = OrderedDict()
        self.busy: OrderedDict[T, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)

    def victim(self) -> T:
        return next(iter(self.idle or self.busy))

    def first(self, busy: bool) -> int | None:
        """The time of the oldest idle (or progressed) entry, None when there is none."""
        entries = self.busy if busy else self.idle
        return next(iter(entries.values()), None)


class _Bucket:
    """The sources holding one number of entries, with a heap of them by the time of their
    oldest idle entry and one by that of their oldest progressed entry (records ``(time,
    source)``; a record is stale once that source left the bucket or its oldest entry changed)."""

    __slots__ = ("sources", "heaps")

    def __init__(self) -> None:
        self.sources: set[str] = set()
        self.heaps: tuple[list[tuple[int, str]], list[tuple[int, str]]] = ([], [])


class FairTable(Generic[T]):
    """At most ``total`` entries in all and ``per_source`` per source (see the module docstring).

    Entries are kept in insertion order overall too (:meth:`oldest`), so a table whose entries
    share one time limit from insertion expires them front to back."""

    def __init__(self, total: int, per_source: int) -> None:
        if not 0 < per_source <= total:
            raise ValueError("need 0 < per_source <= total")
        self.total = total
        self.per_source = per_source
        self._order: OrderedDict[T, str] = OrderedDict()  # entry -> source, oldest first
        self._groups: dict[str, _Group[T]] = {}
        self._by_count: dict[int, _Bucket] = {}
        self._max = 0
        self._clock = count()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order

    def count(self, source: str) -> int:
        group = self._groups.get(source)
        return 0 if group is None else len(group)

    def largest(self) -> int:
        """The number of entries of the sources with the most."""
        return self._max

    def oldest(self) -> T | None:
        return next(iter(self._order), None)

    def items(self) -> list[T]:
        return list(self._order)

    # -- the buckets -------------------------------------------------------------------------------
    def _push(self, source: str, n: int, busy: bool) -> None:
        """Record ``source`` (holding ``n`` entries) in its bucket's heap of idle (or progressed)
        entries, by the time of its oldest one."""
        group = self._groups.get(source)
        first = None if group is None else group.first(busy)
        if first is None or not n:
            return
        bucket = self._by_count[n]
        heap = bucket.heaps[busy]
        heapq.heappush(heap, (first, source))
        if len(heap) > 4 * len(bucket.sources) + 32:  # mostly stale: rebuild it
            fresh = [(t, s) for s in bucket.sources
                     if (t := self._groups[s].first(busy)) is not None]
            heapq.heapify(fresh)
            bucket.heaps[busy][:] = fresh

    def _recount(self, source: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_count[old]
            bucket.sources.discard(source)
            if not bucket.sources:
                del self._by_count[old]
        if new:
            bucket = self._by_count.get(new) or self._by_count.setdefault(new, _Bucket())
            bucket.sources.add(source)
            self._push(source, new, False)
            self._push(source, new, True)
        if new > self._max:
            self._max = new
        while self._max and self._max not in self._by_count:
            self._max -= 1

    def _largest_victim(self) -> T:
        """The oldest idle entry of the sources with the most entries, else their oldest
        progressed one."""
        bucket = self._by_count[self._max]
        for busy in (False, True):
            heap = bucket.heaps[busy]
            while heap:
                first, source = heap[0]
                group = self._groups.get(source)
                if (source in bucket.sources and group is not None
                        and group.first(busy) == first):
                    return next(iter(group.busy if busy else group.idle))
                heapq.heappop(heap)  # stale
        raise AssertionError("a non-empty bucket without an entry")  # (never)

    # -- the table ---------------------------------------------------------------------------------
    def add(self, item: T, source: str) -> list[T]:
        """Insert ``item`` (idle) from ``source``; the entries evicted to make room (already
        removed: the caller closes them)."""
        evicted: list[T] = []
        if self.count(source) >= self.per_source:
            evicted.append(self._groups[source].victim())
            self.remove(evicted[-1])
        while len(self._order) >= self.total:
            evicted.append(self._largest_victim())
            self.remove(evicted[-1])
        group = self._groups.get(source)
        if group is None:
            group = self._groups[source] = _Group()
        n = len(group)
        group.idle[item] = next(self._clock)
        self._order[item] = source
        self._recount(source, n, n + 1)
        return evicted

    def progressed(self, item: T) -> None:
        """``item`` received bytes: it is no longer evicted before the idle entries (of its
        source, and of the sources as large)."""
        source = self._order.get(item)
        if source is None:
            return
        group = self._groups[source]
        if item not in group.idle:
            return
        n = len(group)
        was_first = group.first(False)
        had_busy = bool(group.busy)
        group.busy[item] = next(self._clock)
        if group.idle.pop(item) == was_first:
            self._push(source, n, False)
        if not had_busy:
            self._push(source, n, True)

    def remove(self, item: T) -> bool:
        """Forget ``item``; False when it was not in the table."""
        source = self._order.pop(item, None)
        if source is None:
            return False
        group = self._groups[source]
        n = len(group)
        if group.idle.pop(item, None) is None:
            group.busy.pop(item, None)
        if n == 1:
            del self._groups[source]
        self._recount(source, n, n - 1)
        return True
