"""Fair admission of connections a listener holds before they become links.

A listener keeps connections that have not authenticated yet, and authenticated ones still sending
their link or unlink hello, in tables of bounded size (:mod:`.listener`).  When a table is full, or
a source has its share, something must go; :class:`FairTable` chooses what, so that a flood of cheap
connections cannot keep a legitimate one out:

* the victim comes from the *source with the most entries* (an address: IPv4, or the /64 of an
  IPv6 address, :func:`source_of`), or from the new entry's own source when that source is at its
  share, never from a source with fewer entries;
* within that source, an entry that has not made progress yet (*idle*: for a connection not
  authenticated, one that has not sent a whole authentication hello; for an authenticated one, one
  that has not sent a byte of its link hello) goes before one that did, and the oldest goes first.

A legitimate initiator sends each message as soon as it can, so it is idle for at most one round
trip, and it is evicted only by a flood from its own address that makes more connections progress
as far as it did than that source's share within that round trip.  Every operation is O(1) (the largest source is tracked in
count buckets).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Hashable
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
    __slots__ = ("idle", "busy")

    def __init__(self) -> None:
        self.idle: OrderedDict[T, None] = OrderedDict()  # oldest first
        self.busy: OrderedDict[T, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)

    def victim(self) -> T:
        return next(iter(self.idle or self.busy))


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
        self._by_count: dict[int, set[str]] = {}
        self._max = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order

    def count(self, source: str) -> int:
        group = self._groups.get(source)
        return 0 if group is None else len(group)

    def oldest(self) -> T | None:
        return next(iter(self._order), None)

    def items(self) -> list[T]:
        return list(self._order)

    def _recount(self, source: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_count[old]
            bucket.discard(source)
            if not bucket:
                del self._by_count[old]
        if new:
            self._by_count.setdefault(new, set()).add(source)
        if new > self._max:
            self._max = new
        while self._max and self._max not in self._by_count:
            self._max -= 1

    def add(self, item: T, source: str) -> list[T]:
        """Insert ``item`` (idle) from ``source``; the entries evicted to make room (already
        removed: the caller closes them)."""
        evicted: list[T] = []
        if self.count(source) >= self.per_source:
            evicted.append(self._groups[source].victim())
            self.remove(evicted[-1])
        while len(self._order) >= self.total:
            largest = next(iter(self._by_count[self._max]))
            evicted.append(self._groups[largest].victim())
            self.remove(evicted[-1])
        group = self._groups.get(source)
        if group is None:
            group = self._groups[source] = _Group()
        n = len(group)
        group.idle[item] = None
        self._order[item] = source
        self._recount(source, n, n + 1)
        return evicted

    def progressed(self, item: T) -> None:
        """``item`` received bytes: it is no longer evicted before the idle entries of its source."""
        source = self._order.get(item)
        if source is None:
            return
        group = self._groups[source]
        if group.idle.pop(item, 0) is None:
            group.busy[item] = None

    def remove(self, item: T) -> bool:
        """Forget ``item``; False when it was not in the table."""
        source = self._order.pop(item, None)
        if source is None:
            return False
        group = self._groups[source]
        n = len(group)
        if group.idle.pop(item, 0) is not None:
            group.busy.pop(item, None)
        if n == 1:
            del self._groups[source]
        self._recount(source, n, n - 1)
        return True
